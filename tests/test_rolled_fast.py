"""A rolled loop's body made cheaper (symbolic/rolled/fast.py, fx_lower/rolled/cells.py):
what an iteration computes from the index and invariants alone runs once before the loop, and
LSTM cells run as one autograd node per iteration with one weight-gradient product per call.
Equal to eager within rounding by default (values, gradients, parameters after several
optimizer steps, the state kept on the model), bit for bit with ``templates="exact"``, which
keeps the body as captured; one capture for every length."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch.workloads import lstm_lm

from differential import lm_train_step, A, T, assert_same, check

RTOL = 1e-5


_lm_step = lm_train_step


def _train_both(lengths, *, dropout, templates, rtol, momentum=0.0, layers=2, backend="fx"):
    torch.manual_seed(0)
    eager_model = lstm_lm.LSTMLM(40, 12, layers, dropout=dropout)
    opt_model = copy.deepcopy(eager_model)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    eager_step = _lm_step(eager_model, sgd(eager_model))
    with specularch.config.patch(templates=templates):
        opt_step = specularch.optimize(_lm_step(opt_model, sgd(opt_model)), backend=backend)
        data = torch.Generator().manual_seed(1)
        for i, n in enumerate(lengths):
            tokens = torch.randint(0, 40, (n, 5), generator=data)
            targets = torch.randint(0, 40, (n, 5), generator=data)
            torch.manual_seed(100 + i)
            expected = eager_step(tokens, targets)
            torch.manual_seed(100 + i)
            got = opt_step(tokens, targets)
            close = {"rtol": rtol, "atol": rtol * 1e-2}
            assert_same(expected, got, f"loss of step {i} (length {n})", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after step {i}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after step {i}", **close)
            assert_same(eager_model.state, opt_model.state, f"model.state after step {i}", **close)
    return specularch.explain(opt_step)


LENGTHS = [3, 4, 5, 6] + [9, 2, 12, 7, 15, 10, 8]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lm_body_runs_fused_cells_and_the_embedding_before_the_loop(dropout):
    report = _train_both(LENGTHS, dropout=dropout, templates="batched", rtol=RTOL, momentum=0.9)
    assert report.stats.captures == 1 and not report.fallbacks, report
    (loop,) = report.graphs[0].loops
    assert loop.rolled and "2 LSTM cells fused" in loop.faster, report
    # the embedding lookup of `tokens[t]` (and dropout with p=0) moves; a real dropout stays
    assert "computed before the loop" in loop.faster, report
    assert list(loop.trips)[-3:] == LENGTHS[-3:], report


def test_exact_mode_keeps_the_body_and_eager_bits():
    report = _train_both(LENGTHS, dropout=0.0, templates="exact", rtol=0.0)
    (loop,) = report.graphs[0].loops
    assert loop.rolled and loop.faster == "", report


class _Cells(nn.Module):
    """Two cells over a sequence, the second's weights frozen, the first's input from a
    table: every gradient path of the fused cell (x, h, c, weights, none)."""

    def __init__(self, frozen):
        super().__init__()
        self.table = nn.Embedding(11, 6)
        self.a, self.b = nn.LSTMCell(6, 5), nn.LSTMCell(5, 5)
        self.b.requires_grad_(not frozen)

    def forward(self, tokens, h, c, hb, cb):
        outs = []
        for t in range(tokens.shape[0]):
            h, c = self.a(torch.relu(self.table(tokens[t])), (h, c))
            # (b reading the raw h: test_rolled_loops.py's stacked cells)
            hb, cb = self.b(torch.tanh(h), (hb, cb))
            outs.append(hb)
        return torch.stack(outs).sum() + c.sum() * 2


def _cell_args(i):
    n = [3, 5, 4, 7, 2, 6, 9, 8, 10, 11][i]
    return (torch.randint(0, 11, (n, 3), generator=torch.Generator().manual_seed(i)),
            T(3, 5, requires_grad=True, seed=i), T(3, 5, requires_grad=True, seed=100 + i),
            T(3, 5, seed=200 + i), T(3, 5, seed=300 + i))


@pytest.mark.parametrize("frozen", [False, True])
def test_fused_cells_give_eager_gradients_for_inputs_state_and_weights(frozen):
    torch.manual_seed(0)
    eager = _Cells(frozen)
    opt = specularch.optimize(copy.deepcopy(eager))
    for i in range(10):
        if i == 6:  # relaxing is done: no capture for any new length from here on
            captures = specularch.explain(opt).stats.captures
        args_e, args_o = _cell_args(i), _cell_args(i)
        out_e, out_o = eager(*args_e), opt(*args_o)
        assert_same(out_e, out_o, f"call {i}", rtol=RTOL)
        out_e.backward()
        out_o.backward()
        for k in (1, 2):
            assert_same(args_e[k].grad, args_o[k].grad, f"call {i} arg {k} grad", rtol=RTOL,
                        atol=1e-7)
        for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
            assert_same(p.grad, q.grad, f"call {i} {name}.grad", rtol=RTOL, atol=1e-7)
    report = specularch.explain(opt)
    assert report.stats.captures == captures and report.stats.graph_hits >= 4, report
    assert "2 LSTM cells fused" in report.graphs[-1].loops[0].faster, report
    with torch.no_grad():  # no autograd: the plain cell runs, same values
        args = _cell_args(3)
        assert_same(eager(*args), opt(*args), "under no_grad", rtol=RTOL)


def _lookups(x, table, h, n):
    for t in range(n):
        h = torch.tanh(F.embedding(x[t], table) * 2 + h)
    return h


def test_a_prelude_reading_past_the_indexed_tensor_raises_like_eager():
    # n is a Python number made symbolic: the last call asks for more rows than x has
    def args(i):
        n = [2, 3, 4, 5, 3, 6, 9][i]
        return A(torch.randint(0, 7, (6, 2), generator=torch.Generator().manual_seed(i)),
                 T(7, 4, requires_grad=True), T(2, 4, requires_grad=True), n)
    report = check(_lookups, args, calls=7, grad=True, rtol=RTOL, atol=1e-7)
    assert report.graphs and report.graphs[0].loops[0].rolled, report
    assert "computed before the loop" in report.graphs[0].loops[0].faster, report


def _reads_a_buffer_it_updates(x, b, h):
    buf = b * 1
    for t in range(x.shape[0]):
        h = torch.tanh(buf[t].exp() * 2 + h)  # row t as iteration t finds it
        buf.mul_(0.5)
    return h, buf


def _renormalising_lookups(tokens, weights, h):
    table = weights * 3
    for t in range(tokens.shape[0]):
        # max_norm renormalises, in place, the rows each iteration looks up
        h = torch.tanh(F.embedding(tokens[t], table, max_norm=1.0) + h + table.sum())
    return h, table


def _tokens(i):
    return torch.randint(0, 7, ([4, 6, 3, 7, 5, 9, 8][i], 3),
                         generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("fn, args", [
    (_reads_a_buffer_it_updates, lambda i: A(T([4, 6, 3, 7, 5, 9, 8][i], 3, 5),
                                            T([4, 6, 3, 7, 5, 9, 8][i], 3, 5), T(3, 5))),
    (_renormalising_lookups, lambda i: A(_tokens(i), T(7, 5), T(3, 5))),
])
def test_nothing_moves_before_the_loop_from_a_body_that_writes_in_place(fn, args):
    report = check(fn, args, calls=7, expect="graph", rtol=RTOL, atol=1e-6)
    (loop,) = report.graphs[0].loops
    assert loop.rolled and "computed before the loop" not in loop.faster, report


def _embedded(tokens, table, h):
    for t in range(tokens.shape[0]):
        h = torch.tanh(F.embedding(tokens[t], table) * 2 + h)
    return h


def test_a_lookup_out_of_range_in_a_late_iteration_raises_like_eager():
    # the lookups of every iteration run before the loop: the graph raises before iteration
    # 1, so the call runs eagerly and raises eager's error in iteration 3
    def args(i):
        tokens = _tokens(i)
        if i == 6:
            tokens[3, 1] = 9
        return A(tokens, T(7, 5, requires_grad=True), T(3, 5, requires_grad=True))
    report = check(_embedded, args, calls=7, grad=True, rtol=RTOL, atol=1e-6)
    assert report.graphs and "computed before the loop" in report.graphs[0].loops[0].faster, report
    assert any(f.kind == "exception_handling" for f in report.fallbacks), report
