"""Helpers shared by test_speculation.py and test_shadow_heap.py (on top of differential.py)."""
from __future__ import annotations

import copy
import sys

from differential import Pair


def carried_globals(module_name: str, **initial):
    """``state=`` for the harness where globals carry over between calls: before each side's
    call the globals are set to (copies of) what eager left after the previous call (``initial``
    for the first call); after each side's call they are read back and compared. The values
    are deep-copied, so they must not hold tensors that are part of an autograd graph."""
    module = sys.modules[module_name]
    carry = {"start": copy.deepcopy(initial), "eager_after": None, "reads": 0}

    def reset():
        for name, value in carry["start"].items():
            setattr(module, name, copy.deepcopy(value))

    def read():
        values = {name: getattr(module, name) for name in initial}
        carry["reads"] += 1
        if carry["reads"] % 2 == 1:  # the eager side runs first
            carry["eager_after"] = copy.deepcopy(values)
        else:  # both sides ran: the next call starts from what eager left
            carry["start"] = carry["eager_after"]
        return values

    return reset, read


def run_calls(pair: Pair, make_args, calls: int, between=None) -> list[str]:
    """Step ``pair`` ``calls`` times; return what specularch did on each call: ``"hit"`` (a cached
    graph ran), ``"fallback"``, ``"profiled"`` or ``"capture"`` (a new graph was captured and ran)."""
    what = []
    for i in range(calls):
        if between is not None:
            pair.apply(lambda m: between(m, i))
        before = pair.explain().stats
        pair.step(make_args)
        after = pair.explain().stats
        if after.fallback_calls > before.fallback_calls:
            what.append("fallback")
        elif after.profiled_calls > before.profiled_calls:
            what.append("profiled")
        elif after.graph_hits > before.graph_hits:
            what.append("hit")
        elif after.captures > before.captures:
            what.append("capture")
        else:
            what.append("?")
    return what
