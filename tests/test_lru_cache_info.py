"""An lru_cache helper inlined in a graph: the result is baked in, and each commit makes the
lookup eager makes, so ``cache_info()``, the LRU order and evictions follow the calls.
Differential on ``cache_info()`` and on which keys the cache holds afterwards."""
import functools

import torch

import specularch


def _make(maxsize):
    @functools.lru_cache(maxsize=maxsize)
    def width(n):
        return n * 3 + 1

    def step(x, n):
        a = width(n)
        return x * a + width(2)
    return width, step


def _hits(opt) -> int:
    return specularch.explain(opt).stats.graph_hits


def _drive(step, width, calls):
    """Run ``calls`` ((n, clear?) pairs); the cache statistics after each call."""
    infos, outs = [], []
    x = torch.arange(4.0)
    for n, clear in calls:
        if clear:
            width.cache_clear()
        outs.append(step(x, n))
        infos.append(width.cache_info())
    return outs, infos


def test_cache_info_counts_graph_calls_as_eager():
    calls = [(1, False)] * 9 + [(1, True)] + [(1, False)] * 3
    ref_width, ref_step = _make(None)
    fast_width, fast_step = _make(None)
    fast = specularch.optimize(fast_step)
    expected, eager_infos = _drive(ref_step, ref_width, calls)
    got, fast_infos = _drive(fast, fast_width, calls)
    assert fast_infos == eager_infos
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert _hits(fast) >= 6, specularch.explain(fast)


def test_lru_order_and_evictions_follow_graph_calls():
    """maxsize=2 with a third key used elsewhere: which key is evicted depends on the
    lookups the graph calls made (width(2) stays the most recent one in every step)."""
    calls = [(1, False)] * 6
    ref_width, ref_step = _make(2)
    fast_width, fast_step = _make(2)
    fast = specularch.optimize(fast_step)
    for step, width in ((ref_step, ref_width), (fast, fast_width)):
        _drive(step, width, calls)
        width(1)  # 1 is the most recent now ...
        step(torch.ones(2), 1)  # ... until the step looks up width(2) after width(1)
        width(7)  # evicts the least recently used of 1 and 2: 1
        width(2)  # a hit only if the graph call's lookups moved 2 to the front
    assert fast_width.cache_info() == ref_width.cache_info()
    assert _hits(fast) >= 2
