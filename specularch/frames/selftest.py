"""A toy run through torch's frame hook, to decide at first use whether to rely on it.

The hook is private torch API whose failure modes are crashes or silent non-interception;
this checks the behaviours specularch depends on before any user frame is intercepted.
It uses its own glue name, so it never calls the user's dispatcher.
"""
from __future__ import annotations

import builtins
from typing import Any, Optional

from . import _torch_hook as _th
from . import interceptor as _ic

_SOURCE = """
def toy(a, b=2, *, c=3):
    return a + b + c
def plain(x):
    return x + 1
def outer(a):
    return toy(a, c=10)
"""
_GLUE = "__specularch_selftest__"


def run() -> tuple[bool, str]:
    """Return ``(ok, reason)``; raises only a KeyboardInterrupt (or another BaseException).

    Checks that a target is dispatched (also from inside a non-target), that a non-target
    code reaches the callback once only, that the target's trampoline is cached in our
    region and not in torch.compile's, and that callback and region are restored on exit.
    """
    if not _th.HOOK_AVAILABLE:
        return False, str(_th.HOOK_UNAVAILABLE_REASON)
    try:
        return _run()
    except Exception as exc:  # (Ctrl-C during the test propagates: it says nothing of the hook)
        return False, f"self-test raised {type(exc).__name__}: {exc}"


def _run() -> tuple[bool, str]:
    seen: list = []

    def record(key: int, slots: tuple, cells: Optional[tuple]) -> Any:
        seen.append(slots)
        return _ic._by_key[key].call_original(slots, cells) * 100

    ns: dict[str, Any] = {}
    exec(compile(_SOURCE, "<specularch self-test>", "exec"), ns)  # fresh, never-seen codes
    saved_counts = dict(_ic._counts)  # keep stats() about the user's frames only
    setattr(builtins, _GLUE, record)
    target = _ic._register(ns["toy"], _GLUE)
    callback_before, region_before = _th.get_callback(), _th.get_region()
    try:
        token = _ic._enter()
        try:
            got = ns["outer"](1)
            ns["plain"](1)
            calls = _ic._counts["callback_calls"]
            ns["plain"](2)
            ns["toy"](1)
            calls_again = _ic._counts["callback_calls"] - calls
            region = _ic._region
        finally:
            _ic._exit(token)
        callback_after, region_after = _th.get_callback(), _th.get_region()
        entries = (_th.cache_entry_count(target.code, region),
                   _th.cache_entry_count(target.code, -1))
    finally:
        _ic._unregister(target)
        delattr(builtins, _GLUE)
        _ic._counts.update(saved_counts)
    if got != 1300 or seen != [(1, 2, 10), (1, 2, 3)]:
        return False, f"target not dispatched as expected: result {got!r}, slots {seen!r}"
    if calls_again:
        return False, f"cached codes still reached the callback {calls_again} time(s)"
    if entries != (1, 0):
        return False, f"trampoline cache entries (our region, region -1): {entries}, not (1, 0)"
    if callback_after is not callback_before:
        return False, f"callback not restored: {callback_after!r} instead of {callback_before!r}"
    if region_after != region_before:
        return False, f"region not restored: {region_after} instead of {region_before}"
    return True, "ok"
