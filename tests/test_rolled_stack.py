"""A rolled loop whose body is a stack of LSTM cells runs as one autograd node for the whole
loop (fx_lower/rolled/stack.py, stack_plan.py), outside exact mode: values, gradients
of every input (initial states, the input rows, weights, frozen or shared ones), parameters
after several optimizer steps, the state kept on the model, a second backward through a
retained graph, eager's error for a freed one, double backward, no_grad; bodies that are not
a plain stack keep the per-iteration fused cells."""
import copy

import pytest
import torch
from torch import nn

import specularch
from specularch.fx_lower.rolled import stack as rolled_stack
from specularch.workloads import lstm_lm

from differential import T, assert_same
from test_rolled_fast import LENGTHS, RTOL, _train_both

TOL = {"rtol": RTOL, "atol": 1e-6}
STACK = "the cells' stack run as one autograd node per call"


def _close(a, b, what):
    """Equal within float rounding at the tensor's own scale (a gradient summed over many
    steps rounds at the size of its largest terms)."""
    scale = 1.0 if a is None else max(1.0, a.abs().max().item())
    assert_same(a, b, what, rtol=RTOL, atol=1e-6 * scale)


def _stacked(report) -> bool:
    return any(STACK in loop.faster for graph in report.graphs for loop in graph.loops)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_lm_trains_like_eager_with_its_loop_as_one_node(layers):
    report = _train_both(LENGTHS, dropout=0.0, templates="batched", rtol=RTOL, momentum=0.9,
                         layers=layers)
    assert report.stats.captures == 1 and not report.fallbacks, report
    (loop,) = report.graphs[0].loops
    assert loop.rolled and STACK in loop.faster, report
    assert list(loop.trips)[-3:] == LENGTHS[-3:], report


def test_a_real_dropout_between_the_cells_keeps_them_per_iteration():
    report = _train_both(LENGTHS[:8], dropout=0.3, templates="batched", rtol=RTOL)
    (loop,) = report.graphs[0].loops
    assert "2 LSTM cells fused" in loop.faster and STACK not in loop.faster, report


class _Stack(nn.Module):
    """Cells of different sizes over ``x[t]``; the per-iteration outputs are every cell's
    ``h`` and the last one's ``c``; ``shared``: the second cell is the first one again (one
    set of weights, two states); ``frozen``: the last cell's weights need no gradient."""

    def __init__(self, shared=False, frozen=False):
        super().__init__()
        self.a = nn.LSTMCell(4, 4)
        self.b = self.a if shared else nn.LSTMCell(4, 5)
        self.c = nn.LSTMCell(5 if not shared else 4, 3)
        self.c.requires_grad_(not frozen)

    def forward(self, x, h, c, hb, cb, hc, cc):
        ha, hbs, hcs, ccs = [], [], [], []
        for t in range(x.shape[0]):
            h, c = self.a(x[t], (h, c))
            hb, cb = self.b(h, (hb, cb))
            hc, cc = self.c(hb, (hc, cc))
            ha.append(h)
            hbs.append(hb)
            hcs.append(hc)
            ccs.append(cc)
        outs = [torch.stack(v) for v in (ha, hbs, hcs, ccs)]
        return sum((o * (k + 1)).sum() for k, o in enumerate(outs)) + c.pow(2).sum() + hc.sum()


def _stack_args(i, shared=False, requires_grad=True):
    n = [3, 5, 4, 7, 2, 6, 9, 8, 10, 1][i]
    hb = 4 if shared else 5
    return (T(n, 3, 4, requires_grad=requires_grad, seed=i),
            T(3, 4, requires_grad=requires_grad, seed=100 + i), T(3, 4, seed=200 + i),
            T(3, hb, seed=300 + i), T(3, hb, requires_grad=requires_grad, seed=400 + i),
            T(3, 3, seed=500 + i), T(3, 3, seed=600 + i))


@pytest.mark.parametrize("shared,frozen", [(False, False), (True, False), (False, True)])
def test_stack_gives_eager_values_and_gradients_of_every_input(shared, frozen):
    torch.manual_seed(0)
    eager = _Stack(shared, frozen)
    opt = specularch.optimize(copy.deepcopy(eager))
    for i in range(10):
        args_e, args_o = _stack_args(i, shared), _stack_args(i, shared)
        out_e, out_o = eager(*args_e), opt(*args_o)
        assert_same(out_e, out_o, f"call {i}", **TOL)
        out_e.backward()
        out_o.backward()
        for k, (a, b) in enumerate(zip(args_e, args_o)):
            _close(a.grad, b.grad, f"call {i} arg {k} grad")
        for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
            _close(p.grad, q.grad, f"call {i} {name}.grad")
    assert _stacked(specularch.explain(opt)), specularch.explain(opt)
    with torch.no_grad():  # no autograd: the same values
        args = _stack_args(3, shared)
        assert_same(eager(*args), opt(*args), "under no_grad", **TOL)


