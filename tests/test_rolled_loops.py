"""Rolled loops (symbolic/rolled/loops.py): ``for t in range(n)`` with a trip count that varies
between calls is captured once (the body once, ``n`` a run-time value), and stays equal to
eager: bit for bit with ``templates="exact"`` (values, gradients, parameters after optimizer
steps, heap writes), within float rounding by default, where what feeds only the appended
values runs once after the loop on their stacked inputs (symbolic/rolled/hoist.py). Loops that
are not regular fall back to unrolling, still equal, and ``explain()`` says why."""
import copy

import pytest
import torch
from torch import nn

import specularch
from specularch.workloads import lstm_lm

from differential import lm_train_step, A, T, assert_same, check


_lm_step = lm_train_step


def _train_both(lengths, layers=2, dropout=0.2, last_raises=None, templates="exact", rtol=0.0):
    with specularch.config.patch(templates=templates):
        return _train_both_in(lengths, layers, dropout, last_raises, rtol)


def _train_both_in(lengths, layers, dropout, last_raises, rtol):
    torch.manual_seed(0)
    eager_model = lstm_lm.LSTMLM(30, 8, layers, dropout=dropout)
    opt_model = copy.deepcopy(eager_model)
    eager_step = _lm_step(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.5))
    opt_step = specularch.optimize(_lm_step(opt_model, torch.optim.SGD(opt_model.parameters(), lr=0.5)))
    data = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):
        tokens = torch.randint(0, 30, (n, 4), generator=data)
        targets = torch.randint(0, 30, (n, 4), generator=data)
        torch.manual_seed(100 + i)  # dropout draws: the same stream on both sides
        if last_raises is not None and i == len(lengths) - 1:
            with pytest.raises(RuntimeError, match=last_raises) as eager_error:
                eager_step(tokens, targets)
            with pytest.raises(RuntimeError, match=last_raises) as opt_error:
                opt_step(tokens, targets)
            assert str(eager_error.value) == str(opt_error.value)
            break
        expected = eager_step(tokens, targets)
        torch.manual_seed(100 + i)
        got = opt_step(tokens, targets)
        close = {"rtol": rtol, "atol": rtol * 1e-2}  # atol: for the values near 0
        assert_same(expected, got, f"loss of step {i} (length {n})", **close)
        for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
            assert_same(p, q, f"{name} after step {i}", **close)
            assert_same(p.grad, q.grad, f"{name}.grad after step {i}", **close)
        assert_same(eager_model.state, opt_model.state, f"model.state after step {i}", **close)
    report = specularch.explain(opt_step)
    report.opt_step = opt_step
    return report


def _cache_limits(report) -> int:
    return sum(f.kind == "cache_limit" for f in report.fallbacks)


# exact: eager's order, bit for bit; batched (the default): the decoder hoisted, float rounding
MODES = [("exact", 0.0), ("batched", 1e-5)]


@pytest.mark.parametrize("templates, rtol", MODES)
def test_lstm_lm_training_step_captures_the_loop_once_for_every_length(templates, rtol):
    lengths = [3, 4, 5, 6] + [9, 2, 12, 7, 15, 10, 8, 13, 11, 14]  # 10 lengths after profiling
    report = _train_both(lengths, templates=templates, rtol=rtol)
    assert report.stats.captures == 1, report
    assert _cache_limits(report) == 0 and not report.fallbacks, report
    (loop,) = report.graphs[0].loops
    assert loop.rolled and loop.carried >= 4 and loop.outputs == 1, report
    assert list(loop.trips)[-3:] == lengths[-3:], report
    assert "rolled loop at" in str(report) and "lstm_lm.py" in str(report)


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_rolled_loop_runs_one_iteration_and_zero_raises_like_eager(templates, rtol):
    report = _train_both([3, 4, 5, 6, 1, 7], layers=1, templates=templates, rtol=rtol)
    assert report.stats.captures == 1 and not report.fallbacks, report
    # length 0: torch.stack([]) raises in eager; the rolled graph is guarded on n >= 1
    _train_both([3, 4, 5, 6, 7, 0], layers=1, last_raises="non-empty", templates=templates,
                rtol=rtol)


