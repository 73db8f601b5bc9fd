"""Recursion that reaches an optimized target through the frame hook (a function calling
itself by its raw name, a module forward calling a child of its own class) and runs eagerly
keeps eager's depth: the trampoline runs the original in its own frame and pays for it.
Each test compares eager with ``specularch.optimize`` on the same program."""
import os
import sys

import pytest
import torch
import torch.nn as nn

import specularch
from specularch import frames

pytestmark = pytest.mark.skipif(not frames.HOOK_AVAILABLE, reason="needs the frame hook")


def _by_name(n):
    os.getpid()  # unsupported: every level runs eagerly
    return 0 if n == 0 else 1 + _by_name(n - 1)


def _with_layout(n, *rest, step=1, type=None, **kw):
    os.getpid()  # every argument kind goes through the trampoline's call of the original
    if n <= 0:  # (a parameter named ``type`` shadows the builtin in the trampoline too)
        return (len(rest), step, type, sorted(kw))
    return _with_layout(n - step, *rest, step=step, type=type, **kw)


class Chain(nn.Module):
    """A forward recursing on a child of its own class; built iteratively (no recursion)."""

    def __init__(self, child=None):
        super().__init__()
        self.child = child
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x, n):
        os.getpid()
        return x if n == 0 else self.child(x, n - 1) * self.scale + 1


def _chain(length):
    m = None
    for _ in range(length):
        m = Chain(m)
    return m


def _reaches(f, n, expected) -> bool:
    """Whether ``f(n)`` returns ``expected(n)`` (False: it raised RecursionError)."""
    try:
        assert f(n) == expected(n)
        return True
    except RecursionError:
        return False


def _max_depth(f, expected, hi) -> int:
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _reaches(f, mid, expected) else (lo, mid - 1)
    return lo


def _compare_depths(eager, fast, expected, hi, limit):
    eager_max = _max_depth(eager, expected, hi)
    fast_max = _max_depth(fast, expected, hi)
    assert fast_max >= 0.9 * eager_max, (fast_max, eager_max)
    assert _reaches(fast, fast_max, expected)
    # Beyond eager's depth both raise RecursionError (a margin of two frames: the depth at
    # which CPython raises moves by a frame as it specialises bytecode).
    assert not _reaches(fast, eager_max + 3, expected)
    assert not _reaches(eager, eager_max + 3, expected)
    assert sys.getrecursionlimit() == limit  # the frames paid for are given back
    return fast_max


def test_function_recursing_by_its_raw_name_reaches_eager_depth(recursion_limit):
    fast = specularch.optimize(_by_name)
    _compare_depths(_by_name, fast, lambda n: n, 4000, recursion_limit)
    e = specularch.explain(fast)
    assert e.fallbacks[0].kind == "unsupported_call" and e.stats.graph_hits == 0


def test_every_argument_kind_survives_the_trampoline_run(recursion_limit):
    fast = specularch.optimize(_with_layout)
    for args, kwargs in [((5,), {}), ((6, "a", "b"), {"step": 2, "type": int}),
                         ((3,), {"z": 1, "y": 2})]:
        assert fast(*args, **kwargs) == _with_layout(*args, **kwargs)
    expected = lambda n: (2, 1, None, ["k"])  # noqa: E731
    depth = _compare_depths(lambda n: _with_layout(n, 1, 2, k=0),
                            lambda n: fast(n, 1, 2, k=0), expected, 4000, recursion_limit)
    assert depth > 400


def test_closure_recursing_by_name_writes_its_cells(recursion_limit):
    def make():
        calls = 0

        def walk(n):
            nonlocal calls
            os.getpid()
            calls += 1
            if n == 0:
                raise ValueError("bottom")
            return walk(n - 1)
        return walk, lambda: calls

    eager, eager_calls = make()
    walk, fast_calls = make()
    fast = specularch.optimize(walk)
    for f in (eager, fast):
        with pytest.raises(ValueError, match="bottom"):
            f(300)
    assert eager_calls() == fast_calls() == 301  # nonlocal writes reach the user's cell
    assert sys.getrecursionlimit() == recursion_limit


def test_module_recursing_on_a_child_of_its_class_reaches_eager_depth(recursion_limit):
    torch.manual_seed(0)
    eager, fast = _chain(600), specularch.optimize(_chain(600))
    x = torch.zeros(())

    def expected(n):
        return torch.full((), float(n))
    with torch.no_grad():
        _compare_depths(lambda n: eager(x, n), lambda n: fast(x, n), expected, 599,
                        recursion_limit)
    # Gradients through the eager run match eager's.
    for m in (eager, fast):
        m(x, 50).backward()
    grads = [m.scale.grad for m in (eager, fast)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert specularch.explain(fast).fallbacks[0].kind == "unsupported_call"
