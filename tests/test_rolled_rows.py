"""``for row in x``, ``for x_t in x.unbind(d)`` and ``for x_t in x.split(1, d)`` over a dimension of a tensor that varies between
calls, rolled by symbolic/rolled/rows.py: the body captured once, whatever the size. Each case
is compared with eager over 30 sizes (values, gradients, the arguments after the call,
exceptions): one capture, no ``cache_limit`` fallback; bit for bit with ``templates="exact"``,
within rounding by default. A loop that cannot roll is unrolled, still equal to eager, and
``explain()`` says why."""
import copy
import dis

import pytest
import torch
from torch import nn

import specularch

from differential import A, T, assert_same, check, module_globals

LENGTHS = list(range(2, 32))  # 30 lengths
MODES = [("exact", 0.0), ("batched", 1e-5)]


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _assert_rolled_once(report, form):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == form and len(loop.trips) == 16, report


def _rnn(x, w, h):
    outs = []
    for row in x:
        h = torch.tanh(row @ w + h)
        outs.append(h.sum(1))
    return torch.stack(outs), h, row * 2  # `row` after the loop: the last row


def _batch_first(x, w):
    h = torch.zeros(x.size(0), 5)
    outs = []
    for x_t in x.unbind(1):
        h = torch.tanh(x_t @ w + h)
        outs.append(h)
    return torch.stack(outs, 1)


def _function_unbind(x, w):
    total = torch.zeros(())
    for x_t in torch.unbind(x, dim=-2):  # a negative dimension
        total = total + (x_t @ w).sum()
    return total


def _comprehension(x, w):
    return torch.stack([torch.sigmoid(row @ w) for row in x]).sum(0)


def _made_in_the_call(x, w):
    acc = torch.zeros(3, 5)
    for r in x @ w:  # a tensor the call made: its first size is symbolic too
        acc = acc * 0.5 + r
    return acc


def _enumerated(x, w):
    h = torch.zeros(3, 5)
    for k, row in enumerate(x):
        h = torch.tanh(row @ w + h * k)
    return h, k, row  # the counter and the row after the loop: the last ones


def _enumerated_from(x, w):
    total = torch.zeros(())
    for k, x_t in enumerate(x.unbind(1), 3):
        total = total + (x_t @ w).sum() * k
    return total, k


def _split_steps(x, w):
    """The time-sequence example's form: slices of one step, outputs grown with `+=`."""
    h = torch.zeros(x.size(0), 5)
    outputs = []
    for x_t in x.split(1, dim=1):
        h = torch.tanh(x_t.squeeze(1) @ w + h)
        outputs += [h]
    return torch.stack(outputs, 1)


def _args(i):
    n = LENGTHS[i % len(LENGTHS)]
    return A(T(n, 3, 5, requires_grad=True), T(5, 5, requires_grad=True), T(3, 5))


def _two(i):
    (x, w, _), _ = _args(i)
    return A(x, w)


def _batch_first_args(i):
    n = LENGTHS[i % len(LENGTHS)]
    return A(T(3, n, 5, requires_grad=True), T(5, 5, requires_grad=True))


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args, form", [
    (_rnn, _args, "for row in L['x']"),
    (_batch_first, _batch_first_args, "for row in L['x'].unbind(1)"),
    (_function_unbind, _batch_first_args, "for row in L['x'].unbind(1)"),
    (_comprehension, _two, "for row in L['x']"),
    (_made_in_the_call, _two, "for row in <a tensor>"),
    (_enumerated, _two, "for k, row in enumerate(L['x'])"),
    (_enumerated_from, _batch_first_args, "for k, row in enumerate(L['x'].unbind(1), 3)"),
    (_split_steps, _batch_first_args, "for row in L['x'].split(1, 1)"),
])
def test_a_loop_over_a_tensors_rows_is_rolled_once(fn, make_args, form, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, make_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 0.1)
    _assert_rolled_once(report, form)


def _stops(x, w, h):
    for row in x:
        h = torch.tanh(row @ w + h)
        if h.sum() > 2.0:
            break
    return h, row