def test_a_step_taking_a_batch_tuple_relaxes_the_sizes_inside_it_and_rolls():
    # the benchmark's step: `train_step(batch)` with batch = (tokens, targets)
    from specularch.guards.relax import NESTED_SIZES
    torch.manual_seed(0)
    eager_model = lstm_lm.LSTMLM(30, 8, 1)
    opt_model = copy.deepcopy(eager_model)

    def make(model):
        step = _lm_step(model, torch.optim.SGD(model.parameters(), lr=0.5))
        return lambda batch: step(*batch)
    eager_step = make(eager_model)
    opt_step = specularch.optimize(make(opt_model))
    with specularch.config.patch(templates="exact"):  # bit for bit
        _batch_tuple_steps(eager_step, opt_step, eager_model, opt_model)
    report = specularch.explain(opt_step)
    # a few lengths get static graphs; from the NESTED_SIZES-th on, one rolled graph takes all
    assert report.stats.captures <= NESTED_SIZES and not report.fallbacks, report
    assert any("L['batch'][0]: dimension(s) [0] made dynamic" in r for r in report.relaxations), report
    assert report.graphs[0].loops[0].rolled and len(report.graphs[0].loops[0].trips) >= 8, report


def _batch_tuple_steps(eager_step, opt_step, eager_model, opt_model):
    data = torch.Generator().manual_seed(2)
    lengths = [3, 3, 4, 6, 5, 9, 2, 7, 12, 8, 10, 11, 13, 14, 15, 16]
    for i, n in enumerate(lengths):
        batch = tuple(torch.randint(0, 30, (n, 4), generator=data) for _ in range(2))
        torch.manual_seed(i)
        expected = eager_step(batch)
        torch.manual_seed(i)
        assert_same(expected, opt_step(batch), f"loss at length {n}")
    for p, q in zip(eager_model.parameters(), opt_model.parameters()):
        assert_same(p, q, "parameters")


def _length_args(i):
    n = [4, 6, 3, 7, 5, 9][i % 6]
    return A(T(n, 3, 5, requires_grad=True), T(5, 5, requires_grad=True), T(3, 5))


def _accumulate(x, w, h):
    outs = []
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] @ w + h)
        outs.append(h * 2)
    return torch.stack(outs), torch.cat(outs), len(outs), h


def test_a_loop_appending_to_a_list_is_rolled_and_equal_to_eager():
    report = check(_accumulate, _length_args, calls=6, grad=True, expect="graph")
    assert report.stats.captures == 1, report
    assert report.graphs[0].loops[0].rolled, report


def _index_steers_python(x, w, h):
    for t in range(x.shape[0]):
        if t % 2:  # the index as a Python value: the body differs per iteration
            h = h * 0.5
        h = torch.tanh(x[t] @ w + h)
    return h


def _carried_shape_grows(x, w, h):
    for t in range(x.shape[0]):
        h = torch.cat([h, x[t] @ w])  # h grows: no two iterations alike
    return h.sum(0)


def _reads_what_it_appends(x, w, h):
    outs = [h]
    for t in range(x.shape[0]):
        outs.append(x[t] @ w + outs[-1])
    return torch.stack(outs)


def _appends_numbers(x, w, h):
    sums = []
    for t in range(x.shape[0]):
        sums.append((x[t] @ w).sum().item())
    return (x.sum(0) + h) * sum(sums)


@pytest.mark.parametrize("fn, why", [
    (_index_steers_python, "loop index as a Python value"),
    (_carried_shape_grows, "changes shape"),
    (_reads_what_it_appends, "reads a list it appends to"),
    (_appends_numbers, "`sums` is appended a `.item()` value, not a tensor"),  # (user words)
])
def test_an_irregular_loop_is_unrolled_equal_to_eager_and_explained(fn, why):
    report = check(fn, _length_args, calls=5, grad=True)
    loops = [loop for graph in report.graphs for loop in graph.loops]
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(why in loop.why for loop in loops), report
    assert why in str(report)


