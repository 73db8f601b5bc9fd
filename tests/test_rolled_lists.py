"""``for x in xs`` over a list of tensors from the call, rolled by symbolic/rolled/lists.py: the
list is one graph input (every item like item 0, the length unguarded), the body captured once,
whatever the length. Each case is compared with eager over 30 lengths (values, gradients,
the arguments after the call, exceptions): one capture, no ``cache_limit`` fallback; bit for
bit with ``templates="exact"``, within rounding by default. Lists that cannot be passed whole
are unrolled, still equal to eager, and ``explain()`` says why."""
import copy

import pytest
import torch
from torch import nn

import specularch

from differential import A, T, assert_same, check

LENGTHS = list(range(2, 32))  # 30 lengths
MODES = [("exact", 0.0), ("batched", 1e-5)]
FORM = "for x in L['xs']"


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _assert_rolled_once(report, form=FORM):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == form and len(loop.trips) == 16, report
    assert f"({form}): body" in str(report) and "trip counts of the last calls" in str(report)


def _rnn(xs, w, h):
    outs = []
    for x in xs:
        h = torch.tanh(x @ w + h)
        outs.append(h.sum(1))
    return torch.stack(outs), h, x


def _accumulate(xs, w, h):
    total = torch.zeros(())
    for x in xs:
        h = torch.sigmoid(x @ w) * h
        total = total + (h * x).sum()
    return total, h, len(xs)


def _args(i, requires_grad=False):
    n = LENGTHS[i % len(LENGTHS)]
    xs = [T(3, 5, requires_grad=requires_grad) for _ in range(n)]
    return A(xs, T(5, 5, requires_grad=True), T(3, 5))


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args", [
    (_rnn, _args),
    (_accumulate, lambda i: _args(i, requires_grad=True)),
])
def test_a_loop_over_a_list_of_tensors_is_rolled_once(fn, make_args, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, make_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report)


def _lengths_with_short_ones(i):
    (xs, w, h), _ = _args(i)
    return A(xs[:[0, 1, len(xs)][i % 3]], w, h)  # empty, one item, or the whole list


