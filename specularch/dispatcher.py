"""The dispatcher: for each intercepted call, find a graph whose guards pass, or capture a
new one, or run the original Python — and record why.

Per code object (``CodeState``) it keeps, bounded by ``config.cache_limit``:
* graph entries (guards + compiled graph + output rebuild, one generated function each),
* eager entries: the guards of captures that failed, so calls on the same path run the
  original Python at once instead of failing to capture again,
* statistics, fallback records (deduplicated) and recompile records.
"""
from __future__ import annotations

import builtins
import threading
import weakref
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import distributed, frames, log
from .config import config
from .eager_run import EagerRun, locked_entry
from .entry import MISS, AssumptionFailed, build_entry
from .fx_lower import get_backend
from .fx_lower.randomness import graph_uses_randomness
from .guards import GuardSet
from .guards.guard import refers_to_dead
from .guards.relax import Generalisation, fact
from .records import (FALLBACK_KINDS, FallbackRecord, RecompileRecord, SpecularchStrictError,
                      Unsupported)
from .symbolic.speculation import branch_merge, budget
from .symbolic import exceptions
from .symbolic.assumptions import Assumptions
from .symbolic.capture import Capture, capture
from .symbolic.values import RelaxationRefused


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

    def __str__(self) -> str:
        return (f"calls={self.calls} graph_hits={self.graph_hits} captures={self.captures} "
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

    def __post_init__(self):
        self.builtins = _builtins_of(self.target.globals)


VALUE_DEPENDENT_RETRIES = 8  # captures failing on tensor values before the path stays eager
_STATES: dict[int, CodeState] = {}
_LOCK = threading.RLock()


_OWNED: "weakref.WeakSet[CodeState]" = weakref.WeakSet()  # states of optimized objects


def new_state(target, backend: str | None = None) -> CodeState:
    """A cache of its own for one optimized object (function wrapper or module instance);
    frames reached only through the frame hook share one state per code object."""
    if backend is not None:
        get_backend(backend)  # fail early on a bad name
    state = CodeState(target, backend or config.backend)
    _OWNED.add(state)
    return state


def state_for(target, backend: str | None = None) -> CodeState:
    state = _STATES.get(target.key)
    if state is None or state.target is not target:
        with _LOCK:
            state = _STATES.get(target.key)
            if state is None or state.target is not target:
                state = _STATES[target.key] = CodeState(target, backend or config.backend)
    if backend is not None:
        get_backend(backend)  # fail early on a bad name
        state.backend = backend
    return state


def states() -> dict[int, CodeState]:
    return _STATES


def reset() -> None:
    """Forget graphs, records and stats; keep each state's target and chosen backend."""
    with _LOCK:
        for state in [*_STATES.values(), *list(_OWNED)]:
            fresh = CodeState(state.target, state.backend)
            state.__dict__.update(fresh.__dict__)
        log.forget_warnings()


def note_generator(state: CodeState) -> None:
    """An optimized generator function was called: it always runs eagerly; say so."""
    target = state.target
    state.stats.calls += 1
    state.stats.fallback_calls += 1
    record = _remember(state, FallbackRecord(
        "generator", f"{target.name} is a generator function; generators run eagerly",
        FALLBACK_KINDS["generator"][1], target.filename, target.firstlineno, target.name))
    record.count += 1
    if config.strict:
        raise SpecularchStrictError(f"specularch strict mode: {target.name} falls back.\n{record}")


def _builtins_of(globals_: dict) -> dict:
    b = globals_.get("__builtins__", builtins)
    return b.__dict__ if isinstance(b, types.ModuleType) else b


# ``nn.Module`` forwards optimized per instance (``optimize(module)``): target key ->
# ``resolve(module) -> CodeState | None`` (None: that instance was not optimized).
_PER_INSTANCE: dict[int, Callable] = {}


def per_instance(target, resolve: Callable) -> None:
    _PER_INSTANCE[target.key] = resolve


# Targets of the global switch optimized only at some of their calls (a module forward: its
# outermost calls, see specularch/frames/policy.py): target key -> ``handler(target, slots, cells)``, which
# takes the whole call.
_PER_CALL_SITE: dict[int, Callable] = {}


def per_call_site(target, handler: Callable) -> None:
    _PER_CALL_SITE[target.key] = handler


def dispatch(target, slots: tuple, cells: tuple | None) -> Any:
    """Called by trampolines (frames reached through the hook) for every call of ``target``."""
    # A call that runs the original returns an ``EagerRun`` for the trampoline to run in
    # its own frame (``frames.set_run_here``): recursion through the hook keeps eager's depth.
    resolve = _PER_INSTANCE.get(target.key)
    if resolve is not None:
        state = resolve(slots[0]) if slots else None
        if state is not None:
            return start(state, slots, cells)
        if not frames.auto_targeting():  # another instance of an optimized module's class
            return EagerRun(None, target, cells)
    handler = _PER_CALL_SITE.get(target.key)
    if handler is not None:
        return handler(target, slots, cells)
    state = _STATES.get(target.key)
    if state is None or state.target is not target:
        state = state_for(target)
    return start(state, slots, cells)


# Set by the pytest plugin's compare mode: ``validator(state, slots, cells, run_fn)``.
VALIDATOR = None


def run(state: CodeState, slots: tuple, cells: tuple | None) -> Any:
    """One call of ``state.target``: a cached graph, a capture, or the original Python."""
    if VALIDATOR is not None:
        return VALIDATOR(state, slots, cells, _run)
    return _run(state, slots, cells)


def start(state: CodeState, slots: tuple, cells: tuple | None) -> Any:
    """``run``, except that a call whose path runs eagerly returns an ``EagerRun``: the
    caller runs the original in its own frame (see ``eager_run``)."""
    if VALIDATOR is not None:
        return VALIDATOR(state, slots, cells, _run)
    return _start(state, slots, cells)


def _run(state: CodeState, slots: tuple, cells: tuple | None) -> Any:
    result = _start(state, slots, cells)
    if type(result) is EagerRun:
        return result.run(state.target.call_original, slots, cells)
    return result


def _start(state: CodeState, slots: tuple, cells: tuple | None) -> Any:
    target = state.target
    stats = state.stats
    stats.calls += 1
    G = target.globals
    B = state.builtins
    for entry in state.entries:
        result = _try_entry(state, entry, slots, cells, G, B)
        if result is not MISS:
            return result
    if state.disabled is not None:
        return _defer_eager(state, slots, cells, state.disabled)
    for eager in state.eager:
        if eager.check(slots, cells, G, B):
            return _defer_eager(state, slots, cells, eager.record, eager.reaches_backward)
    if not state.entries and state.stats.profiled_calls < config.profile_calls \
            and not distributed.active():  # ranks must not run unaveraged eager steps
        return _profile_call(state, slots, cells)
    return _miss(state, slots, cells, G, B)


def _profile_call(state: CodeState, slots, cells) -> Any:
    """One of the first calls: run eagerly, remember what the arguments looked like."""
    state.stats.profiled_calls += 1
    state.profile.append(tuple(fact(v) for v in slots))
    start = time.perf_counter()
    with frames.hook_active():
        result = state.target.call_original(slots, cells)
    state.eager_seconds.append(time.perf_counter() - start)  # what a capture may cost
    return result


def _assumption_failed(state: CodeState, entry: GraphEntry, failure: AssumptionFailed,
                       slots, cells) -> Any:
    torch.set_grad_enabled(entry.grad_enabled)
    with _LOCK:
        if entry in state.entries:
            state.entries.remove(entry)
        state.unstable_sites.add(failure.site)
        state.stats.assumption_failures += 1
        if failure.site[0] in ("specialize", "compare"):  # a size of an intermediate tensor
            state.general.sizes_steer_python(failure.where)
    filename, _, line = failure.where.rpartition(":")
    error = Unsupported("assumption_failed", failure.explanation())
    error.filename, error.lineno, error.function = filename, int(line or 0), state.target.name
    return _fallback(state, slots, cells, error)


def _miss(state: CodeState, slots, cells, G, B) -> Any:
    target = state.target
    with _LOCK:
        _drop_dead(state)
        for entry in state.entries:  # another thread may have captured while we waited
            result = _try_entry(state, entry, slots, cells, G, B)
            if result is not MISS:
                return result
        if state.profile:  # first capture after profiling: generalise what varied
            state.general.from_profile(target.argnames,
                                       state.profile + [tuple(fact(v) for v in slots)])
            state.profile = []
        if state.entries:
            why = _relax(state, slots, cells, G, B)
            if len(state.entries) >= config.cache_limit:
                return _fallback(state, slots, cells, Unsupported(
                    "cache_limit", f"{target.name} already has {len(state.entries)} graphs "
                    f"(config.cache_limit); last guard failure: {why}"), at_def=True)
            if config.strict:
                raise SpecularchStrictError(f"specularch strict mode: {target.name} would "
                                            f"recompile: {why}")
            state.recompiles.append(RecompileRecord(target.name, [why]))
            log.emit("recompiles", str(state.recompiles[-1]))
            state.stats.recompiles += 1
        distributed.eager.start_capture()
        try:
            with budget.eager_cost(state.eager_seconds):  # gives up on long loops early
                cap = _capture_with_relaxations(state, slots, cells, G)
        except Unsupported as e:
            return _fallback(state, slots, cells, e,
                             reaches_backward=distributed.eager.capture_reached_backward())
        except Exception as e:  # a bug in specularch: stay correct, say so
            if config.raise_internal_errors:
                raise
            return _fallback(state, slots, cells, Unsupported(
                "internal_error", f"capture failed with {type(e).__name__}: {e}"), at_def=True,
                reaches_backward=distributed.eager.capture_reached_backward())
        state.stats.captures += 1
        state.stats.capture_seconds += cap.seconds
        named = (distributed.broadcast.step_state(cap, slots, cells, G, B)
                 if cap.distributed_leaves else [])
        buffers = [t for _, t in named if not isinstance(t, torch.nn.Parameter)
                   and not any(t is leaf for leaf in cap.distributed_leaves)]
        try:
            entry = _compile(state, cap, buffers=buffers)
        except Exception as e:
            return _fallback(state, slots, cells, Unsupported(
                "backend_error", f"backend {state.backend!r} failed: {type(e).__name__}: {e}"),
                at_def=True, reaches_backward=bool(cap.distributed_leaves))
        if named:
            _start_from_rank0(state, named)
        state.entries.insert(0, entry)
    result = _try_entry(state, entry, slots, cells, G, B, count_hit=False)
    if result is MISS:  # the fast C++ tensor check disagrees with torch's own: use Python's
        state.entries.remove(entry)
        entry = _compile(state, cap, fast_tensors=False, buffers=buffers)
        state.entries.insert(0, entry)
        result = _try_entry(state, entry, slots, cells, G, B, count_hit=False)
    if result is MISS:  # the guards we just built reject the call they came from: a bug
        state.entries.remove(entry)
        return _fallback(state, slots, cells, Unsupported(
            "internal_error", "a fresh graph's guards rejected the call it was captured from"),
            at_def=True, reaches_backward=bool(cap.distributed_leaves))
    return result


def _drop_dead(state: CodeState) -> None:
    """Forget graphs and eager paths whose guards hold an object that was freed (guards hold
    objects weakly): they never pass again, and must not count towards ``cache_limit``."""
    state.entries[:] = [e for e in state.entries if not refers_to_dead(e.capture.guards)]
    state.eager[:] = [e for e in state.eager if not refers_to_dead(e.guards)]


def _relax(state: CodeState, slots, cells, G, B) -> str:
    """No graph fits this call: relax every assumption of the newest graph that this call
    breaks and that can be generalised (not only the first: a call that changes a key *and*
    a counter must not cost one graph per counter value). Graphs that specialised on what was
    relaxed are dropped; the next capture covers them. Returns the recompile reason."""
    failing = list(state.entries[0].capture.guards.failing(slots, cells, G, B))
    if not failing:
        return "no cached graph's guards passed"
    general = state.general
    before = len(general.relaxations)
    relaxed = {g.key() for g, value, _ in failing if general.from_guard_failure(g, value)}
    why = failing[0][2]
    if relaxed:
        state.entries[:] = [e for i, e in enumerate(state.entries)
                            if i and not any(g.key() in relaxed for g in e.capture.guards)]
        why = f"{why}; relaxed: " + "; ".join(general.relaxations[before:])
    return why


def _try_entry(state: CodeState, entry: GraphEntry, slots, cells, G, B,
               count_hit: bool = True) -> Any:
    """The call's result through ``entry``, or MISS when its guards do not pass. A graph that
    raises, or whose assumption fails, leads to the original Python (nothing committed)."""
    try:
        result = entry.fn(slots, cells, G, B)
    except Exception as e:  # (the entry put the grad mode back: see entry.py)
        return _graph_raised(state, entry, e, slots, cells, G, B, count_hit)
    if result is MISS:
        return MISS
    if type(result) is AssumptionFailed:
        return _assumption_failed(state, entry, result, slots, cells)
    entry.hits += 1
    state.stats.graph_hits += count_hit
    return result


def _graph_raised(state: CodeState, entry: GraphEntry, error: Exception, slots, cells, G, B,
                  count_hit: bool = True) -> Any:
    """A compiling backend that fails at run time is replaced by ``fx`` for this graph; an
    ``fx`` graph that raises (eager would raise too, e.g. an index out of range) falls back."""
    step = bool(entry.capture.distributed_leaves) and distributed.active()
    if step and (distributed.agreement.header_issued()
                 or isinstance(error, distributed.DistributedStepError)):
        return _distributed_graph_raised(state, entry, error, slots, cells)
    if entry.backend != "fx" and entry in state.entries:  # (a step had sent nothing yet)
        with _LOCK:
            index = state.entries.index(entry)
            replacement = _compile(state, entry.capture, backend_name="fx",
                                   note=f"backend {entry.backend!r} raised at run time "
                                        f"({type(error).__name__}); ran it with 'fx'")
            state.entries[index] = replacement
        return _try_entry(state, replacement, slots, cells, G, B, count_hit)
    if step:
        return _distributed_graph_raised(state, entry, error, slots, cells)
    # Run the original first to tell the user's own error (eager raises too: the graph only
    # met it first, e.g. an index out of range) from a bug of ours (eager does not raise).
    what = f"the compiled graph raised {type(error).__name__}: {error}"
    if config.strict:
        raise SpecularchStrictError(f"specularch strict mode: {state.target.name}: {what}")
    try:
        with frames.hook_active():
            result = state.target.call_original(slots, cells)
    except Exception as eager_error:
        failure = Unsupported("exception_handling",
                              f"{what}; the original code raises {type(eager_error).__name__} "
                              f"too (the call ran eagerly and raised it)")
        outcome = eager_error
    else:
        failure, outcome = _eager_did_not_raise(entry, error, what), None
    record = _note_fallback(state, failure, at_def=True, ran=True)
    if outcome is not None:
        raise outcome
    log.warn_fallback(record)
    return result


def _eager_did_not_raise(entry: GraphEntry, error: Exception, what: str) -> Unsupported:
    """A graph raised where the original code does not: an op on the side of a merged
    tensor branch that this call does not take (the graph computes both sides), an op under
    a try the code handles, or else a bug of ours (``backend_error``)."""
    graphs = [entry.capture.graph_module, getattr(entry.graph_fn, "__self__", None)]
    side = branch_merge.side_not_taken(error, graphs)
    if side is None:
        return exceptions.eager_did_not_raise(error, graphs, what)
    (filename, lineno, function), op_at = side
    failure = Unsupported(
        "data_dependent_branch",
        f"the branch on a tensor value at {filename}:{lineno} is captured with both sides "
        f"(selected with torch.where); the side this call does not take raised "
        f"{type(error).__name__}: {error} (at {op_at or 'an op of that side'}), where eager "
        f"never runs it; the call ran eagerly and returned eager's result",
        "Make that side valid for every input (clamp the index, avoid a zero divisor) or "
        "select with torch.where yourself; results are correct either way, only slower.")
    failure.filename, failure.lineno, failure.function = filename, lineno, function
    return failure


def _distributed_graph_raised(state: CodeState, entry: GraphEntry, error: Exception,
                              slots, cells) -> Any:
    """A distributed step's graph raised. Before its header was sent, the other ranks wait for
    this rank: run the original (an error of the user's code raises again and the other ranks
    are told; an eager ``backward()`` is refused). After it, only this rank knows: say so."""
    agreement = distributed.agreement
    if isinstance(error, agreement.DistributedStepError):  # every rank raises it
        raise error
    what = f"the compiled graph raised {type(error).__name__}: {error}"
    if agreement.header_issued():
        raise agreement.DistributedStepError(
            f"specularch: distributed training step {state.target.name}: {what} after the "
            f"gradients were exchanged; nothing was committed on this rank (rank "
            f"{agreement.rank()}), but the other ranks may have finished this step: stop "
            f"training.") from error
    record = _note_fallback(state, Unsupported("exception_handling", what), at_def=True)
    _run_eager(state, slots, cells, record)  # the user's error: raised, others told
    raise agreement.refuse(state.target.name, "backend_error",
                           f"{what}, but the original code does not")


def _start_from_rank0(state: CodeState, named: list) -> None:
    """Before a distributed step's new graph first runs: if it reads parameters or buffers
    this step never broadcast, every rank agrees (all captured the same step), then rank 0's
    values are broadcast. Otherwise nothing is sent here: the graph's own header agrees."""
    sent = state.broadcast
    new = [(path, t) for path, t in named
           if sent.get(id(t)) is None or sent[id(t)]() is not t]
    if not new:
        return
    header = distributed.agreement.Header(
        state.target.name, phase=distributed.agreement.Header.BROADCAST,
        digest=distributed.agreement.layout_hash([(p, tuple(t.shape), str(t.dtype))
                                                  for p, t in new]))
    if header.verdict() is not None:
        raise header.verdict()
    distributed.broadcast.from_rank0([t for _, t in new])
    for _, t in new:
        sent[id(t)] = weakref.ref(t)


def _capture_with_relaxations(state: CodeState, slots, cells, G) -> Capture:
    """Capture with what profiling/relaxation generalised; if the code turns out to read
    something a relaxation stopped tracking, undo that relaxation and capture again."""
    general = state.general
    for _ in range(4 + len(general.append_only) + len(general.keyed_dicts)):
        try:
            assumptions = Assumptions(  # a snapshot: a refused relaxation changes `general`
                unstable_sites=state.unstable_sites, dynamic_dims=general.dynamic_dims,
                symbolic_scalars=general.symbolic_scalars,
                symbolic_sources=general.symbolic_sources,
                append_only=general.append_only, keyed_dicts=general.keyed_dicts)
            return capture(state.target.code, G, state.target.argnames, slots, cells, assumptions,
                           max_instructions=config.max_instructions,
                           inline_depth=config.inline_depth)
        except RelaxationRefused as refused:
            general.refuse(refused.source)
    raise Unsupported("internal_error", "relaxations kept being refused while capturing")


def _compile(state: CodeState, cap: Capture, fast_tensors: bool = True,
             backend_name: str | None = None, note: str = "", buffers: list = ()) -> GraphEntry:
    start = time.perf_counter()
    gm = cap.graph_module
    backend = get_backend(backend_name or state.backend)
    reason = backend.supports(gm)
    if reason:
        note = f"backend {backend.name!r} not used: {reason}; ran it with 'fx'"
        backend = get_backend("fx")
    example_inputs = [n.meta.get("example") for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        graph_fn = backend.compile(gm, example_inputs)
    except Exception as e:
        if backend.name == "fx":
            raise
        note = f"backend {backend.name!r} failed ({type(e).__name__}: {e}); ran it with 'fx'"
        backend = get_backend("fx")
        graph_fn = backend.compile(gm, example_inputs)
    fn, text = build_entry(cap.guards, cap.input_sources, cap.output, graph_fn, fast_tensors,
                           cap.writes, cap.assertions, graph_uses_randomness(cap.graph_module))
    if cap.distributed_leaves:
        fn = _distributed_entry(fn, list(buffers))
    if cap.writes:  # guards to commit atomic for threads sharing what it writes
        fn = locked_entry(fn)
    seconds = time.perf_counter() - start
    state.stats.compile_seconds += seconds
    grad = next((g.grad_enabled for g in cap.guards if hasattr(g, "grad_enabled")), True)
    if note and note not in state.notes:
        state.notes.append(note)
    log.emit("graphs", f"{state.target.name} ({backend.name}{'; ' + note if note else ''}):\n"
             f"{cap.code}")
    log.emit("guards", f"{state.target.name}:\n  " + "\n  ".join(cap.guards.readable()))
    return GraphEntry(cap, backend.name, fn, text, grad, seconds, note=note, graph_fn=graph_fn)


def _distributed_entry(fn: Callable, buffers: list) -> Callable:
    """A distributed step's entry: each call starts without its header sent; after a step
    that ran, every rank takes rank 0's buffers (DDP's ``broadcast_buffers``)."""
    reset = distributed.agreement.reset_call
    sync = distributed.broadcast.sync_buffers
    digest = distributed.agreement.layout_hash([(tuple(b.shape), str(b.dtype)) for b in buffers])

    def entry(slots, cells, G, B):
        reset(digest)
        result = fn(slots, cells, G, B)
        if buffers and result is not MISS:
            sync(buffers)
        return result
    return entry


def _fallback(state: CodeState, slots, cells, error: Unsupported, *, at_def: bool = False,
              reaches_backward: bool = False) -> Any:
    record = _note_fallback(state, error, at_def=at_def, reaches_backward=reaches_backward)
    return _run_eager(state, slots, cells, record, reaches_backward=reaches_backward)


def _note_fallback(state: CodeState, error: Unsupported, *, at_def: bool = False,
                   ran: bool = False, reaches_backward: bool = False) -> FallbackRecord:
    """Record a fallback (and the eager entry for its path); ``ran``: the eager run already
    happened (it is counted here)."""
    target = state.target
    if at_def or error.filename is None:
        error.filename = error.filename or target.filename
        error.lineno = error.lineno or target.firstlineno
        error.function = error.function or target.name
    record = _remember(state, error.record())
    guards = getattr(error, "guards", None)
    if error.kind == "cache_limit":
        state.disabled = record
    elif guards is not None and not _retry_later(state, error):
        if len(state.eager) >= config.cache_limit:
            state.disabled = record
        else:
            state.eager.insert(0, EagerEntry(guards.compile(), guards, record, reaches_backward))
    if ran:
        state.stats.fallback_calls += 1
        record.count += 1
    return record


def _retry_later(state: CodeState, error: Unsupported) -> bool:
    """Whether to leave a failed capture's path without an eager entry: its failure depends
    on tensor values the guards do not see (``x[idx]`` raised for this ``idx``; a ``raise``
    under ``if x.sum() < 0:``), so the next call with other values may be capturable. After
    ``VALUE_DEPENDENT_RETRIES`` such failures the path is remembered as eager like any other."""
    if not error.value_dependent or state.value_dependent_failures >= VALUE_DEPENDENT_RETRIES:
        return False
    state.value_dependent_failures += 1
    return True


def _remember(state: CodeState, record: FallbackRecord) -> FallbackRecord:
    """The stored record equal to ``record`` (or ``record``, now stored). Its ``count`` is
    the calls that ran eagerly for it: whoever runs (or ran) the call adds one."""
    key = (record.kind, record.filename, record.lineno, record.explanation)
    existing = state.fallbacks.get(key)
    if existing is not None:
        return existing
    record.count = 0
    if len(state.fallbacks) < config.max_fallback_records:
        state.fallbacks[key] = record
    log.emit("fallbacks", str(record))
    return record


def _defer_eager(state: CodeState, slots, cells, record: FallbackRecord,
                 reaches_backward: bool = False) -> Any:
    """A path remembered as eager: an ``EagerRun`` for the caller to run (its frames are what
    a recursive function that runs eagerly nests per level), or, where the run needs more
    than the frame hook (strict mode, torch.distributed), the result of ``_run_eager``."""
    if config.strict or distributed.active():
        return _run_eager(state, slots, cells, record, reaches_backward)
    record.count += 1
    state.stats.fallback_calls += 1
    return EagerRun(record, state.target, cells)


def _run_eager(state: CodeState, slots, cells, record: FallbackRecord,
               reaches_backward: bool = False) -> Any:
    if config.strict:
        if distributed.active() and (reaches_backward or _is_distributed_step(state)):
            distributed.agreement.reset_call()  # the other ranks wait for this step's header
            distributed.agreement.refuse(state.target.name, record.kind, record.explanation)
        raise SpecularchStrictError(f"specularch strict mode: {state.target.name} would fall back "
                                    f"to eager.\n{record}") from None  # the record says why
    record.count += 1
    state.stats.fallback_calls += 1
    if distributed.active():
        result = _run_eager_distributed(state, slots, cells, record, reaches_backward)
    else:
        with frames.hook_active():
            result = state.target.call_original(slots, cells)
    log.warn_fallback(record)  # a call that returned without its graph (not one that raised)
    return result


def _run_eager_distributed(state: CodeState, slots, cells, record: FallbackRecord,
                           reaches_backward: bool) -> Any:
    """The original Python while ``torch.distributed`` is active: an eager ``backward()``
    would not average gradients over ranks, so it is refused (the other ranks are told) unless
    DDP averages it; a distributed step that raises tells the other ranks too."""
    agreement = distributed.agreement
    why = f"{record.explanation} ({record.location})"
    agreement.reset_call()
    if reaches_backward:  # known from its capture: stop before running anything
        raise agreement.refuse(state.target.name, record.kind, why)
    try:
        with frames.hook_active(), distributed.eager.WatchBackward(state.target.name,
                                                                   record.kind, why):
            return state.target.call_original(slots, cells)
    except agreement.DistributedStepError:
        raise
    except Exception as e:
        if _is_distributed_step(state):  # the other ranks wait for this step's header
            agreement.refuse(state.target.name, "error", f"{type(e).__name__}: {e}")
        raise


def _is_distributed_step(state: CodeState) -> bool:
    return bool(state.broadcast) or any(e.capture.distributed_leaves for e in state.entries) \
        or any(e.reaches_backward for e in state.eager)


frames.set_dispatcher(dispatch)