def _scalar_trip_count(x, n):
    h = x
    for t in range(n):
        h = torch.sin(h) + t
    return h


def test_a_python_int_trip_count_made_symbolic_is_rolled():
    report = check(_scalar_trip_count, lambda i: A(T(3, requires_grad=True), [2, 5, 3, 4, 7, 9][i]),
                   calls=6, grad=True, expect="graph")
    assert report.stats.captures == 1, report
    assert report.graphs[0].loops[0].rolled, report


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 4)
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
            if h.sum() > 0:  # a tensor branch: assumed per iteration, checked at run time
                h = h * 0.5
        return h


def test_an_assumption_inside_the_body_is_checked_in_every_iteration():
    torch.manual_seed(0)
    eager, opt = _Gated(), None
    opt = specularch.optimize(copy.deepcopy(eager))
    data = torch.Generator().manual_seed(3)
    for n in [3, 4, 5, 6, 8, 5, 9, 7, 10, 6]:
        x = torch.randn(n, 2, 3, generator=data) * 3
        assert_same(eager(x), opt(x), f"length {n}")
    report = specularch.explain(opt)
    # the branch flipped in a later iteration of the rolled body: that call ran eagerly, and
    # the loop is unrolled from then on
    assert any(f.kind == "assumption_failed" and "rolled loop" in f.explanation
               for f in report.fallbacks), report
    assert any("failed at run time" in loop.why for g in report.graphs for loop in g.loops), report


def _reads_carried_sizes(x, w, h):
    outs = []
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] @ w + h / h.shape[0])  # the carried h's size, read in iteration 0 too
        outs.append(h.reshape(h.shape[0], -1))
    return torch.stack(outs), h


def test_a_size_of_a_carried_value_read_in_two_iterations_does_not_unroll_the_loop():
    args = lambda i: A(T([4, 6, 3, 7, 5, 9, 2, 8][i], 3, 5, requires_grad=True),  # noqa: E731
                       T(5, 5, requires_grad=True), T(3, 5, requires_grad=True))
    report = check(_reads_carried_sizes, args, calls=8, grad=True, expect="graph",
                   rtol=1e-5, atol=1e-6)
    assert report.stats.captures == 1, report
    assert report.graphs[0].loops[0].rolled, report


class _Stacked(nn.Module):
    """Cell b reads cell a's raw ``h``: both cells read its size (iteration 0, then every
    later iteration through the carried value)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.LSTMCell(4, 6), nn.LSTMCell(6, 6)

    def forward(self, x, h, c, hb, cb):
        for t in range(x.shape[0]):
            h, c = self.a(x[t], (h, c))
            hb, cb = self.b(h, (hb, cb))
        return hb.sum() + c.pow(2).sum()


@pytest.mark.parametrize("templates", ["exact", "batched"])
def test_stacked_cells_reading_the_raw_hidden_state_roll_once_for_twenty_lengths(templates):
    torch.manual_seed(0)
    eager = _Stacked()
    opt = specularch.optimize(copy.deepcopy(eager))
    lengths = [3, 5, 4, 6] + [2, 9, 7, 12, 8, 10, 11, 13, 15, 14, 16, 17, 20, 18, 19, 1]
    tol = {"rtol": 1e-5, "atol": 1e-6}
    with specularch.config.patch(templates=templates):
        for i, n in enumerate(lengths):
            if i == 4:  # relaxing is done: no capture for any new length from here on
                captures = specularch.explain(opt).stats.captures
            args_e = (T(n, 3, 4, requires_grad=True, seed=i), T(3, 6, requires_grad=True, seed=50 + i),
                      T(3, 6, seed=100 + i), T(3, 6, seed=150 + i), T(3, 6, seed=200 + i))
            args_o = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args_e)
            out_e, out_o = eager(*args_e), opt(*args_o)
            assert_same(out_e, out_o, f"length {n}", **tol)
            out_e.backward()
            out_o.backward()
            for k in (0, 1):
                assert_same(args_e[k].grad, args_o[k].grad, f"length {n}: arg {k} grad", **tol)
            for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
                assert_same(p.grad, q.grad, f"length {n}: {name}.grad", **tol)
    report = specularch.explain(opt)
    assert report.stats.captures == captures == 1 and not report.fallbacks, report
    assert report.graphs[0].loops[0].rolled, report


def test_messages_name_values_in_the_user_s_words():
    """``values.kind`` (rolled loops' refusals, operator refusals): raw items of a container
    snapshot too (a None in a closure's dict made a capture fail with an internal error)."""
    from specularch.symbolic.values import ConstV, ListV, TensorV, kind
    assert [kind(v) for v in (None, 3, ConstV(2.0), TensorV(None, torch.zeros(1)),
                                ListV([]))] == ["None", "an int", "a float", "a tensor", "a list"]


def _item_scaled(x, w, h):
    s = x.abs().max().item()  # before the loop: the same number in every iteration
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] @ w * s + h * (s / 2 + 1))
    return h