def test_an_empty_or_one_item_list_is_equal_to_eager():
    report = check(_rnn_or_none, _lengths_with_short_ones, calls=12, grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _rnn_or_none(xs, w, h):
    for x in xs:
        h = torch.tanh(x @ w + h)
    return h * w.sum()


def _mixed_args(i):
    (xs, w, h), _ = _args(i)
    if i % 4 == 3:  # one item differs in shape (broadcasts), another in requires_grad
        xs[1] = T(1, 5)
        xs[-1] = T(3, 5, requires_grad=True)
    return A(xs, w, h)


def test_a_list_whose_items_differ_is_never_wrong():
    report = check(_rnn, _mixed_args, calls=16, grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert "L['xs'] [1] .shape[0] expected 3, got 1" in str(report), report  # the list guard


def _appends_to_its_list(xs, w, h):
    for x in xs:
        h = torch.tanh(x @ w + h)
        if len(xs) < 40:
            xs.append(h.detach())  # noqa: B909 -- the list grows while iterated, as eager's
        if len(xs) > 6:
            break
    return h


def _writes_into_items(xs, w, h):
    for x in xs:
        x.mul_(2)  # a write into an input the rolled form could not commit
        h = torch.tanh(x @ w + h)
    return h


def _reads_an_item(xs, w, h):
    for x in xs:
        h = torch.tanh(x @ w + h)
    return h + xs[1]


@pytest.mark.parametrize("fn, why", [
    (_appends_to_its_list, "passed whole"),
    (_writes_into_items, "writes in place"),
    (_reads_an_item, "passed whole"),
])
def test_a_list_changed_or_read_item_by_item_unrolls_the_loop_and_says_why(fn, why):
    report = check(fn, _args, calls=6, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(loop.form == FORM and why in loop.why for loop in loops), report


def _past_the_end(xs, w, h, k):
    for x in xs:
        h = torch.tanh(x[:, :k] @ w + h)  # k == 4 on every 7th call: the shapes do not fit
    return h


def test_an_exception_inside_a_rolled_list_loop_is_eagers():
    def make_args(i):
        (xs, w, h), _ = _args(i)
        return A(xs, w, h, 4 if i % 7 == 6 else 5)
    report = check(_past_the_end, make_args, calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)
        self.last = torch.zeros(2, 4)

    def forward(self, xs):
        h = torch.zeros(2, 4)
        for x in xs:
            h = self.cell(x, h)
        self.last = h.detach()  # a heap write after the loop, committed as eager's
        return self.out(h)


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(xs, y):
        opt.zero_grad()
        loss = ((model(xs) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_over_a_list_of_tensors_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Classifier()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(4)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for n in LENGTHS:
            xs = [torch.randn(2, 3, generator=data) for _ in range(n)]
            y = torch.randn(2, 2, generator=data)
            assert_same(eager_step(xs, y), opt_step(xs, y), f"loss at {n}", **close)
            assert_same(eager_model.last, opt_model.last, f"last after length {n}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after length {n}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after length {n}", **close)
    report = specularch.explain(opt_step)
    _assert_rolled_once(report, "for x in L['xs']")


def _pairs_loss(pairs, w):
    loss = torch.zeros(())
    for x, y in pairs:
        loss = loss + ((x @ w - y) ** 2).mean()
    return loss, x, y


def _pairs_args(i):
    n = LENGTHS[i % len(LENGTHS)]
    pairs = [(T(3, 5), T(3, 2)) for _ in range(n)]
    if i % 9 == 8:  # one pair of another structure: the list guard fails, never a wrong result
        pairs[2] = (T(3, 5), T(3, 2), T(1))
    return A(pairs, T(5, 2, requires_grad=True))


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_loop_over_input_target_pairs_is_rolled_once(templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(_pairs_loss, _pairs_args, calls=len(LENGTHS), grad=True, rtol=rtol,
                       atol=rtol * 1e-2)
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == "for x in L['pairs']" and len(loop.trips) == 16, report
    guards = [g for graph in report.graphs if graph.loops and graph.loops[0].rolled
              for g in graph.guards]
    assert any("L['pairs']: a list of (Tensor(" in g for g in guards), report
    assert "L['pairs'] [2] expected a tuple of 2" in str(report), report  # the odd list


def _numbered(xs, w, h):
    outs = []
    for k, x in enumerate(xs):
        h = torch.tanh(x @ w + h) * (k + 1)
        outs.append(h.sum(0))
    return torch.stack(outs), h, k, x


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_loop_over_enumerate_of_a_list_is_rolled_once(templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(_numbered, _args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report, "for k, x in enumerate(L['xs'])")


def _numbered_branch(xs, w, h):
    for k, x in enumerate(xs):
        h = torch.tanh(x @ w + h) if k % 2 else h * 0.5  # the counter as a Python value
    return h


def test_enumerate_whose_counter_steers_python_unrolls_and_says_why():
    report = check(_numbered_branch, _args, calls=6, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(loop.form == "for k, x in enumerate(L['xs'])" and "the loop index as a Python value"
               in loop.why for loop in loops), report


def _writes_then_loops(xs, acc):
    acc.add_(1)  # eager's loop sees this write when acc is one of the items
    s = torch.zeros(3, 5)
    for x in xs:
        s = s + x * 2
    return s


def _aliased_args(i):
    xs = [T(3, 5) for _ in range(2 + i % 4)]
    return A(xs, xs[1] if i >= 6 and i % 2 else T(3, 5))  # from call 7 on: acc is xs[1]


def test_a_write_into_an_input_that_is_an_item_of_the_list_is_seen_as_eager_sees_it():
    report = check(_writes_then_loops, _aliased_args, calls=12)
    assert any(loop.rolled for loop in _loops(report)), report
    assert "share no memory with the items of L['xs']" in str(report), report


def _fixed_then_varying(i):
    (xs, w, h), _ = _args(i + 3)
    return A(xs[:3] if i < 6 else xs, w, h)  # three items for six calls, then other lengths


def test_a_list_of_one_length_stays_unrolled_until_its_length_changes():
    report = check(_rnn, _fixed_then_varying, calls=len(LENGTHS), grad=True)
    # the graph of the first six calls unrolled the loop (as before: no rolled-loop overhead
    # for a list whose length never changes); the change of length replaced it
    assert report.stats.captures == 2, report
    assert "L['xs'] expected length 3, got 11" in str(report), report
    assert "L['xs']: list length changed between calls (3, 11)" in str(report), report
    assert [loop.rolled for graph in report.graphs for loop in graph.loops] == [True], report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def test_a_list_whose_length_never_changes_is_unrolled_as_before():
    report = check(_rnn, lambda i: _fixed_then_varying(i % 6), calls=8, grad=True)
    loops = _loops(report)
    assert report.stats.captures == 1 and loops and not any(loop.rolled for loop in loops), report
    assert "(for x in L['xs'], 3 iterations captured)" in str(report), report


def _range_in_list(xs, w, h, n):
    for x in xs:
        for t in range(n):
            h = torch.tanh(x @ w + h + t)
    return h


def _list_in_while(xs, w, h, n):
    i = 0
    while i < n:
        for x in xs:
            h = torch.tanh(x @ w + h)
        i += 1
    return h, i


def _nested_args(i):
    (xs, w, h), _ = _args(i % 5)
    return A(xs, w, h, 2 + (i * 3) % 4)


@pytest.mark.parametrize("fn, outer, inner", [
    (_range_in_list, FORM, "range(n)"),
    (_list_in_while, "while i < L['n']", FORM),
])
def test_nested_loops_over_a_list_are_captured_once(fn, outer, inner):
    report = check(fn, _nested_args, calls=14, grad=True, expect="graph", rtol=1e-5, atol=1e-7)
    assert report.stats.captures == 1, report
    rolled = [(loop.form, bool(loop.within)) for loop in _loops(report) if loop.rolled]
    assert sorted(rolled) == sorted([(outer, False), (inner, True), (inner, True)]), report
