"""Loop forms beyond ``for t in range(n)`` that rolled_loops.py captures once, whatever the
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