def test_a_loop_over_rows_that_stops_early_is_rolled_and_hands_out_the_row_it_stopped_at():
    report = check(_stops, _args, calls=len(LENGTHS), grad=True, expect="graph", rtol=1e-5,
                   atol=1e-7)
    _assert_rolled_once(report, "for row in L['x']")
    (loop,) = _loops(report)
    assert len(set(loop.trips)) > 3, loop  # it stopped at different rows


def _long_body(head: str):
    """A loop whose body is longer than 255 code units: its ``FOR_ITER`` and its jump back
    carry an ``EXTENDED_ARG`` prefix (before, such loops never rolled)."""
    lines = "\n".join("        h = torch.tanh(h * 0.5 + row)" for _ in range(40))
    source = f"def long_body(x, h):\n    {head}\n        row = x[t]\n{lines}\n    return h\n"
    namespace = {"torch": torch}
    exec(compile(source, "<long body>", "exec"), namespace)
    fn = namespace["long_body"]
    assert any(i.opname == "EXTENDED_ARG" for i in dis.get_instructions(fn)), "body too short"
    return fn


@pytest.mark.parametrize("head", ["for t in range(x.size(0)):", "for t, _ in enumerate(x):"])
def test_a_loop_with_a_long_body_rolls(head):
    report = check(_long_body(head), lambda i: A(T(LENGTHS[i], 3), T(3)), calls=12, grad=False,
                   rtol=1e-6, atol=1e-7)
    assert report.stats.captures == 1 and any(loop.rolled for loop in _loops(report)), report


def test_the_row_after_the_loop_is_a_view_of_the_tensor_as_in_eager():
    def last(x):
        for row in x:
            pass
        return row

    def stopped(x):
        for row in x:
            if row.sum() > 0:
                break
        return row

    for fn in (last, stopped):
        opt = specularch.optimize(fn)
        for n in [3, 4, 5, 6, 7, 8, 9]:
            x = torch.arange(n * 2.0).reshape(n, 2) - n
            y = x.clone()
            out, want = opt(x), fn(y)
            assert torch.equal(out, want) and out._base is x, (fn.__name__, n)
            out.add_(100)  # writes the argument's row, as eager's view does
            want.add_(100)
            assert torch.equal(x, y), (fn.__name__, n)
        assert any(loop.rolled for loop in _loops(specularch.explain(opt))), fn.__name__


def _zero_or_one(i):
    (x, w, h), _ = _args(i)
    return A(x[:[0, 1, 4, 2][i % 4]], w, h)


def test_zero_and_one_rows_are_eagers():
    def plain(x, w, h):
        for row in x:
            h = torch.tanh(row @ w + h)
        return h * w.sum()

    report = check(plain, _zero_or_one, calls=16, grad=True)
    assert not report.fallbacks, report
    assert any(loop.rolled for loop in _loops(report)), report


def test_a_static_size_is_one_graph_unrolled():
    def plain(x, w, h):
        for row in x:
            h = torch.tanh(row @ w + h)
        return h

    report = check(plain, lambda i: A(T(4, 3, 5), T(5, 5), T(3, 5)), calls=6, expect="graph")
    assert report.stats.captures == 1 and not any(loop.rolled for loop in _loops(report)), report


COUNT = 0


def test_a_body_that_cannot_roll_is_unrolled_and_says_why():
    def counts(x):
        global COUNT
        total = torch.zeros(3)
        for row in x:
            total = total + row
            COUNT += 1
        return total

    report = check(counts, lambda i: A(T(LENGTHS[i], 3)), calls=8,
                   state=module_globals(__name__, COUNT=0))
    assert not any(loop.rolled for loop in _loops(report)), report
    assert "(for row in L['x']): its body has STORE_GLOBAL" in str(report), report


class _Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 4)
        for x_t in x:
            h = self.cell(x_t, h)
        return self.out(h)


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_over_the_rows_of_a_sequence_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Reader()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(4)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for n in LENGTHS:
            x = torch.randn(n, 2, 3, generator=data)
            y = torch.randn(2, 2, generator=data)
            assert_same(eager_step(x, y), opt_step(x, y), f"loss at {n}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after {n}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after {n}", **close)
    _assert_rolled_once(specularch.explain(opt_step), "for row in L['x']")