def _item_as_a_bound(x, w, h):
    s = w.abs().sum().item()
    for t in range(x.shape[0]):
        h = torch.clamp(x[t] @ w + h, -s, s).tanh()
    return h


def _item_tested_in_the_loop(x, w, h):
    s = x.mean().item()
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] @ w + h)
        if s > 10:  # never: speculated, checked in every iteration
            h = h * 0
    return h


@pytest.mark.parametrize("fn", [_item_scaled, _item_as_a_bound, _item_tested_in_the_loop])
def test_a_item_value_read_before_the_loop_does_not_stop_it_rolling(fn):
    """A ``.item()`` value from before the loop is a loop invariant (its graph number reads
    the tensor where ``.item()`` was called, though made at its first use in iteration 0):
    the loop rolls, one graph for every trip count (before: "`s` changes per iteration", one
    graph per length)."""
    report = check(fn, _length_args, calls=8, grad=True, expect="graph")
    assert report.stats.captures == 1 and report.graphs[0].loops[0].rolled, report


def _item_accumulated(x, w, h):
    total = 0.0
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] @ w + h)
        total = total + h.sum().item()  # changes per iteration: not carried by a rolled loop
    return h * total


def test_a_item_value_that_changes_per_iteration_still_unrolls_and_says_why():
    report = check(_item_accumulated, _length_args, calls=8, grad=True)
    loop = report.graphs[0].loops[0]
    assert not loop.rolled and "`total` changes per iteration" in loop.why, report


def _writes_only(x, n):
    z = x.clone()
    for t in range(n):
        z[t] = z[t] * 2 + 1  # nothing carried: the loop's only effect is the write
    z.add_(1)
    return z


def test_a_rolled_loop_that_only_writes_in_place_keeps_its_writes():
    """Its node has no user, so dead-code elimination dropped it (the writes were lost: a
    silent wrong answer, found by the symbolic-slice sweep); it is marked as writing now."""
    report = check(_writes_only, lambda i: A(T(9), 2 + i % 5), calls=10, expect="graph")
    assert report.stats.captures == 1 and report.graphs[0].loops[0].rolled, report


def _logs(x, log, n):
    h = x
    for t in range(n):
        h = torch.tanh(h)
        log.append(h.sum())
    return h


def test_a_loop_appending_to_a_list_from_outside_stays_unrolled_and_says_why():
    """The list's new items are committed to it one by one: the loop is unrolled (before,
    the rolled capture failed with an internal ``MalformedRebuild`` message)."""
    report = check(_logs, lambda i: A(T(3), [], 3 + i % 4), calls=8)
    assert any("appends to L['log'], a list that existed before the call" in loop.why
               for g in report.graphs for loop in g.loops), report
