"""Registry of intercepted code objects, the frame callback, and per-thread activation.

Tables are keyed by ``id(code)`` and checked with ``is``: code objects compare by value, so
a code-keyed dict would confuse a target with its own shadow copy (infinite recursion).
"""
from __future__ import annotations

import builtins
import itertools
import random
import threading
import weakref
from types import FunctionType
from typing import Any, Callable, Optional

from . import _torch_hook as _th
from . import trampoline as _tr

#: Our isolate-recompiles region: keeps our SKIP marks and cache entries away from
#: torch.compile's region (-1) and its isolated regions (0, 1, 2, ...).
REGION_BASE = 1 << 40

Dispatcher = Callable[["Target", tuple, Optional[tuple]], Any]

_lock = threading.RLock()                 # registry writes, region bumps
_activation_lock = threading.Lock()       # _holders, _region_before, the region id itself
_by_code: dict[int, "Target"] = {}        # id(code) -> Target (the callback's lookup)
_by_key: dict[int, "Target"] = {}         # key baked into a trampoline -> Target
# Random base: a trampoline left over from an earlier copy of this module can never hit
# the wrong Target, it finds no key and says so.
_keys = itertools.count(random.SystemRandom().getrandbits(30) << 20)
_dispatcher: Optional[Dispatcher] = None
_skipped: set[int] = set()                # id(code) we SKIP-marked in the current region
_region = REGION_BASE
_holders = 0                              # activations alive in all threads
_region_before = -1                       # region to restore when the last one ends
_tls = threading.local()                  # .stack: live tokens, .global_token
_counts = {"callback_calls": 0, "skips": 0, "skip_once": 0, "trampolines_installed": 0,
           "callback_errors": 0}


class Target:
    """One intercepted code object and everything built for it.

    ``fn`` is the first function registered for ``code`` while it is alive (None after):
    closures made by the same ``def`` share the Target, which lives as long as the process,
    so it must not keep the first closure's cells (say, a model) alive. ``trampoline`` is
    None for generators and coroutines (``is_generator``), which are never intercepted.
    """

    __slots__ = ("_fn", "_fn_name", "code", "key", "name", "filename", "firstlineno", "globals",
                 "argnames", "trampoline", "shadow_code", "is_generator", "_binder_code",
                 "_binders", "_shadow_fn", "_unbind", "_rename", "_glue", "__weakref__")

    def __init__(self, fn: FunctionType, key: int, glue: str = _tr.GLUE_NAME) -> None:
        code = fn.__code__
        layout = _tr.Layout.of(code)
        self._fn, self._fn_name = weakref.ref(fn), fn.__name__
        self.code, self.key, self._glue = code, key, glue
        self.name, self.filename, self.firstlineno = fn.__qualname__, code.co_filename, code.co_firstlineno
        self.globals, self.argnames = fn.__globals__, layout.argnames
        self.is_generator = bool(code.co_flags & _th.CO_RESUMABLE)
        self.trampoline = None if self.is_generator else _tr.build_trampoline(code, key, glue)
        self.shadow_code = _tr.build_shadow(code)
        self._binder_code = _tr.build_binder_code(code)
        self._binders: "weakref.WeakKeyDictionary[FunctionType, FunctionType]" = \
            weakref.WeakKeyDictionary()
        self._unbind = _tr.unbinder_for(code)
        self._rename = fn.__qualname__ != code.co_qualname
        self._shadow_fn = None if code.co_freevars else self._shadow_function(None)

    def __repr__(self) -> str:
        return f"<Target {self.name} at {self.filename}:{self.firstlineno}>"

    @property
    def fn(self) -> Optional[FunctionType]:
        return self._fn()

    def _shadow_function(self, cells: Optional[tuple]) -> FunctionType:
        f = FunctionType(self.shadow_code, self.globals, self._fn_name, None, cells)
        if self._rename:
            f.__qualname__ = self.name
        return f

    def original_function(self, cells: Optional[tuple]) -> FunctionType:
        """A function (no defaults) running the original bytecode unintercepted with closure
        ``cells``: what ``call_original`` calls, for a caller passing every argument."""
        if cells is None:
            f = self._shadow_fn
            if f is None:
                raise TypeError(f"{self.name} is a closure; call_original needs its cells")
            return f
        return self._shadow_function(cells)

    def shadow_for(self, fn: FunctionType) -> FunctionType:
        """``fn`` with the shadow code (see ``call_original``): called like ``fn``, with its
        defaults, globals and closure, it runs the original bytecode unintercepted."""
        if not isinstance(fn, FunctionType) or fn.__code__ is not self.code:
            raise TypeError(f"shadow_for needs a function whose code is {self.name}'s, "
                            f"got {fn!r:.80}")
        f = FunctionType(self.shadow_code, fn.__globals__, fn.__name__, fn.__defaults__,
                         fn.__closure__)
        f.__kwdefaults__, f.__qualname__ = fn.__kwdefaults__, fn.__qualname__
        return f

    def binder_for(self, fn: FunctionType) -> FunctionType:
        """``binder(*args, **kwargs) -> slots`` using ``fn``'s current defaults.

        Raises the same ``TypeError`` as calling ``fn`` with bad arguments.
        """
        if not isinstance(fn, FunctionType) or fn.__code__ is not self.code:
            raise TypeError(f"binder_for needs a function whose code is {self.name}'s, "
                            f"got {fn!r:.80}")
        binder = self._binders.get(fn)
        if binder is None:
            binder = self._binders[fn] = _tr.make_binder(self._binder_code, fn)
        elif binder.__defaults__ is not fn.__defaults__ or binder.__kwdefaults__ is not fn.__kwdefaults__:
            binder.__defaults__, binder.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
        return binder

    def call_original(self, slots: tuple, cells: Optional[tuple]) -> Any:
        """Run the original bytecode on ``slots`` with closure ``cells``; return its result.

        This frame is not intercepted again, but calls it makes to other targets are
        while the hook is active in this thread.
        """
        if len(slots) != len(self.argnames):
            raise TypeError(f"{self.name}: expected {len(self.argnames)} slots, got {len(slots)}")
        if cells is None:
            f = self._shadow_fn
            if f is None:
                raise TypeError(f"{self.name} is a closure; call_original needs its cells")
        else:
            f = self._shadow_function(cells)
        return self._unbind(f, slots)


