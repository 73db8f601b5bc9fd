"""The eager path in the caller's own frame, and the lock that makes a graph call atomic.

**Eager runs.** A call that runs the original Python (its path is remembered as eager, or
the object is disabled) is not run by the dispatcher: ``dispatch.start`` returns an
``EagerRun`` and the caller (the ``optimize`` wrapper) runs the original itself:

    with token:
        return token.done(shadow(*args, **kwargs))

so a recursive function that runs eagerly nests two frames per level (wrapper, original)
instead of seven (wrapper, run, _run, _run_eager, call_original, unbinder, original). A call
reached through the frame hook (a function recursing by its own name, a module's forward
calling a child of its class) gets the token back in its trampoline, which runs the original
the same way in its own frame (``frames.set_run_here``, wired by ``api.py``): two frames per
level there too. The one frame eager does not have is paid for by raising the recursion limit
by one while the call runs: a program that runs eagerly reaches the depth eager reaches, and
the ``RecursionError`` eager raises beyond it (never a deeper one: the limit is raised by the
frames added, no more).

**Graph calls and threads.** An entry reads the heap (guards, graph inputs), runs the graph
(torch releases the GIL) and writes the heap (commit). Two threads calling one optimized
object would both read ``count == 5`` and both commit 6. An entry that commits anything holds
``COMMIT_LOCK`` from its guards to its commit (``locked_entry``); entries that write nothing
take no lock. One lock for every such entry, not one per optimized object: the same object
is often written by the graphs of several (a module inlined into its caller's graph and also
called directly), and one re-entrant lock cannot deadlock with itself. The price: graphs that
write run one at a time across threads. Eager runs never hold it: they run user code, which
may wait for other threads (a lock held there could deadlock where eager does not).
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, ContextManager

from . import log


class FrameHook:
    """The frame hook's switch as the dispatcher and the eager path see it. frames/ sits above
    both (it calls down into them), so neither imports it: ``api.py`` installs the switch here
    when the package loads (``install_frame_hook``). Before that, runs leave interception as
    it is and no other instance of a module's class is taken on automatically."""
    __slots__ = ("active", "auto_targeting")

    def __init__(self) -> None:
        self.active: Callable[[], ContextManager] = contextlib.nullcontext  # hook on for a block
        self.auto_targeting: Callable[[], bool] = bool  # bool() is False


FRAME_HOOK = FrameHook()


def install_frame_hook(active: Callable[[], ContextManager], auto_targeting: Callable[[], bool]) -> None:
    FRAME_HOOK.active, FRAME_HOOK.auto_targeting = active, auto_targeting

_LIMIT_LOCK = threading.Lock()  # the recursion limit is process-wide: adjust it atomically
# Eager runs in flight (all threads), each paid one frame of recursion limit. Changed in the
# caller's frame without a call (``EXTRA[0] += 1``): a call can itself hit the recursion limit,
# and a count missed while unwinding a RecursionError would raise the limit for good.
EXTRA = [0]
_APPLIED = [None, 0]  # the limit last set here, and the EXTRA it included


def sync_limit() -> None:
    """Set the recursion limit to the program's own limit plus ``EXTRA``. A limit the program
    set itself meanwhile becomes its own limit. Best effort: a sync that cannot be made now
    (too deep to call, or to lower the limit) is made by the next one."""
    with _LIMIT_LOCK:
        current = sys.getrecursionlimit()
        limit, included = _APPLIED
        own = current - included if current == limit else current
        wanted = own + EXTRA[0]
        if wanted != current:
            try:
                sys.setrecursionlimit(wanted)
            except (RecursionError, ValueError):
                return
        _APPLIED[:] = [wanted, EXTRA[0]]


class EagerRun:
    """Returned instead of a result: run the original Python in the caller's frame, as

        with token:            # the frame hook on: nested optimized calls are seen
            EXTRA[0] += 1      # pay for the caller's frame
            try:
                sync_limit()
                return token.done(original(*args, **kwargs))
            finally:
                EXTRA[0] -= 1  # (synced by __exit__)

    A hook block or a sync that a RecursionError keeps from running is ended or made by the
    next one out. ``done(result)`` finishes the bookkeeping of a call that returned.

    A token with ``target`` (made for a call reached through the frame hook) is also run by
    the trampoline, as ``original`` (see ``frames.set_run_here``). Without a ``record`` it is
    a plain run of the original (a module forward not optimized at this call): no fallback
    is reported and the hook, already on in a trampoline, is not entered again."""

    __slots__ = ("record", "target", "cells", "timer", "_hook")
    extra = EXTRA  # what the trampoline reads (``frames.set_run_here``)
    sync = staticmethod(sync_limit)

    def __init__(self, record, target=None, cells=None, timer=None) -> None:
        self.record, self.target, self.cells = record, target, cells
        # The eager tier's runs (tiering/eager_tier.py): not a fallback, but the hook is on as
        # for one, and ``timer.start()``/``timer.stop(result)`` bracket the run of the original.
        self.timer = timer
        self._hook = None

    @property
    def original(self) -> Callable:
        """The original bytecode as a function of the call's arguments (trampoline runs)."""
        return self.target.original_function(self.cells)

    def __enter__(self) -> "EagerRun":
        if self.record is not None or self.timer is not None:
            self._hook = FRAME_HOOK.active()
            self._hook.__enter__()
        if self.timer is not None:
            self.timer.start()
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        if self._hook is not None:
            self._hook.__exit__(*exc_info)
        try:
            sync_limit()
        except RecursionError:  # unwinding a RecursionError: an outer level syncs
            pass
        return False

    def done(self, result: Any) -> Any:
        if self.timer is not None:
            self.timer.stop(result)  # a run that returned (one that raised is not timed)
        elif self.record is not None:
            log.warn_fallback(self.record)  # a call that returned (not one that raised)
        return result

    def run(self, fn: Callable, *args: Any) -> Any:
        """The pattern above for ``fn(*args)`` (one frame more than writing it out)."""
        with self:
            EXTRA[0] += 1
            try:
                sync_limit()
                return self.done(fn(*args))
            finally:
                EXTRA[0] -= 1


COMMIT_LOCK = threading.RLock()


def locked_entry(fn: Callable) -> Callable:
    """``fn`` (an entry: guards, graph, commit) run while holding ``COMMIT_LOCK``."""
    lock = COMMIT_LOCK

    def entry(slots, cells, globals_, builtins_):
        with lock:
            return fn(slots, cells, globals_, builtins_)
    return entry
