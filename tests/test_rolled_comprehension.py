"""List comprehensions over the lists a rolled ``for`` loop takes whole (tensors, tuples,
user objects, ``zip``/``enumerate`` of them), rolled by symbolic/rolled/lists.py as ``for`` loops
are: ``torch.stack([f(x) for x in xs])`` captured once, whatever the length. Each case is
compared with eager over 30 lengths (values, gradients, the arguments after the call): one
capture, no ``cache_limit`` fallback; bit for bit with ``templates="exact"``, within
rounding by default. What the rolled form cannot give (the list itself returned) is
unrolled, still equal to eager, and ``explain()`` says why."""
import pytest
import torch

import specularch

from differential import A, T, check

LENGTHS = list(range(2, 32))  # 30 lengths
MODES = [("exact", 0.0), ("batched", 1e-5)]


class Token:
    def __init__(self, x, scale):
        self.x, self.scale = x, scale


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _assert_rolled_once(report, form):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == form and len(loop.trips) == 16, report
    assert f"({form}): body" in str(report) and "trip counts of the last calls" in str(report)


def _stacked(xs, w):
    return torch.stack([torch.tanh(x @ w) for x in xs]).sum(0)


def _zipped(xs, ys, w):
    return torch.stack([torch.tanh(x @ w) * y for x, y in zip(xs, ys)]).mean()


def _numbered(xs, w):
    return torch.cat([x @ w * k for k, x in enumerate(xs, 1)])


def _args(i):
    n = LENGTHS[i % len(LENGTHS)]
    return A([T(3, 5, requires_grad=True) for _ in range(n)], [T(3, 5) for _ in range(n)],
             T(5, 5, requires_grad=True))


def _one_list(i):
    (xs, _, w), _ = _args(i)
    return A(xs, w)


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args, form", [
    (_stacked, _one_list, "for x in L['xs']"),
    (_zipped, _args, "for x, y in zip(L['xs'], L['ys'])"),
    (_numbered, _one_list, "for k, x in enumerate(L['xs'], 1)"),
])
def test_a_comprehension_over_a_list_passed_whole_is_rolled_once(fn, make_args, form, templates,
                                                                   rtol):
    with specularch.config.patch(templates=templates):
        # (by default the body's x @ w runs once for all items after the loop: one matmul
        # over the stacked items, whose sums of 30 products round differently)
        report = check(fn, make_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol)
    _assert_rolled_once(report, form)


def _over_objects(tokens, w):
    return torch.stack([torch.sigmoid(t.x @ w) * t.scale for t in tokens]).sum()


def test_a_comprehension_over_objects_is_rolled_once():
    def make_args(i):
        n = LENGTHS[i % len(LENGTHS)]
        return A([Token(T(3, 5), k % 4) for k in range(n)], T(5, 5, requires_grad=True))
    report = check(_over_objects, make_args, calls=len(LENGTHS), grad=True, expect="graph",
                   rtol=1e-5, atol=1e-5)
    _assert_rolled_once(report, "for x in L['tokens']")


def _returns_the_list(xs, w):
    return [x @ w for x in xs]


def _short(i):
    (xs, w), _ = _one_list(i)
    return A(xs[:[0, 1, len(xs)][i % 3]], w)


def test_an_empty_or_one_item_comprehension_is_equal_to_eager():
    report = check(_stacked, _short, calls=12, grad=True, rtol=1e-5, atol=1e-5)
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def test_a_comprehension_whose_list_is_returned_is_unrolled_and_says_why():
    report = check(_returns_the_list, _one_list, calls=8, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any("capture failed with" in loop.why for loop in loops), report
