"""``for obj in objs`` over a list of user objects from the call whose attributes the body
reads (tensors, per-item numbers, constants), rolled by symbolic/rolled/objects.py: the list is one
graph input, each attribute read guarded over every item, the body captured once, whatever
the length. Each case is compared with eager over 30 lengths (values, gradients, the objects
after the call, exceptions): one capture, no ``cache_limit`` fallback; bit for bit with
``templates="exact"``, within rounding by default. Items that differ are never wrong, and
``explain()`` says why."""
import copy

import pytest
import torch
from torch import nn

import specularch

from differential import A, T, assert_same, check

LENGTHS = list(range(2, 32))  # 30 lengths
MODES = [("exact", 0.0), ("batched", 1e-5)]
FORM = "for x in L['objs']"


class Token:
    def __init__(self, x, scale, tag="word"):
        self.x, self.scale, self.tag = x, scale, tag

    def twice(self):
        return self.x * 2


class Other(Token):
    pass


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _assert_rolled_once(report, form=FORM):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == form and len(loop.trips) == 16, report
    assert f"({form}): body" in str(report) and "trip counts of the last calls" in str(report)


def _rnn(objs, w, h):
    outs = []
    for obj in objs:
        h = torch.tanh(obj.x @ w + h) * obj.scale
        if obj.tag == "word":  # the same in every item: a constant, guarded over the list
            h = h + 1
        outs.append(h.sum(1))
    return torch.stack(outs), h, obj.x, obj.scale


def _args(i, requires_grad=False):
    n = LENGTHS[i % len(LENGTHS)]
    objs = [Token(T(3, 5, requires_grad=requires_grad), 0.5 + k / n) for k in range(n)]
    return A(objs, T(5, 5, requires_grad=True), T(3, 5))


def _int_scaled(objs, w, h):
    total = torch.zeros(())
    for obj in objs:
        h = torch.sigmoid(obj.x @ w) * h
        total = total + (h * obj.x).sum() * obj.scale
    return total, h


def _int_args(i):
    (objs, w, h), _ = _args(i, requires_grad=True)
    for k, obj in enumerate(objs):
        obj.scale = k % 3 - 1  # an int per item, used in tensor math
    return A(objs, w, h)


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args", [(_rnn, _args), (_int_scaled, _int_args)])
def test_a_loop_over_a_list_of_objects_is_rolled_once(fn, make_args, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, make_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report)


def _short_args(i):
    (objs, w, h), _ = _args(i)
    return A(objs[:[0, 1, len(objs)][i % 3]], w, h)


def _rnn_or_start(objs, w, h):
    for obj in objs:
        h = torch.tanh(obj.x @ w + h) * obj.scale
    return h * w.sum()