def _lm_twins(layers=2):
    torch.manual_seed(0)
    eager = lstm_lm.LSTMLM(30, 6, layers, dropout=0.0)
    return eager, specularch.optimize(copy.deepcopy(eager))


def _tokens(i, n=None):
    n = n or [3, 5, 4, 6, 7, 2, 8, 9][i]
    return torch.randint(0, 30, (n, 4), generator=torch.Generator().manual_seed(i))


def _compare_models(eager, opt, what):
    for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
        _close(p.grad, q.grad, f"{what}: {name}.grad")


def test_a_retained_graph_gives_eager_gradients_twice_and_a_freed_one_eagers_error():
    eager, opt = _lm_twins()
    for i in range(8):
        outs = []
        for model in (eager, opt):
            model.zero_grad()
            model.reset_state()
            loss = model(_tokens(i)).pow(2).mean()
            loss.backward(retain_graph=True)
            loss.backward()  # the second one through the retained graph
            outs.append(loss)
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
        assert_same(outs[0], outs[1], f"call {i}", **TOL)
        _compare_models(eager, opt, f"call {i}")
    assert _stacked(specularch.explain(opt)), specularch.explain(opt)


def test_double_backward_through_the_stack_matches_eager():
    eager, opt = _lm_twins()
    for i in range(8):
        grads = []
        for model in (eager, opt):
            model.zero_grad()
            model.reset_state()
            loss = model(_tokens(i)).pow(2).mean()
            params = list(model.parameters())
            first = torch.autograd.grad(loss, params, create_graph=True)
            sum(g.pow(2).sum() for g in first).backward()
            grads.append([p.grad for p in params])
        for a, b in zip(*grads):
            assert_same(a, b, f"call {i}", rtol=1e-4, atol=1e-6)
    assert _stacked(specularch.explain(opt)), specularch.explain(opt)


def test_the_state_kept_on_the_model_carries_eager_gradients_into_a_later_backward():
    # the state after one call is the next call's detached input; its history (the stack's
    # node) can still be differentiated by the caller
    eager, opt = _lm_twins()
    for i in range(8):
        sums = []
        for model in (eager, opt):
            model.zero_grad()
            model(_tokens(i))
            (h, c), (h2, c2) = model.state
            total = h.sum() + c.pow(2).sum() + h2.pow(2).sum() * 3 + c2.sum()
            total.backward()
            sums.append(total)
        assert_same(sums[0], sums[1], f"call {i}", **TOL)
        _compare_models(eager, opt, f"call {i}")
    assert _stacked(specularch.explain(opt)), specularch.explain(opt)


def test_inputs_of_other_sizes_than_the_plans_run_the_body_per_iteration():
    # (the graph's guards catch a call of other sizes first; the stack checks them again)
    eager, opt = _lm_twins()
    for i in range(6):
        opt(_tokens(i))
    stack = next(_stacks(opt))
    shapes = stack.plan.row_shapes
    rows = tuple(torch.zeros(2, *shapes[r]) for r in range(max(shapes) + 1))
    carried = [None] * len(stack.plan.carried)
    for cell in stack.plan.cells:
        carried[cell.h] = carried[cell.c] = torch.zeros(7, 6)  # another batch size
    invariants = [None] * (max(stack.weights) + 1)
    for p in stack.weights:
        invariants[p] = torch.zeros(stack.plan.weight_shapes[p])
    assert stack(2, tuple(carried), tuple(invariants), rows) is None


def _stacks(opt):
    from specularch.dispatch.state import all_states
    from specularch.symbolic.rolled.loops import RolledLoop
    for state in all_states():
        for entry in state.entries:
            capture = getattr(entry, "capture", None)
            for node in [] if capture is None else capture.graph_module.graph.nodes:
                if isinstance(node.target, RolledLoop) and node.target.prepare is not None \
                        and isinstance(node.target.prepare.stack, rolled_stack.Stack):
                    yield node.target.prepare.stack


def test_torch_func_grad_of_grad_through_the_stack_matches_eager():
    torch.manual_seed(0)
    eager = _Stack()
    opt = specularch.optimize(copy.deepcopy(eager))
    for i in range(4):  # a graph with the stack exists before torch.func calls it
        opt(*_stack_args(i)).backward()
    assert _stacked(specularch.explain(opt)), specularch.explain(opt)
    for i in range(4, 7):
        x, h, *rest = _stack_args(i, requires_grad=False)
        results = []
        for model in (eager, opt):
            def first(h0, model=model):
                return torch.func.grad(lambda h1: model(x, h1, *rest))(h0).pow(2).sum()
            results.append(torch.func.grad(first)(h))
        _close(results[0], results[1], f"call {i}")