# --------------------------------------------------------------------------- registry ----

def register(fn: Any) -> Target:
    """Return the Target for ``fn``'s code object, creating it on first use.

    Accepts Python functions and bound methods (unwrapped via ``__func__``). Raises
    ``TypeError`` (``NotInterceptable``) for builtins, classes, modules and other callables.
    """
    return _register(fn, _tr.GLUE_NAME)


def _register(fn: Any, glue: str) -> Target:
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, FunctionType):
        hint = " (register its .forward)" if hasattr(fn, "forward") else ""
        raise _tr.NotInterceptable(f"only Python functions can be intercepted, not "
                                   f"{type(fn).__name__} {fn!r:.60}{hint}")
    code = fn.__code__
    target = _by_code.get(id(code))   # lock-free fast path: callers register per call
    if target is not None and target.code is code:
        return target
    with _lock:
        target = _by_code.get(id(code))
        if target is not None and target.code is code:
            return target
        target = Target(fn, next(_keys), glue)
        _by_key[target.key] = target
        _by_code[id(code)] = target
        _note_shadow(target.shadow_code)  # never auto-targeted (it is the fallback)
        if _th.HOOK_AVAILABLE and not target.is_generator:
            _th.clear_global_skip(code)
            if id(code) in _skipped:  # already SKIP-marked by us: only a new region forgets
                _bump_region()
    return target


def _unregister(target: Target) -> None:
    with _lock:
        if _by_code.get(id(target.code)) is target:
            del _by_code[id(target.code)]
        _by_key.pop(target.key, None)


_auto_target: Optional[Callable] = None
# id(shadow code) -> a weak reference to it, dropped when that code is freed: an unregistered
# target's shadow code dies with it, and a fresh code object at the same address must not be
# taken for a shadow (the global policy would never be asked about it).
_shadow_ids: dict[int, weakref.ref] = {}