def test_an_empty_or_one_item_list_of_objects_is_equal_to_eager():
    report = check(_rnn_or_start, _short_args, calls=12, grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _one_item_differs(how):
    def make_args(i):
        (objs, w, h), _ = _args(i)
        if i % 6 == 5 and how == "shape":  # the attribute's guard over the list fails
            objs[3].x = T(1, 5)
        if i % 6 == 5 and how == "class":
            objs[1] = Other(objs[1].x, objs[1].scale)
        if i % 6 == 5 and how == "constant":
            objs[2].tag = "punct"
        return A(objs, w, h)
    return make_args


@pytest.mark.parametrize("how, why", [
    ("shape", "L['objs'] [3].x expected Tensor(dtype=torch.float32, shape=(3, 5)"),
    ("class", "L['objs'] [1] expected a Token, got"),
    ("constant", "L['objs'] [2].tag expected == 'word', got 'punct'"),
])
def test_a_list_whose_objects_differ_is_never_wrong_and_says_why(how, why):
    report = check(_rnn, _one_item_differs(how), calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert why in str(report), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _branches_on_a_number(objs, w, h):
    for obj in objs:
        h = torch.tanh(obj.x @ w + h) if obj.scale > 1 else h  # a per-item number steers Python
    return h * w.sum()


def _calls_a_method(objs, w, h):
    for obj in objs:
        h = torch.tanh(obj.x @ w + h) * obj.twice()
    return h


@pytest.mark.parametrize("fn, why", [
    (_branches_on_a_number, "as a Python value"),
    (_calls_a_method, "only instance attributes are read per item"),
])
def test_a_body_that_needs_an_items_python_value_unrolls_and_says_why(fn, why):
    report = check(fn, _args, calls=6, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(loop.form == FORM and why in loop.why for loop in loops), report


def _raises_at(objs, w, h, k):
    for obj in objs:
        h = torch.tanh(obj.x[:, :k] @ w + h)  # k == 4 on every 7th call: the shapes do not fit
    return h


def test_an_exception_inside_a_rolled_loop_over_objects_is_eagers():
    def make_args(i):
        (objs, w, h), _ = _args(i)
        return A(objs, w, h, 4 if i % 7 == 6 else 5)
    report = check(_raises_at, make_args, calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report


def _writes_then_loops(objs, first, h):
    first.x = first.x * 2  # eager's loop sees this write when first is one of the items
    for obj in objs:
        h = h + obj.x
    return h


def test_an_attribute_write_before_the_loop_is_seen_as_eager_sees_it():
    def make_args(i):
        (objs, w, h), _ = _args(i)
        return A(objs, objs[0] if i % 2 else Token(T(3, 5), 1.0), h)
    report = check(_writes_then_loops, make_args, calls=12)
    assert any(loop.form == FORM and "writes an attribute of a Token before the loop" in loop.why
               for loop in _loops(report)), report


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, tokens):
        h = torch.zeros(2, 4)
        for tok in tokens:
            h = self.cell(tok.x, h) * tok.scale
        return self.out(h)


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_over_a_list_of_objects_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Tagger()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(4)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for n in LENGTHS:
            tokens = [Token(torch.randn(2, 3, generator=data), 1.0 - k / 64) for k in range(n)]
            y = torch.randn(2, 2, generator=data)
            assert_same(eager_step(tokens, y), opt_step(tokens, y), f"loss at {n}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after length {n}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after length {n}", **close)
    _assert_rolled_once(specularch.explain(opt_step), "for x in L['tokens']")


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(tokens, y):
        opt.zero_grad()
        loss = ((model(tokens) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    return step


def _zipped_objects(objs, ys, w, h):
    for obj, y in zip(objs, ys):
        h = torch.tanh(obj.x @ w + h) * obj.scale + y
    return h, obj.scale


def _with_targets(i):
    (objs, w, h), _ = _args(i)
    return A(objs, [T(3, 5) for _ in objs], w, h)


def test_zip_of_objects_and_tensors_is_rolled_once():
    report = check(_zipped_objects, _with_targets, calls=len(LENGTHS), grad=True, expect="graph")
    _assert_rolled_once(report, "for x, y in zip(L['objs'], L['ys'])")


def _enumerated(objs, w, h):
    for k, obj in enumerate(objs, 1):
        h = torch.tanh(obj.x @ w + h) * obj.scale + k
    return h, obj.x, k


def test_enumerate_of_objects_is_rolled_once():
    report = check(_enumerated, _args, calls=len(LENGTHS), grad=True, expect="graph")
    _assert_rolled_once(report, "for k, x in enumerate(L['objs'], 1)")


def _weighted(pairs, w, h):
    outs = []
    for x, c in pairs:
        h = torch.tanh(x @ w + h) * c  # c: a Python number per item, used in tensor math
        outs.append(h.sum(0) + c)
    return torch.stack(outs), h, c


def _pairs_args(i):
    n = LENGTHS[i % len(LENGTHS)]
    pairs = [(T(3, 5), k % 4 - 1) for k in range(n)]
    if i % 8 == 7:  # one item's number of another type: the list guard fails
        pairs[2] = (pairs[2][0], 2.5)
    return A(pairs, T(5, 5, requires_grad=True), T(3, 5))


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_list_of_tuples_with_a_number_per_item_is_rolled_once(templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(_weighted, _pairs_args, calls=len(LENGTHS), grad=True, rtol=rtol,
                       atol=rtol * 1e-2)
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == "for x in L['pairs']" and len(loop.trips) == 16, report
    assert "L['pairs'] [2][1] expected an int, got 2.5" in str(report), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _branches_on_the_number(pairs, w, h):
    for x, c in pairs:
        h = torch.tanh(x @ w + h) if c > 0 else h  # the number steers Python
    return h * w.sum()


def test_a_body_that_branches_on_an_items_number_unrolls_and_says_why():
    report = check(_branches_on_the_number, _pairs_args, calls=6, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(loop.form == "for x in L['pairs']" and "as a Python value" in loop.why
               for loop in loops), report
