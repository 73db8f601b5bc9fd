"""The hot path: every call of an optimized object starts here.

Per call: each graph entry in turn runs its generated function (guards → graph → in-graph
assumptions → commit of the shadow heap → rebuilt result; ``MISS`` when its guards fail);
then the object disabled at ``cache_limit`` or an eager entry whose guards pass sends the
call to the original (an ``EagerRun``); then the first calls are profiled eagerly; anything
else is a miss (``misses.py``). Everything off this path — graphs that raised or whose
assumption failed, fallback records, strict mode — is in ``fallback.py`` and ``misses.py``.
"""
from __future__ import annotations

from typing import Any, Callable

from ..config import config
from ..eager_run import FRAME_HOOK, EagerRun
from ..entry_function import MISS, AssumptionFailed
from ..guards import draws
from ..records import AssumptionBroken
from . import fallback, hooks, misses
from .state import _STATES, CodeState, GraphEntry, state_for

_PER_INSTANCE: dict[int, Callable] = {}   # target key -> resolve(module) -> CodeState | None
_PER_CALL_SITE: dict[int, Callable] = {}  # target key -> handler(target, slots, cells)
_WRAPPER: Callable | None = None          # see set_run_wrapper


def dispatch(target, slots: tuple, cells: tuple | None) -> Any:
    """Called by trampolines (frames reached through the hook) for every call of ``target``."""
    # A call that runs the original returns an ``EagerRun`` for the trampoline to run in
    # its own frame (``frames.set_run_here``): recursion through the hook keeps eager's depth.
    resolve = _PER_INSTANCE.get(target.key)
    if resolve is not None:
        state = resolve(slots[0]) if slots else None
        if state is not None and state.target is target:
            return start(state, slots, cells)
        # another instance of an optimized module's class, or an optimized instance of a
        # subclass whose forward calls this one (``super().forward(x)``): its cache is for
        # its own forward, not this code
        if not FRAME_HOOK.auto_targeting():
            return EagerRun(None, target, cells)
    handler = _PER_CALL_SITE.get(target.key)
    if handler is not None:
        return handler(target, slots, cells)
    state = _STATES.get(target.key)
    if state is None or state.target is not target:
        state = state_for(target)
    return start(state, slots, cells)


def start(state: CodeState, slots: tuple, cells: tuple | None) -> Any:
    """``run``, except that a call whose path runs eagerly returns an ``EagerRun``: the
    caller runs the original in its own frame (see ``eager_run``)."""
    if _WRAPPER is not None:
        return _WRAPPER(state, slots, cells, run_unwrapped)
    return _start(state, slots, cells)


def run(state: CodeState, slots: tuple, cells: tuple | None) -> Any:
    """One call of ``state.target``: a cached graph, a capture, or the original Python."""
    if _WRAPPER is not None:
        return _WRAPPER(state, slots, cells, run_unwrapped)
    return run_unwrapped(state, slots, cells)


def run_unwrapped(state: CodeState, slots: tuple, cells: tuple | None) -> Any:
    """``run`` without the run wrapper: what a wrapper calls to run the call itself."""
    result = _start(state, slots, cells)
    if type(result) is EagerRun:
        return result.run(state.target.call_original, slots, cells)
    return result


def _start(state: CodeState, slots: tuple, cells: tuple | None, drawing: bool = False) -> Any:
    if state.draws and not drawing:  # its code draws from Python's random module (draws.py)
        with draws.call():
            return _start(state, slots, cells, True)
    state.stats.calls += 1
    globals_ = state.target.globals
    builtins_ = state.builtins
    for entry in state.entries:
        result = try_entry(state, entry, slots, cells, globals_, builtins_)
        if result is not MISS:
            return result
    if state.disabled is not None:  # cache_limit reached
        return fallback.defer_eager(state, slots, cells, state.disabled)
    for eager in state.eager:
        if eager.check(slots, cells, globals_, builtins_):
            return fallback.defer_eager(state, slots, cells, eager.record, eager.reaches_backward)
    if not state.entries and state.stats.profiled_calls < config.profile_calls \
            and not hooks.distributed.active():  # ranks must not run unaveraged eager steps
        return misses.profile_call(state, slots, cells)
    return misses.miss(state, slots, cells, globals_, builtins_, try_entry)


def try_entry(state: CodeState, entry: GraphEntry, slots, cells, globals_, builtins_,
              count_hit: bool = True) -> Any:
    """The call's result through ``entry``, or MISS when its guards do not pass. A graph that
    raises, or whose assumption fails, leads to the original Python (nothing committed)."""
    # (the original runs after the ``except`` blocks: inside one, what it raises would get the
    # graph's exception as its ``__context__`` and ``sys.exc_info()`` in it would see it)
    raised = None
    try:
        result = entry.fn(slots, cells, globals_, builtins_)
    except AssumptionBroken as e:  # (an in-graph assumption, failed where the graph cannot go on)
        result = AssumptionFailed(e.where, e.site, True)
    except Exception as e:  # (the entry function put the grad mode back: see entry_function.py)
        raised = e
    if raised is not None:
        replacement = misses.fx_instead(state, entry, raised)  # a compiling backend failed
        if replacement is not None:
            return try_entry(state, replacement, slots, cells, globals_, builtins_, count_hit)
        return fallback.graph_raised(state, entry, raised, slots, cells)
    if result is MISS:
        return MISS
    if type(result) is AssumptionFailed:
        return fallback.assumption_failed(state, entry, result, slots, cells)
    entry.hits += 1
    if type(result) is EagerRun:  # the eager tier: its path runs the original (tiering/eager_tier.py)
        state.stats.eager_tier_calls += count_hit
        return result
    if state.draws:  # the generator ends where this path's draws leave it
        draws.settle(entry.capture.draws)
    state.stats.graph_hits += count_hit
    return result


def per_instance(target, resolve: Callable) -> None:
    """``nn.Module`` forwards optimized per instance: ``resolve(module)`` is the instance's
    state, or None for an instance that was not optimized."""
    _PER_INSTANCE[target.key] = resolve


def per_call_site(target, handler: Callable) -> None:
    """Targets of the global switch optimized only at some of their calls (a module forward:
    its outermost calls, see policy.py): ``handler(target, slots, cells)`` takes each call."""
    _PER_CALL_SITE[target.key] = handler


def set_run_wrapper(wrapper: Callable | None) -> Callable | None:
    """Make ``wrapper(state, slots, cells, run)`` take every optimized call (None: no wrapper);
    it calls ``run(state, slots, cells)`` to run the call itself. Returns the previous one."""
    global _WRAPPER
    previous, _WRAPPER = _WRAPPER, wrapper
    return previous


def run_wrapper() -> Callable | None:
    """The wrapper ``set_run_wrapper`` installed, or None."""
    return _WRAPPER
