"""Loop forms beyond ``for t in range(n)`` that symbolic/rolled/loops.py captures once, whatever the
trip count: ``range(a, b)`` / ``range(a, b, step)`` with run-time bounds. Each is compared
with eager over 30 trip counts (values, gradients, the heap, exceptions): one capture, no
``cache_limit`` fallback; bit for bit with ``templates="exact"``, within rounding by default.
Forms that cannot be rolled are unrolled, still equal, and ``explain()`` says why."""
import copy

import pytest
import torch
from torch import nn

import specularch

from differential import A, T, assert_same, check

LENGTHS = list(range(4, 34))  # 30 trip counts
MODES = [("exact", 0.0), ("batched", 1e-5)]


def _rolled(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops if loop.rolled]


def _assert_rolled_once(report, form):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = _rolled(report)
    assert loop.form == form and len(loop.trips) == 16, report
    assert f"({form}): body" in str(report), report


def _from_one(x, w, h):
    outs = []
    for t in range(1, x.shape[0]):
        h = torch.tanh(x[t] @ w + x[t - 1] @ w + h)
        outs.append(h * 2)
    return torch.stack(outs), h, t


def _every_other(x, w, h, a, b):
    outs = []
    for t in range(a, b, 2):
        h = torch.tanh(x[t] @ w + h)
        outs.append(h.sum(1))
    return torch.cat(outs), len(outs), h, t


def _backwards(x, w, h, a, b):
    for t in range(b - 1, a - 1, -1):
        h = torch.sigmoid(x[t] @ w) * h + t
    return h, t


def _args(i):
    n = LENGTHS[i % len(LENGTHS)]
    return A(T(n, 3, 5, requires_grad=True), T(5, 5, requires_grad=True), T(3, 5))


def _bounds_args(i):
    (x, w, h), _ = _args(i)
    return A(x, w, h, i % 3, x.shape[0])


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args, form", [
    (_from_one, _args, "range(a, b)"),
    (_every_other, _bounds_args, "range(a, b, step)"),
    (_backwards, _bounds_args, "range(a, b, step)"),
])
def test_a_range_with_run_time_bounds_is_rolled_once(fn, make_args, form, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, make_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report, form)


def _reads_past_the_end(x, w, h, a, b):
    for t in range(a, b):
        h = torch.tanh(x[t] @ w + h)
    return h


def _past_the_end_args(i):
    (x, w, h), _ = _args(i)
    return A(x, w, h, 1, x.shape[0] + (i % 7 == 6))  # every 7th call: IndexError in the loop


def test_an_exception_inside_a_rolled_range_loop_is_eagers():
    report = check(_reads_past_the_end, _past_the_end_args, calls=len(LENGTHS), grad=True)
    assert report.stats.captures == 1, report
    assert _rolled(report), report


