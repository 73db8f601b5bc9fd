"""``for x, y in zip(xs, ys)`` over lists of tensors from the call and ``for k, x in
enumerate(xs, start)``, rolled by symbolic/rolled/lists.py: every list one graph input, the body
captured once, whatever the length. Each case is compared with eager over 30 lengths
(values, gradients, the arguments after the call, exceptions): one capture, no
``cache_limit`` fallback; bit for bit with ``templates="exact"``, within rounding by default.
Lists whose lengths or items differ are never wrong, and ``explain()`` says why."""
import copy

import pytest
import torch
from torch import nn

import specularch

from differential import A, T, assert_same, check

LENGTHS = list(range(2, 32))  # 30 lengths
MODES = [("exact", 0.0), ("batched", 1e-5)]
ZIP = "for x, y in zip(L['xs'], L['ys'])"


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _assert_rolled_once(report, form):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == form and len(loop.trips) == 16, report
    assert f"({form}): body" in str(report) and "trip counts of the last calls" in str(report)


def _zipped_rnn(xs, ys, w, h):
    outs = []
    for x, y in zip(xs, ys):
        h = torch.tanh(x @ w + h) * y
        outs.append(h.sum(1))
    return torch.stack(outs), h, x, y


def _zipped_loss(xs, ys, w):
    loss = torch.zeros(())
    for x, y in zip(xs, ys):
        loss = loss + ((x @ w - y) ** 2).mean()
    return loss


def _args(i, requires_grad=False):
    n = LENGTHS[i % len(LENGTHS)]
    xs = [T(3, 5, requires_grad=requires_grad) for _ in range(n)]
    ys = [T(3, 5) for _ in range(n)]
    return A(xs, ys, T(5, 5, requires_grad=True), T(3, 5))


def _loss_args(i):
    (xs, ys, w, _), _ = _args(i, requires_grad=True)
    return A(xs, ys, w)


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args", [(_zipped_rnn, _args), (_zipped_loss, _loss_args)])
def test_a_loop_over_zip_of_two_lists_is_rolled_once(fn, make_args, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, make_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report, ZIP)


def _three(xs, ys, zs, h):
    for x, y, z in zip(xs, ys, zs):
        h = torch.tanh(x * h + y) - z
    return h


def test_zip_of_three_lists_is_rolled_once():
    def make_args(i):
        (xs, ys, w, h), _ = _args(i, requires_grad=True)
        return A(xs, ys, [T(3, 5) for _ in xs], h)
    report = check(_three, make_args, calls=len(LENGTHS), grad=True, expect="graph")
    _assert_rolled_once(report, "for x, y, z in zip(L['xs'], L['ys'], L['zs'])")


def _uneven_args(i):
    (xs, ys, w, h), _ = _args(i)
    if i % 5 == 4:  # zip stops at the shorter list, as eager's
        ys = ys[:max(1, len(ys) // 2)]
    return A(xs, ys, w, h)


def test_lists_of_other_lengths_are_zipped_as_eager_zips_them():
    report = check(_zipped_rnn, _uneven_args, calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _mixed_args(i):
    (xs, ys, w, h), _ = _args(i)
    if i % 6 == 5:  # one item of ys differs in shape: its list guard fails
        ys[1] = T(1, 5)
    return A(xs, ys, w, h)


def test_zip_over_a_list_whose_items_differ_is_never_wrong_and_says_why():
    report = check(_zipped_rnn, _mixed_args, calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert "L['ys'] [1] .shape[0] expected 3, got 1" in str(report), report


def _raises_at(xs, ys, w, h, k):
    for x, y in zip(xs, ys):
        h = torch.tanh(x[:, :k] @ w + h) * y  # k == 4 on every 7th call: the shapes do not fit
    return h


def test_an_exception_inside_a_rolled_zip_loop_is_eagers():
    def make_args(i):
        (xs, ys, w, h), _ = _args(i)
        return A(xs, ys, w, h, 4 if i % 7 == 6 else 5)
    report = check(_raises_at, make_args, calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report


def _empty_or_short(i):
    (xs, ys, w, h), _ = _args(i)
    n = [0, 1, len(xs)][i % 3]
    return A(xs[:n], ys[:n], w, h)


def _zipped_or_start(xs, ys, w, h):
    for x, y in zip(xs, ys):
        h = torch.tanh(x @ w + h) + y
    return h * w.sum()


def test_empty_and_one_item_lists_are_zipped_as_eager_zips_them():
    report = check(_zipped_or_start, _empty_or_short, calls=12, grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _numbered_from(xs, w, h):
    outs = []
    for k, x in enumerate(xs, 1):
        h = torch.tanh(x @ w + h) * k
        outs.append(h.sum(0))
    return torch.stack(outs), h, k, x


def _numbered_from_keyword(xs, w, h):
    for k, x in enumerate(xs, start=-3):
        h = torch.tanh(x @ w + h) + k
    return h, k


def _list_args(i):
    (xs, _, w, h), _ = _args(i)
    return A(xs, w, h)


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, form", [
    (_numbered_from, "for k, x in enumerate(L['xs'], 1)"),
    (_numbered_from_keyword, "for k, x in enumerate(L['xs'], -3)"),
])
def test_a_loop_over_enumerate_from_a_start_is_rolled_once(fn, form, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, _list_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report, form)


def _numbered_branch(xs, w, h):
    for k, x in enumerate(xs, 1):
        h = torch.tanh(x @ w + h) if k % 2 else h * 0.5  # the counter as a Python value
    return h


def test_enumerate_from_a_start_whose_counter_steers_python_unrolls_and_says_why():
    report = check(_numbered_branch, _list_args, calls=6, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(loop.form == "for k, x in enumerate(L['xs'], 1)" and "as a Python value"
               in loop.why for loop in loops), report


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, xs, masks):
        h = torch.zeros(2, 4)
        for x, m in zip(xs, masks):
            h = self.cell(x, h) * m
        return self.out(h)


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_over_zipped_lists_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Tagger()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(4)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for n in LENGTHS:
            xs = [torch.randn(2, 3, generator=data) for _ in range(n)]
            masks = [torch.rand(2, 1, generator=data) for _ in range(n)]
            y = torch.randn(2, 2, generator=data)
            assert_same(eager_step(xs, masks, y), opt_step(xs, masks, y), f"loss at {n}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after length {n}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after length {n}", **close)
    _assert_rolled_once(specularch.explain(opt_step), "for x, y in zip(L['xs'], L['masks'])")


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(xs, masks, y):
        opt.zero_grad()
        loss = ((model(xs, masks) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    return step
