"""What the dispatcher keeps per optimized object, and the registries that find it.

A ``CodeState`` is one cache: its graph entries, eager entries, statistics and records.
Functions and module instances given to ``optimize`` own one each (``new_state``); code reached
only through the frame hook (the global switch) shares one per code object (``state_for``).
"""
from __future__ import annotations

import builtins
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import log
from ..config import config
from ..fx_lower import get_backend
from ..guards import GuardSet
from ..records import FallbackRecord
from ..guards.relax import Generalisation
from ..symbolic.capture import Capture


@dataclass
class Stats:
    calls: int = 0
    graph_hits: int = 0
    captures: int = 0
    recompiles: int = 0
    fallback_calls: int = 0
    assumption_failures: int = 0
    profiled_calls: int = 0
    capture_seconds: float = 0.0
    compile_seconds: float = 0.0
    eager_tier_calls: int = 0  # calls of a path whose tier is eager (tiering/eager_tier.py)

    def __str__(self) -> str:
        eager = f" eager_tier_calls={self.eager_tier_calls}" if self.eager_tier_calls else ""
        return (f"calls={self.calls} graph_hits={self.graph_hits}{eager} captures={self.captures} "
                f"recompiles={self.recompiles} fallback_calls={self.fallback_calls} "
                f"profiled_calls={self.profiled_calls} assumption_failures={self.assumption_failures} "
                f"capture={self.capture_seconds * 1e3:.1f}ms compile={self.compile_seconds * 1e3:.1f}ms")


@dataclass
class GraphEntry:
    capture: Capture
    backend: str
    fn: Callable
    entry_source: str
    grad_enabled: bool
    compile_seconds: float
    hits: int = 0
    note: str = ""  # why the chosen backend was not used, if it was not
    graph_fn: Callable | None = None  # what the backend compiled (``fn`` wraps it in guards)
    tier: Any = None  # backend "auto": the graph's tiering history (tiering/history.py)


@dataclass
class EagerEntry:
    check: Callable
    guards: GuardSet
    record: FallbackRecord
    reaches_backward: bool = False  # its capture got past backward(): a distributed step


@dataclass(eq=False)
class CodeState:
    target: Any
    backend: str
    entries: list = field(default_factory=list)
    eager: list = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    fallbacks: dict = field(default_factory=dict)
    recompiles: list = field(default_factory=list)
    disabled: FallbackRecord | None = None
    unstable_sites: set = field(default_factory=set)  # tensor branches seen going both ways
    profile: list = field(default_factory=list)       # facts of the profiled calls
    general: Generalisation = field(default_factory=Generalisation)
    notes: list = field(default_factory=list)  # backend notes (e.g. "no CUDA: used fx")
    broadcast: dict = field(default_factory=dict)  # id -> weakref of tensors sent from rank 0
    builtins: dict = None
    value_dependent_failures: int = 0  # captures that failed on tensor values, not remembered
    eager_seconds: list = field(default_factory=list)  # profiled calls' durations (budget.py)
    exact: bool = False  # optimize(exact=True): bit-identical to eager (dispatch/exact.py)
    draws: bool = False  # a capture drew from Python's random module: calls open a draws.Call
    # loop site -> the report of a loop left unrolled in a graph dropped since, or in a
    # capture that fell back (explain() shows why, with no graph left to show it)
    unrolled: dict = field(default_factory=dict)

    def keep_unrolled(self, loops) -> None:
        for loop in loops:
            if not loop.rolled and loop.why:
                self.unrolled.setdefault(loop.site, loop)

    def __post_init__(self):
        self.builtins = _builtins_of(self.target.globals)


def _builtins_of(globals_: dict) -> dict:
    b = globals_.get("__builtins__", builtins)
    return b.__dict__ if isinstance(b, types.ModuleType) else b


# Taken by whatever changes a state's entries outside the hot path (capture, demotion,
# reset): the hot path only reads ``state.entries``.
LOCK = threading.RLock()
_STATES: dict[int, CodeState] = {}  # shared states: target key -> state
_OWNED: "weakref.WeakSet[CodeState]" = weakref.WeakSet()  # states of optimized objects


def new_state(target, backend: str | None = None, exact: bool = False) -> CodeState:
    """A cache of its own for one optimized object (function wrapper or module instance);
    frames reached only through the frame hook share one state per code object."""
    if backend is not None:
        get_backend(backend)  # fail early on a bad name
    state = CodeState(target, backend or config.backend, exact=exact)
    _OWNED.add(state)
    return state


def state_for(target, backend: str | None = None) -> CodeState:
    """The shared state of ``target`` (made on first use)."""
    state = _STATES.get(target.key)
    if state is None or state.target is not target:
        with LOCK:
            state = _STATES.get(target.key)
            if state is None or state.target is not target:
                state = _STATES[target.key] = CodeState(target, backend or config.backend)
    if backend is not None:
        get_backend(backend)  # fail early on a bad name
        state.backend = backend
    return state


def states() -> dict[int, CodeState]:
    """The shared states (code reached through the frame hook), by target key (a copy)."""
    return dict(_STATES)


def all_states() -> list[CodeState]:
    """Every state: the shared ones, then those of objects given to ``optimize`` still alive."""
    return [*_STATES.values(), *list(_OWNED)]


def reset() -> None:
    """Forget graphs, records and stats; keep each state's target and chosen backend."""
    with LOCK:
        for state in all_states():
            fresh = CodeState(state.target, state.backend, exact=state.exact)
            state.__dict__.update(fresh.__dict__)
        log.forget_warnings()