class _Stepper(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x, start):
        h = torch.zeros(x.shape[1], 4)
        outs = []
        for t in range(start, x.shape[0]):
            h = self.cell(x[t], h)
            outs.append(self.out(h))
        return torch.stack(outs)


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y, start):
        opt.zero_grad()
        loss = ((model(x, start) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_through_a_range_from_a_to_b_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Stepper()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(4)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for i, n in enumerate(LENGTHS):
            start = i % 2
            x = torch.randn(n, 2, 3, generator=data)
            y = torch.randn(n - start, 2, 2, generator=data)
            assert_same(eager_step(x, y, start), opt_step(x, y, start), f"loss at {n}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after length {n}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after length {n}", **close)
    report = specularch.explain(opt_step)
    _assert_rolled_once(report, "range(a, b)")


# ---- nested rolled loops: an inner loop whose trip count varies, inside an outer one --------
def _grid(x, w, h):
    for t in range(x.shape[0]):
        g = h
        for j in range(x.shape[1]):
            g = torch.tanh(x[t, j] @ w + g)
        h = h + g * 0.5
    return h, t, j


def _grid_args(i):
    n, m = 3 + i % 7, 2 + (i * 3) % 11
    return A(T(n, m, 3, 5, requires_grad=True), T(5, 5, requires_grad=True), T(3, 5))


def _assert_nested(report):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    rolled = _rolled(report)
    assert len(rolled) == 3, report  # the outer loop, the inner one in its iteration 0 and body
    assert sum("in the body of the loop at" in loop.within for loop in rolled) == 1, report
    assert len({n for loop in rolled for n in loop.trips}) > 5, report


@pytest.mark.parametrize("templates, rtol", MODES)
def test_nested_loops_with_varying_trip_counts_are_captured_once(templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(_grid, _grid_args, calls=30, grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_nested(report)


def _grid_past_the_end(x, w, h, m):
    for t in range(x.shape[0]):
        for j in range(m):
            h = torch.tanh(x[t, j] @ w + h)
    return h


def _grid_past_the_end_args(i):
    (x, w, h), _ = _grid_args(i)
    return A(x, w, h, x.shape[1] + (i % 6 == 5))  # every 6th call: IndexError in the inner loop


def test_an_exception_inside_a_nested_rolled_loop_is_eagers():
    report = check(_grid_past_the_end, _grid_past_the_end_args, calls=30, grad=True)
    assert report.stats.captures == 1, report
    assert len(_rolled(report)) == 3, report


class _Grid(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(3, 4)
        self.row = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x, start):
        h = torch.zeros(x.shape[2], 4)
        outs = []
        for t in range(start, x.shape[0]):
            g = self.row(h)
            for j in range(x.shape[1]):
                g = self.cell(x[t, j], g)
            h = h + g
            outs.append(self.out(h))
        return torch.stack(outs)


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_through_nested_rolled_loops_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Grid()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(5)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for i in range(30):
            n, m, start = 3 + i % 7, 2 + (i * 3) % 11, i % 2
            x = torch.randn(n, m, 2, 3, generator=data)
            y = torch.randn(n - start, 2, 2, generator=data)
            assert_same(eager_step(x, y, start), opt_step(x, y, start), f"loss at {n, m}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after {n, m}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after {n, m}", **close)
    _assert_nested(specularch.explain(opt_step))


def _inner_count_varies(x, w, h):
    for t in range(x.shape[0]):
        for j in range(t):  # the inner trip count is the outer index: no one body
            h = torch.tanh(x[t, j] @ w + h)
    return h


def test_an_inner_loop_whose_trip_count_is_the_outer_index_is_unrolled_and_explained():
    def square(i):
        n = 3 + i
        return A(T(n, n, 3, 5, requires_grad=True), T(5, 5, requires_grad=True), T(3, 5))
    report = check(_inner_count_varies, square, calls=6, grad=True)
    loops = [loop for graph in report.graphs for loop in graph.loops]
    assert loops and not any(loop.rolled for loop in loops), report
    assert "loop index as a Python value" in str(report), report


# ---- forms that stay unrolled: equal to eager, and explain() says which loop and why -------
class _Node:
    def __init__(self, x, nxt):
        self.x, self.next, self.visits = x, nxt, 0


def _walk(node, w, h):
    while node is not None:  # the trip count is the list's length: Python structure
        h = torch.tanh(node.x @ w + h)
        node.visits += 1
        node = node.next
    return h


def _chain_args(i):
    node = None
    for _ in range(2 + i % 4):
        node = _Node(T(3, 5, requires_grad=True), node)
    return A(node, T(5, 5, requires_grad=True), T(3, 5))


def _count_up(x, w, h, n):
    i = 0
    while n > i:  # the bound first: not the `while i < n:` form rolled/while_loops.py rolls
        h = torch.tanh(x[i] @ w + h)
        i += 1
    return h, i


def _over_a_list(xs, w, h):
    outs = []
    for x in xs:
        h = torch.tanh(x @ w + h)
        outs.append(h)
    return torch.stack(outs), h


@pytest.mark.parametrize("fn, make_args, form, why", [
    (_walk, _chain_args, "while loop", "its condition is decided by Python values"),
    (_count_up, lambda i: A(*_args(i)[0], 2 + i % 4), "while loop",
     "its condition is decided by Python values"),
    # items that differ in shape: not passed whole (symbolic/rolled/lists.py), iterated item by item
    (_over_a_list, lambda i: A([T(1 + k % 2 * 2, 5, requires_grad=True) for k in range(2 + i % 4)],
                               T(5, 5, requires_grad=True), T(3, 5)),
     "for x in L['xs']", "its length and items are guarded"),
])
def test_a_loop_that_is_not_rolled_is_unrolled_equal_to_eager_and_explained(fn, make_args, form,
                                                                            why):
    report = check(fn, make_args, calls=8, grad=True)
    loops = [loop for graph in report.graphs for loop in graph.loops]
    assert loops and not any(loop.rolled for loop in loops), report
    assert all(loop.form == form and why in loop.why for loop in loops), report
    # one graph per trip count, each saying how many iterations it unrolled
    counts = [loop.iterations for loop in loops]
    assert len(counts) == len(set(counts)) == len(report.graphs) and 5 in counts, report
    assert set(counts) <= {2, 3, 4, 5}, report
    assert f"({form}, 5 iterations captured): " in str(report), report


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(3, 4)
        self.steps = 0

    def forward(self, x, start, log):
        h = torch.zeros(x.shape[1], 4)
        for t in range(start, x.shape[0]):
            h = self.cell(x[t], h)
            self.steps += 1  # heap writes in the body: the loop is unrolled, writes as eager's
            log.append(h.sum())
        return h


def test_heap_writes_in_a_range_loop_unroll_it_with_the_heap_equal_to_eagers():
    from differential import check_module
    report = check_module(_Counting, lambda i: A(T(3 + i % 4, 2, 3), i % 2, []), calls=8,
                          grad=True)
    loops = [loop for graph in report.graphs for loop in graph.loops]
    assert loops and not any(loop.rolled for loop in loops), report
    assert "(range(a, b)): its body leaves effects beyond the loop's variables" in str(report)
