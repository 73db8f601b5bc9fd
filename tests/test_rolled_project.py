"""A rolled LSTM cell's input projection computed before the loop for all iterations
(symbolic/rolled/project.py), and a hoisted tail that runs the loop's first item with the
others (symbolic/rolled/head.py): equal to eager within rounding (values, gradients of inputs,
state and weights, double backward, parameters after several optimizer steps, every length
including 1), and nothing of it with ``templates="exact"`` (eager's bits)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch.fx_lower.rolled import cells as rolled_cells
from specularch.symbolic.rolled.head import HeadedTail
from specularch.symbolic.rolled.hoist import HoistedTail
from specularch.symbolic.rolled.loops import RolledLoop
from specularch.workloads import lstm_lm

from differential import A, T, assert_same, check, lm_train_step
from test_rolled_fast import LENGTHS, RTOL, _train_both

PROJECTED = "1 LSTM input projections computed before the loop"


def _graph(opt_fn):
    return specularch.api._state_of(opt_fn).entries[0].capture.graph_module


def _targets(gm, kind):
    return [n.target for n in gm.graph.nodes if isinstance(n.target, kind)]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_lm_projects_layer_0_before_the_loop_and_trains_like_eager(dropout):
    # layer 0 reads the embedding (computed before the loop): its projection moves; layer 1
    # reads layer 0's new state: it stays a whole cell. A real dropout keeps layer 0's input
    # (a random draw) in the body: nothing to project before the loop.
    report = _train_both([*LENGTHS, 1, 3], dropout=dropout, templates="batched", rtol=RTOL,
                         momentum=0.9)
    assert report.stats.captures == 1 and not report.fallbacks, report
    (loop,) = report.graphs[0].loops
    assert "2 LSTM cells fused" in loop.faster, report
    assert (PROJECTED in loop.faster) == (dropout == 0.0), report


def test_the_lm_decoder_of_the_first_step_runs_with_the_others():
    torch.manual_seed(0)
    model = lstm_lm.LSTMLM(40, 12, 2, dropout=0.0)
    step = specularch.optimize(lm_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    data = torch.Generator().manual_seed(1)
    for n in [3, 4, 5, 6, 7]:
        step(torch.randint(0, 40, (n, 5), generator=data), torch.randint(0, 40, (n, 5), generator=data))
    gm = _graph(step)
    (loop,) = _targets(gm, RolledLoop)
    # iteration 0's decoder: in the tail, on all steps at once: a tail joining the peeled
    # step 0's input, or none to join where the body runs step 0 too (symbolic/rolled/first.py)
    (tail,) = _targets(gm, HeadedTail) if loop.first else _targets(gm, HoistedTail)
    linears = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "linear"]
    assert not linears, gm.code
    cells = [n.target for n in loop.body.graph.nodes if n.target in rolled_cells.UNFUSED]
    assert cells == [rolled_cells.fused_projected_cell, rolled_cells.fused_lstm_cell], \
        loop.body.code


def test_exact_mode_projects_nothing_and_keeps_eager_bits():
    report = _train_both(LENGTHS, dropout=0.0, templates="exact", rtol=0.0)
    (loop,) = report.graphs[0].loops
    assert loop.rolled and loop.faster == "", report
    assert "headed_tail" not in report.graphs[0].code, report.graphs[0].code


class _RowCells(nn.Module):
    """A cell reading rows of an input (projected before the loop) under a second one;
    ``frozen``: which weights do not train (none, the first cell's, all)."""

    def __init__(self, frozen):
        super().__init__()
        self.a, self.b = nn.LSTMCell(4, 5), nn.LSTMCell(5, 5)
        self.a.requires_grad_(frozen == "none")
        self.b.requires_grad_(frozen != "all")

    def forward(self, x, h, c, hb, cb):
        for t in range(x.shape[0]):
            h, c = self.a(x[t], (h, c))
            hb, cb = self.b(torch.sigmoid(h), (hb, cb))
        return hb.pow(2).sum() + c.sum()


def _row_args(i):
    # float64: the projection's product over all rows sums in another order than eager's
    # per-row products, and double backward amplifies that in float32 past a tight rtol
    n = [3, 5, 4, 6, 2, 7, 9, 1, 8][i]
    gen = torch.Generator().manual_seed(i)

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(grad)
    return t(n, 3, 4, grad=True), t(3, 5, grad=True), t(3, 5), t(3, 5), t(3, 5)


@pytest.mark.parametrize("frozen", ["none", "a", "all"])
def test_projected_cells_give_eager_gradients_and_double_backward(frozen):
    torch.manual_seed(0)
    eager = _RowCells(frozen).double()
    opt = specularch.optimize(copy.deepcopy(eager))
    tol = {"rtol": 1e-10, "atol": 1e-12}
    for i in range(9):
        args_e, args_o = _row_args(i), _row_args(i)
        for model, args in ((eager, args_e), (opt, args_o)):
            model.zero_grad()
            loss = model(*args)
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, [*params, args[0], args[1]], create_graph=True)
            (sum(g.pow(2).sum() for g in grads) + loss).backward()
        for k in (0, 1):
            assert_same(args_e[k].grad, args_o[k].grad, f"call {i} arg {k} grad", **tol)
        for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
            assert_same(p.grad, q.grad, f"call {i} {name}.grad", **tol)
    report = specularch.explain(opt)
    assert report.stats.graph_hits >= 3, report
    assert PROJECTED in report.graphs[-1].loops[0].faster, report


