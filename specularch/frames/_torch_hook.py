"""The one place in specularch that touches torch's private PEP 523 hook.

Everything here wraps ``torch._C._dynamo.eval_frame`` and ``torch._C._dynamo.guards`` of
torch 2.13 on CPython 3.11 (see ``/work/shared/hook-notes.md`` for the protocol). These are
private C entry points: handing them a wrong object does not raise, it crashes the process
(a non-code ``guarded_code.code`` segfaults, a tuple strategy aborts). So this module only
passes objects it built and checked itself, and a torch upgrade should only touch this file.

If the running torch or Python is not the tested one, or the entry points are missing,
importing still succeeds: ``HOOK_AVAILABLE`` is False and ``HOOK_UNAVAILABLE_REASON`` says
why, and every function that would reach C raises ``RuntimeError`` with that reason.
"""
from __future__ import annotations

import sys
from types import CodeType
from typing import Any, Callable, Optional

SUPPORTED_TORCH = (2, 13)
SUPPORTED_PYTHON = (3, 11)

# CPython code flags (Include/cpython/code.h); stable since 3.5.
CO_VARARGS = 0x04
CO_VARKEYWORDS = 0x08
CO_RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200  # generator, coroutine, iterable coro, async gen


def _probe() -> tuple[Optional[str], Any, Any]:
    """Return (reason the hook cannot be used or None, eval_frame module, guards module)."""
    if sys.version_info[:2] != SUPPORTED_PYTHON:
        return (f"specularch's frame hook supports CPython {SUPPORTED_PYTHON[0]}."
                f"{SUPPORTED_PYTHON[1]} only (trampoline layout rules are version-specific); "
                f"this is Python {sys.version.split()[0]}", None, None)
    try:
        import torch
        from torch._C._dynamo import eval_frame, guards
    except Exception as exc:  # any import failure means: no hook, not a broken specularch
        return f"cannot import torch's frame hook: {type(exc).__name__}: {exc}", None, None
    version = torch.__version__.split("+")[0].split(".")
    if tuple(int(p) for p in version[:2] if p.isdigit()) != SUPPORTED_TORCH:
        return (f"specularch's frame hook supports torch {SUPPORTED_TORCH[0]}."
                f"{SUPPORTED_TORCH[1]}.x only (private, frequently changing C API); "
                f"this is torch {torch.__version__}", None, None)
    needed = ("set_eval_frame", "get_eval_frame_callback", "set_code_exec_strategy",
              "set_eval_frame_isolate_recompiles_id", "get_eval_frame_isolate_recompiles_id",
              "_FrameAction", "_FrameExecStrategy", "_get_cache_entries_for_region")
    missing = [n for n in needed if not hasattr(eval_frame, n)]
    if not hasattr(guards, "RootGuardManager"):
        missing.append("guards.RootGuardManager")
    if missing:
        return f"torch {torch.__version__} lacks hook entry points: {', '.join(missing)}", None, None
    try:
        if guards.RootGuardManager().check({}) is not True:
            return "an empty RootGuardManager is not always-true in this torch", None, None
    except Exception as exc:
        return f"RootGuardManager probe failed: {type(exc).__name__}: {exc}", None, None
    return None, eval_frame, guards


HOOK_UNAVAILABLE_REASON, _ef, _guards = _probe()
HOOK_AVAILABLE = HOOK_UNAVAILABLE_REASON is None


def _require() -> None:
    if not HOOK_AVAILABLE:
        raise RuntimeError(f"specularch frame hook unavailable: {HOOK_UNAVAILABLE_REASON}")


# ----------------------------------------------------------------- code layout contract ----

def layout_mismatch(new: CodeType, old: CodeType) -> Optional[str]:
    """Say why ``new`` cannot run in place of a frame of ``old``, or return None if it can.

    Torch copies arguments, cells and free variables from the old frame into the new one
    BY INDEX and never checks, so the two codes need the same arguments (names, kinds,
    order), the same cell variables and the same free variables. New locals are allowed.
    """
    if not isinstance(new, CodeType) or not isinstance(old, CodeType):
        return f"expected two code objects, got {type(new).__name__} and {type(old).__name__}"
    for attr in ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount",
                 "co_cellvars", "co_freevars"):
        if getattr(new, attr) != getattr(old, attr):
            return f"{attr} differs: {getattr(new, attr)!r} != {getattr(old, attr)!r}"
    var_flags = CO_VARARGS | CO_VARKEYWORDS
    if new.co_flags & var_flags != old.co_flags & var_flags:
        return "*args/**kwargs flags differ"
    n = total_argcount(old)
    if new.co_varnames[:n] != old.co_varnames[:n]:
        return f"argument names differ: {new.co_varnames[:n]} != {old.co_varnames[:n]}"
    if new.co_flags & CO_RESUMABLE or old.co_flags & CO_RESUMABLE:
        return "generator/coroutine frames are resumed by the hook too; never replace them"
    return None


def total_argcount(code: CodeType) -> int:
    """Number of argument slots: positional + keyword-only + ``*args`` + ``**kwargs``."""
    return (code.co_argcount + code.co_kwonlyargcount
            + bool(code.co_flags & CO_VARARGS) + bool(code.co_flags & CO_VARKEYWORDS))


# ------------------------------------------------------------------------ decisions ----

