"""``while i < n:`` loops with an int counter stepped by a constant and a symbolic bound,
rolled by symbolic/rolled/while_loops.py: the body captured once, the trip count a run-time
value. Each case is compared with eager over 30 trip counts (values, gradients, the counter
after the loop, the heap, exceptions): one capture, no ``cache_limit`` fallback; bit for bit
with ``templates="exact"``, within rounding by default. Loops that cannot be rolled are unrolled,
still equal to eager, and ``explain()`` says why."""
import copy
import dis

import pytest
import torch
from torch import nn

import specularch

from differential import A, T, assert_same, check

COUNTS = list(range(2, 32))  # 30 trip counts
MODES = [("exact", 0.0), ("batched", 1e-5)]


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _assert_rolled_once(report, form):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == form and len(loop.trips) == 16, report
    assert f"({form}): body" in str(report) and "trip counts of the last calls" in str(report)


def _count_up(x, w, h, n):
    i = 0
    outs = []
    while i < n:
        h = torch.tanh(x[i] @ w + h)
        outs.append(h * 2)
        i += 1
    return torch.stack(outs), h, i


def _odd_steps(x, w, h, n):
    i = 1
    while i <= n:
        h = torch.sigmoid(x[i - 1] @ w) * h + i
        i += 2
    return h, i


def _count_down(x, w, h, n):
    i = 40
    while i > n:
        h = torch.tanh(x[(40 - i) // 3] @ w + h)
        i -= 3
    return h, i


def _over_the_rows(x, w, h):
    t = 0
    while t < x.size(0) - 1:  # the bound read by a call, in every test as in the first
        h = torch.tanh(x[t] @ w + x[t + 1] @ w + h)
        t += 1
    return h, t


def _rows_args(i):
    (x, w, h, _), _ = _args(i)
    return A(x, w, h)


def _args(i):
    n = COUNTS[i % len(COUNTS)]
    return A(T(n, 3, 5, requires_grad=True), T(5, 5, requires_grad=True), T(3, 5), n)


def _down_args(i):
    (x, w, h, n), _ = _args(i)
    return A(x, w, h, 40 - 3 * n)


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args, form", [
    (_count_up, _args, "while i < L['n']"),
    (_odd_steps, _args, "while i <= L['n']"),
    (_count_down, _down_args, "while i > L['n']"),
    (_over_the_rows, _rows_args, "while t < (L['x'].shape[0] - 1)"),
])
def test_a_while_loop_with_a_counter_is_rolled_once(fn, make_args, form, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, make_args, calls=len(COUNTS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report, form)


def _zero_or_one_trips(i):
    (x, w, h, n), _ = _args(i)
    return A(x, w, h, [0, 1, n, -2][i % 4])


def test_zero_and_one_trips_are_eagers():
    report = check(_count_up_or_none, _zero_or_one_trips, calls=16, grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _count_up_or_none(x, w, h, n):
    i = 0
    while i < n:
        h = torch.tanh(x[i] @ w + h)
        i += 1
    return h * w.sum(), i


def test_an_exception_inside_a_rolled_while_loop_is_eagers():
    def make_args(i):
        (x, w, h, n), _ = _args(i)
        return A(x, w, h, n + (i % 7 == 6))  # every 7th call: IndexError in the last iteration
    report = check(_count_up, make_args, calls=len(COUNTS), grad=True)
    assert report.stats.captures == 1, report
    assert any(loop.rolled for loop in _loops(report)), report


def _breaks(x, w, h, n):
    i = 0
    while i < n:
        h = torch.tanh(x[i] @ w + h)
        i += 1
        if i == 3:
            break
    return h, i


def _branches_on_the_counter(x, w, h, n):
    i = 0
    while i < n:
        h = torch.tanh(x[i] @ w + h) if i % 2 else h * 0.5
        i += 1
    return h, i


def _steps_by_the_data(x, w, h, n):
    i = 0
    while i < n:
        h = torch.tanh(x[i] @ w + h)
        i += 1 if i < 2 else 2
    return h, i


def _moves_its_bound(x, w, h, n):
    i = 0
    while i < n:
        h = torch.tanh(x[i] @ w + h)
        i += 1
        n = n - 1  # the bound changes per iteration: not the form rolled/while_loops.py rolls
    return h, i, n


def test_a_while_loop_whose_bound_changes_is_unrolled_and_noted():
    report = check(_moves_its_bound, _args, calls=8, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert all(loop.form == "while loop" and "its condition is decided by Python values"
               in loop.why for loop in loops), report


@pytest.mark.parametrize("fn, why", [
    (_breaks, "the body uses the loop index as a Python value"),
    (_branches_on_the_counter, "the body uses the loop index as a Python value"),
    (_steps_by_the_data, "the body uses the loop index as a Python value"),
])
def test_a_while_loop_that_cannot_roll_is_unrolled_equal_to_eager_and_says_why(fn, why):
    report = check(fn, _args, calls=8, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(loop.form == "while i < L['n']" and why in loop.why for loop in loops), report


class _Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)
        self.last = torch.zeros(2, 4)

    def forward(self, x, n):
        h = torch.zeros(x.shape[1], 4)
        t = 0
        while t < n:
            h = self.cell(x[t], h)
            t += 1
        self.last = h.detach()  # a heap write after the loop, committed as eager's
        return self.out(h)


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, n, y):
        opt.zero_grad()
        loss = ((model(x, n) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_through_a_while_loop_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Reader()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(4)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for n in COUNTS:
            x = torch.randn(n, 2, 3, generator=data)
            y = torch.randn(2, 2, generator=data)
            assert_same(eager_step(x, n, y), opt_step(x, n, y), f"loss at {n}", **close)
            assert_same(eager_model.last, opt_model.last, f"last after {n}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after {n}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after {n}", **close)
    _assert_rolled_once(specularch.explain(opt_step), "while t < L['n']")


def test_a_while_loop_with_a_long_body_rolls():
    """A body longer than 255 code units: both tests' jumps carry an ``EXTENDED_ARG`` prefix
    (before, such a loop never rolled)."""
    lines = "\n".join("        h = torch.tanh(h * 0.5 + x[i])" for _ in range(40))
    source = f"def long_body(x, h, n):\n    i = 0\n    while i < n:\n{lines}\n        i += 1\n" \
             "    return h, i\n"
    namespace = {"torch": torch}
    exec(compile(source, "<long body>", "exec"), namespace)
    fn = namespace["long_body"]
    assert any(i.opname == "EXTENDED_ARG" for i in dis.get_instructions(fn)), "body too short"
    report = check(fn, lambda i: A(T(40, 3), T(3), COUNTS[i]), calls=12, rtol=1e-6, atol=1e-7)
    assert report.stats.captures == 1 and any(loop.rolled for loop in _loops(report)), report