def _decoded(x, w, b, h):
    outs = []
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] + h)
        outs.append(F.linear(h, w, b))
    return torch.stack(outs), h


def test_a_hoisted_linear_runs_the_first_item_with_the_others():
    lengths = [4, 6, 3, 7, 5, 9, 1, 2, 8]
    report = check(_decoded, lambda i: A(T(lengths[i], 3, 5, requires_grad=True),
                                         T(6, 5, requires_grad=True), T(6, requires_grad=True),
                                         T(3, 5, requires_grad=True)),
                   calls=len(lengths), grad=True, expect="graph", rtol=RTOL, atol=1e-7)
    code = report.graphs[-1].code
    # the first item joins the others' tail, or the body runs iteration 0 (symbolic/rolled/first.py)
    assert "headed_tail" in code or "linear" not in code and "hoisted_tail" in code, code


def _decoded_peeled(x, w, b, h):
    outs, scale = [], 2.0
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] * scale + h)  # iteration 0's scale is not the body's: it stays peeled
        scale = 1.0
        outs.append(F.linear(h, w, b))
    return torch.stack(outs), h


def test_a_hoisted_linear_runs_a_peeled_first_item_with_the_others():
    lengths = [4, 6, 3, 7, 5, 9, 1, 2, 8]
    report = check(_decoded_peeled, lambda i: A(T(lengths[i], 3, 5, requires_grad=True),
                                                T(6, 5, requires_grad=True), T(6, requires_grad=True),
                                                T(3, 5, requires_grad=True)),
                   calls=len(lengths), grad=True, expect="graph", rtol=RTOL, atol=1e-7)
    assert "headed_tail" in report.graphs[-1].code, report.graphs[-1].code


def _head_unlike_the_rows(x, w, h):
    outs = [h[:1] * w]  # an item before the loop: its input has 1 row, the loop's have 3
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] + h)
        outs.append(h * w)
    return torch.stack(outs), h


def test_a_first_item_whose_input_is_unlike_the_rows_runs_on_its_own():
    lengths = [4, 6, 3, 7, 5, 9, 1, 2]
    check(_head_unlike_the_rows, lambda i: A(T(lengths[i], 3, 5, requires_grad=True),
                                             T(3, 5, requires_grad=True),
                                             T(3, 5, requires_grad=True)),
          calls=len(lengths), grad=True, expect="graph", rtol=RTOL, atol=1e-7)