def _note_shadow(code) -> None:
    key = id(code)
    _shadow_ids[key] = weakref.ref(code, lambda _, key=key: _shadow_ids.pop(key, None))


def set_auto_target(predicate: Optional[Callable]) -> None:
    """``predicate(frame, code) -> FunctionType | None`` decides, the first time the hook
    sees an unregistered code object, whether to make it a target (the function returned is
    registered). It must be cheap and must not raise; None restores skip-everything."""
    global _auto_target
    _auto_target = predicate


def auto_targeting() -> bool:
    """Whether a predicate picks targets among unregistered code (the global switch)."""
    return _auto_target is not None


def set_dispatcher(dispatcher: Optional[Dispatcher]) -> None:
    """Route every trampoline to ``dispatcher(target, slots, cells)``; its return value is
    the intercepted call's return value. None restores ``target.call_original``."""
    global _dispatcher
    if dispatcher is not None and not callable(dispatcher):
        raise TypeError(f"dispatcher must be callable, not {type(dispatcher).__name__}")
    _dispatcher = dispatcher


def _glue(key: int, slots: tuple, cells: Optional[tuple]) -> Any:
    target = _by_key.get(key)
    if target is None:
        raise RuntimeError(f"specularch: a trampoline ran for unknown target key {key}; "
                           "its target was forgotten by frames.reset() (region mix-up)")
    dispatcher = _dispatcher
    if dispatcher is None:
        return target.call_original(slots, cells)
    return dispatcher(target, slots, cells)


setattr(builtins, _tr.GLUE_NAME, _glue)   # resolves from any module's globals
setattr(builtins, _tr.TYPE_NAME, type)


class _NeverReturned:
    """The run-here type while none is set: no dispatcher result is one."""


def set_run_here(token_type: Optional[type]) -> None:
    """Make trampolines run the original in their own frame when the dispatcher returns an
    instance ``r`` of exactly ``token_type``: ``r`` is a context manager with ``extra`` (a
    one-element list of frames paid for, see ``eager_run.EXTRA``), ``sync()``,
    ``original`` (the function to call with the call's arguments, e.g.
    ``target.original_function(cells)``) and ``done(result) -> result`` (see
    ``trampoline._run_here_lines``). None: every result is returned as it is."""
    if token_type is not None and not isinstance(token_type, type):
        raise TypeError(f"set_run_here needs a class, not {type(token_type).__name__}")
    setattr(builtins, _tr.RUN_HERE_NAME, token_type or _NeverReturned)


set_run_here(None)


def unregister_all() -> None:
    """Forget every target. Code intercepted so far is no longer intercepted: the region
    changes, so C-side cache entries and SKIP marks of the old region are ignored."""
    with _lock:
        _by_code.clear()
        _by_key.clear()
        _bump_region()


def reset() -> None:
    """``unregister_all()`` and zero the ``stats()`` counters; the dispatcher is kept."""
    unregister_all()
    for name in _counts:
        _counts[name] = 0


def stats() -> dict[str, int]:
    """Counters since the last ``reset()``: callback calls, skips (per code), skip-once
    answers, trampolines installed, and exceptions swallowed by the callback."""
    return dict(_counts)


def _bump_region() -> None:
    global _region
    with _lock, _activation_lock:
        _region += 1
        _skipped.clear()
        if _holders and _th.HOOK_AVAILABLE:
            _th.swap_region(_region)


# ------------------------------------------------------------------------- callback ----