class Decision:
    """What the callback returns; duck-types ``torch._dynamo.types.ConvertFrameReturn``.

    The C side reads exactly these three attributes; ``frame_exec_strategy`` must be a real
    ``_FrameExecStrategy`` (anything else aborts the process), so only the builders below
    create decisions.
    """

    __slots__ = ("frame_exec_strategy", "apply_to_code", "guarded_code")

    def __init__(self, cur: Any, recursive: Any, apply_to_code: bool,
                 guarded_code: Optional["_GuardedCode"]) -> None:
        self.frame_exec_strategy = _ef._FrameExecStrategy(cur, recursive)
        self.apply_to_code = bool(apply_to_code)
        self.guarded_code = guarded_code


class _AlwaysTrueGuards:
    """Duck-typed ``GuardManagerWrapper``: an empty ``RootGuardManager`` always passes.

    All real guarding is done in Python by the dispatcher; the C cache only has to answer
    "this code is a target: run its trampoline".
    """

    __slots__ = ("root", "diff_guard_root", "cache_entry", "extra_state", "id_matched_objs")

    def __init__(self) -> None:
        self.root = _guards.RootGuardManager()
        self.diff_guard_root = _guards.RootGuardManager()
        self.cache_entry = None      # written by the C++ side
        self.extra_state = None      # written by the C++ side
        self.id_matched_objs = {}    # read by Dynamo's cache-size check if it sees our entry


class _GuardedCode:
    """Duck-typed ``GuardedCode``: the replacement code and its (always-true) guards."""

    __slots__ = ("code", "guard_manager", "compile_id", "trace_annotation")

    def __init__(self, code: CodeType) -> None:
        self.code = code
        self.guard_manager = _AlwaysTrueGuards()
        self.compile_id = None
        self.trace_annotation = "specularch"


if HOOK_AVAILABLE:
    _DEFAULT, _SKIP = _ef._FrameAction.DEFAULT, _ef._FrameAction.SKIP
    #: Skip this code object from now on (in the current region); its callees stay hooked.
    SKIP_CODE: Optional[Decision] = Decision(_SKIP, _DEFAULT, True, None)
    #: Skip only this frame; the callback is asked again on the next call (~25 µs each).
    SKIP_ONCE: Optional[Decision] = Decision(_SKIP, _DEFAULT, False, None)
else:
    SKIP_CODE = SKIP_ONCE = None


def run_code(replacement: CodeType, original: CodeType) -> Decision:
    """Decision: run ``replacement`` instead of this frame of ``original``, now and later.

    The entry is cached by C per code object and region; later calls never reach Python.
    Raises ``TypeError`` for anything that could crash the C side.
    """
    _require()
    problem = layout_mismatch(replacement, original)
    if problem is not None:
        raise TypeError(f"refusing to hand torch a replacement for "
                        f"{getattr(original, 'co_qualname', original)!r}: {problem}")
    return Decision(_DEFAULT, _DEFAULT, True, _GuardedCode(replacement))


# ----------------------------------------------------------- install, regions, frames ----

Callback = Callable[[Any, Any, Any], Decision]


def swap_callback(callback: Optional[Callback]) -> Any:
    """Set this thread's frame callback (a callable or None); return the previous one."""
    _require()
    if callback is not None and callback is not False and not callable(callback):
        raise TypeError(f"frame callback must be callable or None, not {type(callback).__name__}")
    return _ef.set_eval_frame(callback)


def get_callback() -> Any:
    """This thread's current frame callback (None when no hook is on)."""
    _require()
    return _ef.get_eval_frame_callback()


def swap_region(region: int) -> int:
    """Set the isolate-recompiles region (process-wide in torch 2.13); return the previous."""
    _require()
    if type(region) is not int:
        raise TypeError(f"region id must be an int, not {type(region).__name__}")
    return _ef.set_eval_frame_isolate_recompiles_id(region)


def get_region() -> int:
    """The current isolate-recompiles region id (-1 is torch.compile's default region)."""
    _require()
    return _ef.get_eval_frame_isolate_recompiles_id()


if HOOK_AVAILABLE:
    # Unchecked C entry points for the activation fast path (hook_active costs ~1 µs less).
    # Only pass them None, the callback specularch installs, a value one of them returned,
    # or an int region id.
    raw_swap_callback = _ef.set_eval_frame
    raw_swap_region = _ef.set_eval_frame_isolate_recompiles_id


def clear_global_skip(code: CodeType) -> None:
    """Undo a global-region SKIP (e.g. set by torch.compile on a tensor-free frame).

    Isolated regions inherit a global SKIP, which would hide a target from our callback.
    This also drops a user's ``torch._dynamo.skip`` on that code.
    """
    _require()
    if not isinstance(code, CodeType):
        raise TypeError(f"expected a code object, not {type(code).__name__}")
    _ef.set_code_exec_strategy(code, _ef._FrameExecStrategy(_DEFAULT, _DEFAULT))


def cache_entry_count(code: CodeType, region: int) -> int:
    """How many C cache entries ``code`` has in ``region`` (for self-tests and debugging)."""
    _require()
    if not isinstance(code, CodeType) or type(region) is not int:
        raise TypeError("cache_entry_count(code, region) takes a code object and an int")
    return len(_ef._get_cache_entries_for_region(code, region))


def frame_facts(frame: Any) -> tuple[CodeType, int, Any]:
    """``(code, last instruction index, builtins)`` of the frame handed to the callback.

    The frame object only borrows the C frame: never keep it past the callback.
    ``lasti`` is -1 for a frame that has not started (>= 0 on a generator resume).
    """
    return frame.f_code, frame.f_lasti, frame.f_builtins
