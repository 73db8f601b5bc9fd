"""Compiling backends on graphs with rolled loops (fx_lower/rolled/compiled.py): the graph runs
as ``fx`` and the loop body is compiled once per input shapes and run from the loop, instead
of the backend refusing the graph. Equal to eager within rounding; bodies it cannot compile
keep running as ``fx`` and ``explain()`` says why."""
import copy

import torch

import specularch

from differential import A, T, assert_same, check
from test_rolled_fast import LENGTHS, RTOL, _Cells, _cell_args, _train_both


def test_torchscript_leaves_the_lm_loop_to_its_one_node_and_trains_like_eager():
    # the LM's body is a stack of LSTM cells: it runs as one autograd node (fx_lower/rolled/stack.py),
    # not compiled
    report = _train_both(LENGTHS, dropout=0.0, templates="batched", rtol=RTOL, momentum=0.9,
                         backend="torchscript")
    assert report.stats.captures == 1 and not report.fallbacks, report
    graph = report.graphs[0]
    assert graph.backend == "torchscript", report
    assert "body not compiled by torchscript: it runs as one node" in graph.loops[0].faster, report
    assert list(graph.loops[0].trips)[-3:] == LENGTHS[-3:], report


def test_torchscript_compiles_a_loop_body_of_fused_cells_and_trains_like_eager():
    # (a tanh between the cells: not a plain stack)
    torch.manual_seed(0)
    eager = _Cells(False)
    opt = specularch.optimize(copy.deepcopy(eager), backend="torchscript")
    for i in range(9):
        args_e, args_o = _cell_args(i), _cell_args(i)
        out_e, out_o = eager(*args_e), opt(*args_o)
        assert_same(out_e, out_o, f"call {i}", rtol=RTOL)
        out_e.backward()
        out_o.backward()
        for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
            assert_same(p.grad, q.grad, f"call {i} {name}.grad", rtol=RTOL, atol=1e-6)
    graph = specularch.explain(opt).graphs[-1]
    assert graph.backend == "torchscript" and "body compiled by torchscript" in graph.loops[0].faster, \
        specularch.explain(opt)


def _index_in_arithmetic(x, w, n):
    h = x
    for t in range(n):
        h = torch.tanh(h @ w) + t  # the index reaches a tensor op: the body would specialise on it
    return h


def test_a_body_using_the_index_in_tensor_math_runs_as_fx_and_says_why():
    report = check(_index_in_arithmetic, lambda i: A(T(2, 3, requires_grad=True),
                                                     T(3, 3, requires_grad=True), [3, 5, 4, 6, 8, 7][i]),
                   calls=6, grad=True, expect="graph", backend="torchscript", rtol=RTOL, atol=1e-7)
    loop = report.graphs[-1].loops[0]
    assert loop.rolled and "body not compiled by torchscript: it uses the loop index" in loop.faster, report


def test_a_compiled_body_stays_with_its_candidate():
    """A compiling backend sets the loop's compiled body on its own copy of the graph's
    loops: the graph it compiled from (the ``fx`` tier's, run during the candidate's trial
    and for good if it is rejected) still runs the body as captured."""
    from specularch.fx_lower import get_backend
    torch.manual_seed(0)
    eager = _Cells(False)
    opt = specularch.optimize(copy.deepcopy(eager), backend="fx")
    for i in range(4):
        opt(*_cell_args(i))
    entry = max(specularch.api._state_of(opt).entries, key=lambda e: e.hits)
    gm = entry.capture.graph_module
    loops = [n.target for n in gm.graph.nodes if hasattr(n.target, "run_body")]
    examples = [n.meta.get("example") for n in gm.graph.nodes if n.op == "placeholder"]
    compiled = get_backend("torchscript").compile(gm, examples)
    assert loops and all(loop.run_body is None for loop in loops)
    own = [n.target for n in compiled.__self__.graph.nodes if hasattr(n.target, "run_body")]
    assert own and all(loop.run_body is not None for loop in own)
    assert not set(map(id, own)) & set(map(id, loops))