def _callback(frame: Any, cache_entry: Any, frame_state: Any) -> Any:
    # Called by C with the hook off in this thread, on a cache miss only. An error here is
    # swallowed (the frame runs as plain Python): raising would switch the hook off in this
    # thread for good. Ctrl-C (a BaseException that is not an Exception) is the program's:
    # it is raised at the call being entered, as eager would raise it there, with the hook
    # switched back on first (torch does not, after a callback that raised).
    try:
        _counts["callback_calls"] += 1
        code, lasti, frame_builtins = _th.frame_facts(frame)
        target = _by_code.get(id(code))
        if target is None and _auto_target is not None and lasti < 0 and id(code) not in _shadow_ids:
            fn = _auto_target(frame, code)  # the global policy: is this frame worth it?
            if fn is not None:
                target = _register(fn, _tr.GLUE_NAME)
        if target is None or target.code is not code or target.trampoline is None:
            # Non-targets are skipped for good, whether fresh or resumed generators.
            _skipped.add(id(code))
            _counts["skips"] += 1
            return _th.SKIP_CODE
        if lasti >= 0 or target._glue not in frame_builtins \
                or _tr.RUN_HERE_NAME not in frame_builtins:
            # A started frame cannot be replaced; custom __builtins__ cannot see the glue.
            _counts["skip_once"] += 1
            return _th.SKIP_ONCE
        decision = _th.run_code(target.trampoline, code)
        _counts["trampolines_installed"] += 1
        return decision
    except Exception:
        try:
            _counts["callback_errors"] += 1
        except BaseException:
            pass
        return _th.SKIP_ONCE
    except BaseException:
        _th.raw_swap_callback(_callback)  # C code: no Python frame runs hooked before the raise
        raise


# ------------------------------------------------------------------------ activation ----

# A token is a one-element list ``[prior callback]``: built in C (no __init__ frame under
# the hook) and compared by identity. Each thread keeps a stack of its live tokens.

def _enter() -> list:
    global _holders, _region_before
    swap_callback = _th.raw_swap_callback
    token = [swap_callback(None)]   # no Python frame is hooked while we switch regions
    _activation_lock.acquire()      # (a `with` block costs ~150 ns more on 3.11)
    try:
        previous = _th.raw_swap_region(_region)
        if _holders == 0:
            _region_before = previous
        _holders += 1
    finally:
        _activation_lock.release()
    try:
        _tls.stack.append(token)
    except AttributeError:
        _tls.stack = [token]
    swap_callback(_callback)
    return token


def _is_live(token: Optional[list]) -> bool:
    stack = getattr(_tls, "stack", None)
    return bool(stack) and (stack[-1] is token or any(t is token for t in stack))


def _exit(token: list) -> None:
    global _holders
    if not _is_live(token):
        return  # already ended by disable_globally() or an enclosing block's exit
    stack = _tls.stack
    swap_callback = _th.raw_swap_callback
    swap_callback(None)
    _activation_lock.acquire()
    try:
        while True:  # tokens above ours were abandoned (mis-nesting): end them too
            top = stack.pop()
            _holders -= 1
            if top is token:
                break
        # The region is process-wide in torch 2.13: keep ours while any thread is hooked.
        _th.raw_swap_region(_region if _holders else _region_before)
    finally:
        _activation_lock.release()
    swap_callback(token[0])


class hook_active:
    """Context manager: the hook is on in this thread inside the block.

    Re-entrant and nestable; on exit (also when the block raises) this thread's previous
    callback and the previous region are restored. Other threads are not affected.
    """

    __slots__ = ("_tokens",)

    def __init__(self) -> None:
        self._tokens: list[list] = []

    def __enter__(self) -> "hook_active":
        self._tokens.append(_enter())
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        _exit(self._tokens.pop())
        return False


def enable_globally() -> None:
    """Turn the hook on in this thread until ``disable_globally()`` (idempotent).

    Called inside a ``hook_active`` block, it ends with that block. A thread that exits
    while enabled leaves our region selected process-wide; disable before it ends.
    """
    if not _is_live(getattr(_tls, "global_token", None)):
        _tls.global_token = _enter()


def disable_globally() -> None:
    """Undo ``enable_globally()`` in this thread; also ends hook_active blocks inside it."""
    token = getattr(_tls, "global_token", None)
    _tls.global_token = None
    if token is not None:
        _exit(token)


def is_active() -> bool:
    """True when this thread's frame callback is specularch's."""
    return _th.HOOK_AVAILABLE and _th.get_callback() is _callback


def self_test() -> tuple[bool, str]:
    """Run a toy function through the hook; return ``(ok, reason)``, never raise.

    See ``selftest.run`` for what is checked.
    """
    from .selftest import run
    return run()
