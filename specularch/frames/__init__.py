"""Intercept chosen code objects with torch's C frame hook (PEP 523), nothing else.

Design
------
* **Torch's hook, our decisions.** ``torch._C._dynamo.eval_frame`` already ships a
  production PEP 523 hook with a per-code C cache. We reuse only that C hook (never
  ``torch._dynamo``'s tracer, never ``sys.settrace``); all of it goes through
  ``_torch_hook.py``, which validates every object before C sees it, because a wrong
  object there crashes the process instead of raising.
* **Trampolines.** For each registered code, a generated code object with exactly the same
  argument/cell/free-variable layout does ``return __specularch_dispatch__(key, slots,
  cells)``. The C cache runs it in place of the original frame; after the first call this
  is decided in C with no Python callback. ``slots`` are the bound argument values in
  ``co_varnames`` order, ``cells`` the function's real closure cells, so ``nonlocal``
  writes reach the user. Every other code object is marked SKIP once and then costs only
  a C-side check. A dispatcher result of the ``set_run_here`` type (an eager run) is run
  by the trampoline itself, the original one frame below it: recursion through the hook
  nests two frames per level, and the token raises the recursion limit by one for it.
* **Shadow code.** ``Target.call_original`` runs a ``code.replace()`` copy of the original:
  a distinct identity with no cache state, so the original body runs unintercepted while
  targets it calls are still intercepted.
* **Our own region.** While specularch's hook is on, torch's "isolate recompiles" region is
  ``1 << 40`` (+ a counter), so our SKIP marks never stop ``torch.compile`` from
  compiling a function, and ``reset()`` (or registering a code we already skip-marked)
  forgets all C-side state by moving to a fresh region. The region id is process-wide in torch 2.13: it is switched
  when the first thread turns the hook on and restored when the last one turns it off.

Costs (torch 2.13.0+cpu, CPython 3.11.7, noisy 2-vCPU VM, best of 3x7 runs):

======================================================  =========
plain call ``f(1, 2)``, no hook                          ~38 ns
non-target call with the hook on (SKIP cached in C)      ~75 ns
intercepted call, dispatcher returns a constant          ~1.1 µs
intercepted call, dispatcher runs ``call_original``      ~1.5 µs
same for a closure (a function object per call)          ~1.9 µs
``with hook_active(): pass``                             ~1.6 µs
first call of each code per region (Python callback)     15-55 µs
======================================================  =========

Availability
------------
The hook is used only on torch 2.13.x with CPython 3.11 and after a self-test passes (run on
the first ``hook_active()``/``enable_globally()`` or read of ``HOOK_AVAILABLE``). Otherwise
``HOOK_AVAILABLE`` is False, ``hook_unavailable_reason()`` says why, and ``hook_active()``
is a no-op: callers still call targets directly, only nested interception is lost.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional

from . import _torch_hook
from . import interceptor as _interceptor
from .interceptor import (Target, auto_targeting, is_active, register, reset, set_auto_target,
                          set_dispatcher, set_run_here)
from .trampoline import NotInterceptable, call_with_slots

__all__ = ["register", "set_dispatcher", "set_run_here", "set_auto_target", "auto_targeting", "hook_active", "enable_globally", "disable_globally",
           "is_active", "reset", "Target", "HOOK_AVAILABLE", "hook_unavailable_reason",
           "NotInterceptable", "call_with_slots"]

_checked = False
_reason: Optional[str] = _torch_hook.HOOK_UNAVAILABLE_REASON
_check_lock = threading.Lock()


def _available() -> bool:
    global _checked, _reason
    if not _checked:
        with _check_lock:
            if not _checked:
                if _reason is None:
                    ok, why = _interceptor.self_test()
                    _reason = None if ok else f"frame-hook self-test failed: {why}"
                _checked = True
    return _reason is None


def hook_unavailable_reason() -> Optional[str]:
    """None when the hook works here; otherwise why not (runs the self-test once)."""
    _available()
    return _reason


def hook_active() -> Any:
    """Context manager turning interception on in the current thread for its block.

    Re-entrant and nestable; restores the thread's previous callback and the region on
    exit, also when the block raises. A no-op context when the hook is unavailable.
    """
    if not _available():
        return contextlib.nullcontext()
    return _interceptor.hook_active()


def enable_globally() -> bool:
    """Turn interception on in the current thread until ``disable_globally()``.

    Returns False (and does nothing) when the hook is unavailable.
    """
    if not _available():
        return False
    _interceptor.enable_globally()
    return True


def disable_globally() -> None:
    """Undo ``enable_globally()`` in the current thread (no-op if it was not enabled)."""
    _interceptor.disable_globally()


def __getattr__(name: str) -> Any:
    # HOOK_AVAILABLE is computed on first read, since it depends on the self-test.
    if name == "HOOK_AVAILABLE":
        return _available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
