"""No cached graph fits a call: profile it, relax what varied, capture and compile anew.

The first ``config.profile_calls`` calls run eagerly and record what their arguments looked
like; the first capture after them generalises what varied (``relax.py``). Later misses relax
what the newest graph's failing guards assumed, then capture again — a *recompile*, recorded
with its reason — until the object has ``config.cache_limit`` graphs: then it is disabled
(``state.disabled``, which the hot path checks) and runs eagerly. A compiling backend that
refuses or fails on a graph, at compile time or at run time, is replaced by ``fx`` for it.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import time
from typing import Any, Callable

import torch

from .. import _glibc_malloc, log, tiering
from ..config import config
from ..eager_run import FRAME_HOOK, locked_entry
from ..entry_function import MISS, build_entry_function
from ..fx_lower.randomness import graph_uses_randomness
from ..fx_lower import get_backend
from ..fx_lower.passes import example_inputs
from ..guards import draws
from ..guards.guard import TensorGuard, refers_to_dead
from ..guards.sources import LocalSource
from ..records import RecompileRecord, SpecularchStrictError, Unsupported
from ..shadow_heap import CommitRefused
from ..guards.relax import argument_fact
from ..symbolic import budget
from ..symbolic.assumptions import Assumptions
from ..symbolic.capture import Capture, capture
from ..symbolic.values import RelaxationRefused
from . import exact, hooks
from .fallback import fallback
from .state import LOCK, CodeState, GraphEntry


def profile_call(state: CodeState, slots, cells) -> Any:
    """One of the first calls: run eagerly, remember what the arguments looked like."""
    state.stats.profiled_calls += 1
    state.profile.append(tuple(argument_fact(v) for v in slots))
    draws.rewind()
    start = time.perf_counter()
    with FRAME_HOOK.active():
        result = state.target.call_original(slots, cells)
    state.eager_seconds.append(time.perf_counter() - start)  # what a capture may cost
    return result


def miss(state: CodeState, slots, cells, globals_, builtins_, try_entry: Callable) -> Any:
    """The call's result after no graph's guards passed: a new graph's, or the original's.
    ``try_entry`` is the hot path's (``cache.try_entry``), handed in so that this module
    does not import the one that imports it."""
    with draws.call(reuse=True) as call:
        try:
            return _miss(state, slots, cells, globals_, builtins_, try_entry)
        finally:
            if call.start is not None:  # (a capture that failed after drawing too: its eager
                state.draws = True      # entry's guards read the draws)


def _miss(state: CodeState, slots, cells, globals_, builtins_, try_entry: Callable) -> Any:
    with LOCK:
        drop_dead(state)
        for entry in state.entries:  # another thread may have captured while we waited
            result = try_entry(state, entry, slots, cells, globals_, builtins_)
            if result is not MISS:
                return result
        if state.profile:  # first capture after profiling: generalise what varied
            state.general.from_profile(state.target.argnames,
                                       state.profile + [tuple(argument_fact(v) for v in slots)])
            state.profile = []
        if state.entries:
            full = _recompile(state, slots, cells, globals_, builtins_)
            if full is not None:
                return fallback(state, slots, cells, full, at_def=True)
        hooks.distributed.start_capture()
        # (the original runs after the ``except`` blocks, not in them: see cache.try_entry)
        failed, internal = None, False
        try:
            # eager_cost: gives up on long loops early
            with budget.eager_cost(state.eager_seconds), gc_paused(), exact.capturing(state):
                cap = capture_with_relaxations(state, slots, cells, globals_)
        except Unsupported as e:
            state.keep_unrolled(getattr(e, "unrolled_loops", ()))
            failed = e
        except Exception as e:  # a bug in specularch: stay correct, say so
            if config.raise_internal_errors:
                raise
            failed, internal = Unsupported(
                "internal_error", f"capture failed with {type(e).__name__}: {e}"), True
        if failed is not None:
            return fallback(state, slots, cells, failed, at_def=internal,
                            reaches_backward=hooks.distributed.capture_reached_backward())
        state.stats.captures += 1
        state.stats.capture_seconds += cap.seconds
        if cap.draws:  # its first run settles the generator (cache.try_entry)
            state.draws = True
        named = (hooks.distributed.step_state(cap, slots, cells, globals_, builtins_)
                 if cap.distributed_leaves else [])
        buffers = [t for _, t in named if not isinstance(t, torch.nn.Parameter)
                   and not any(t is leaf for leaf in cap.distributed_leaves)]
        failed = None
        try:
            with gc_paused(tiering.first_tier(state.backend) == "fx"):
                entry = compile_entry(state, cap, buffers=buffers)
        except Exception as e:
            failed = Unsupported("backend_error",
                                 f"backend {state.backend!r} failed: {type(e).__name__}: {e}")
        if failed is not None:
            return fallback(state, slots, cells, failed, at_def=True,
                            reaches_backward=bool(cap.distributed_leaves))
        if named:
            hooks.distributed.start_from_rank0(state, named)
        cap.guards.measure(slots, cells, globals_, builtins_)  # explain()'s guard µs
        state.entries.insert(0, entry)
    return _first_run(state, entry, buffers, slots, cells, globals_, builtins_, try_entry)


@contextlib.contextmanager
def gc_paused(pause: bool = True):
    """No automatic garbage collection inside (unless ``pause`` is False): capture and the
    ``fx`` backend allocate many small objects (values, nodes, meta tensors), so a
    collection starts again and again and walks everything alive, a large model and the
    graph being built included; 15-20% of a large capture went there. What they leave in
    cycles is collected at the next collection after. Not around compiling backends, whose
    allocations (Inductor's) are too large to leave uncollected."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _recompile(state: CodeState, slots, cells, globals_, builtins_) -> Unsupported | None:
    """Before capturing next to existing graphs: relax, then record the recompile, or return
    the ``cache_limit`` failure when the object has as many graphs as it may."""
    target = state.target
    why = relax(state, slots, cells, globals_, builtins_)
    if len(state.entries) >= config.cache_limit:
        return Unsupported("cache_limit", f"{target.name} already has {len(state.entries)} "
                           f"graphs (config.cache_limit); last guard failure: {why}")
    if config.strict:
        raise SpecularchStrictError(f"specularch strict mode: {target.name} would "
                                    f"recompile: {why}")
    state.recompiles.append(RecompileRecord(target.name, [why]))
    log.emit("recompiles", str(state.recompiles[-1]))
    state.stats.recompiles += 1
    return None


def _first_run(state: CodeState, entry: GraphEntry, buffers: list, slots, cells, globals_, builtins_,
               try_entry: Callable) -> Any:
    """A fresh graph's first call: the one it was captured from, so its guards must pass."""
    cap = entry.capture
    result = try_entry(state, entry, slots, cells, globals_, builtins_, count_hit=False)
    if result is MISS:  # the fast C++ tensor check disagrees with torch's own: use Python's
        state.entries.remove(entry)
        entry = compile_entry(state, cap, fast_tensors=False, buffers=buffers)
        state.entries.insert(0, entry)
        result = try_entry(state, entry, slots, cells, globals_, builtins_, count_hit=False)
    if result is MISS:  # the guards we just built reject the call they came from: a bug
        state.entries.remove(entry)
        return fallback(state, slots, cells, Unsupported(
            "internal_error", "a fresh graph's guards rejected the call it was captured from"),
            at_def=True, reaches_backward=bool(cap.distributed_leaves))
    return result


def drop_dead(state: CodeState) -> None:
    """Forget graphs and eager paths whose guards hold an object that was freed (guards hold
    objects weakly): they never pass again, and must not count towards ``cache_limit``."""
    state.entries[:] = [e for e in state.entries if not refers_to_dead(e.capture.guards)]
    state.eager[:] = [e for e in state.eager if not refers_to_dead(e.guards)]


def relax(state: CodeState, slots, cells, globals_, builtins_) -> str:
    """No graph fits this call: relax every assumption of the newest graph that this call
    breaks and that can be generalised (not only the first: a call that changes a key *and*
    a counter must not cost one graph per counter value). Graphs that specialised on what was
    relaxed are dropped; the next capture covers them. Returns the recompile reason."""
    failing = list(state.entries[0].capture.guards.failing(slots, cells, globals_, builtins_))
    if not failing:
        return "no cached graph's guards passed"
    general = state.general
    before = len(general.relaxations)
    relaxed = {g.key() for g, value, _ in failing if general.from_guard_failure(g, value)}
    why = failing[0][2]
    if any(isinstance(g, TensorGuard) and g.key() in relaxed for g, _, _ in failing):
        # sizes made dynamic: compiles trace them at the sizes of the call this graph was
        # captured from (every slot of one call), not at this call's (a short last batch)
        general.hint_sizes({g.source.index: g.shape for g in state.entries[0].capture.guards
                            if isinstance(g, TensorGuard) and isinstance(g.source, LocalSource)})
    if relaxed:
        state.entries[:] = [e for i, e in enumerate(state.entries)
                            if i and not any(g.key() in relaxed for g in e.capture.guards)]
        why = f"{why}; relaxed: " + "; ".join(general.relaxations[before:])
    return why


def capture_with_relaxations(state: CodeState, slots, cells, globals_) -> Capture:
    """Capture with what profiling/relaxation generalised; if the code turns out to read
    something a relaxation stopped tracking, undo that relaxation and capture again."""
    general = state.general
    for _ in range(4 + len(general.append_only) + len(general.keyed_dicts)):
        try:
            assumptions = Assumptions(  # a snapshot: a refused relaxation changes `general`
                unstable_sites=state.unstable_sites, dynamic_dims=general.dynamic_dims,
                dynamic_sources=general.dynamic_sources,
                symbolic_scalars=general.symbolic_scalars,
                symbolic_sources=general.symbolic_sources,
                append_only=general.append_only, keyed_dicts=general.keyed_dicts,
                varied_lists=general.varied_lists,
                exact_loops=config.templates == "exact",
                fold_fixed_sizes=state.backend != "fx" and not state.exact,
                size_hints=general.size_hints)
            return capture(state.target.code, globals_, state.target.argnames, slots, cells, assumptions,
                           max_instructions=config.max_instructions,
                           inline_depth=config.inline_depth)
        except RelaxationRefused as refused:
            general.refuse(refused.source)
    raise Unsupported("internal_error", "relaxations kept being refused while capturing")


def fx_instead(state: CodeState, entry: GraphEntry, error: Exception) -> GraphEntry | None:
    """A graph of a compiling backend raised ``error`` at run time: the entry that replaces
    it, with the same capture run by ``fx`` (None: ``fx`` raised, or the graph is gone, or a
    distributed step got too far to be run again)."""
    if entry.capture.distributed_leaves and hooks.distributed.active() \
            and hooks.distributed.graph_raised_late(error):
        return None
    if entry.backend == "fx" or entry not in state.entries or isinstance(error, CommitRefused):
        return None  # (a refused commit is no backend's fault)
    with LOCK:
        index = state.entries.index(entry)
        replacement = compile_entry(state, entry.capture, backend_name="fx",
                                    note=f"backend {entry.backend!r} raised at run time "
                                         f"({type(error).__name__}); ran it with 'fx'")
        tiering.ran_back_to_fx(entry, replacement, error)
        state.entries[index] = replacement
    return replacement


def compile_entry(state: CodeState, cap: Capture, fast_tensors: bool = True,
                  backend_name: str | None = None, note: str = "",
                  buffers: list = ()) -> GraphEntry:
    """Compile ``cap`` with the state's backend (``fx`` where that refuses or fails) and
    wrap it in its generated entry: guards, graph call, assertions, commit, rebuild."""
    start = time.perf_counter()
    graph_fn, backend, note = _backend_compile(
        state, cap.graph_module, backend_name or tiering.first_tier(state.backend), note)
    built: dict = {}  # the capture's generated entry code, for its later graphs (tiering)
    random = graph_uses_randomness(cap.graph_module)  # (a walk of the graph: once)
    fn, text = _entry_function(state, cap, graph_fn, fast_tensors, buffers, random, built)
    seconds = time.perf_counter() - start
    state.stats.compile_seconds += seconds
    grad = next((g.grad_enabled for g in cap.guards if hasattr(g, "grad_enabled")), True)
    if note and note not in state.notes:
        state.notes.append(note)
    log.emit("graphs", f"{state.target.name} ({backend}{'; ' + note if note else ''}):\n"
             f"{cap.code}")
    log.emit("guards", f"{state.target.name}:\n  " + "\n  ".join(cap.guards.readable()))
    entry = GraphEntry(cap, backend, fn, text, grad, seconds, note=note, graph_fn=graph_fn)
    if backend_name is None and tiering.tiered(state.backend) and not cap.distributed_leaves:
        tiering.watch(entry, cap.graph_module, functools.partial(
            _entry_function, state, cap, fast_tensors=fast_tensors, buffers=buffers,
            random=random, built=built),
            eager=functools.partial(tiering.eager_choice, cap.guards, state.target))
    return entry


def _entry_function(state: CodeState, cap: Capture, graph_fn: Callable, fast_tensors: bool,
                    buffers: list, random: bool, built: dict | None = None) -> tuple[Callable, str]:
    """The entry function of ``cap`` calling ``graph_fn``, and its source (``random``: the
    graph draws random numbers; ``built``: as in ``build_entry_function``)."""
    fn, text = build_entry_function(cap.guards, cap.input_sources, cap.output, graph_fn, fast_tensors,
                           cap.writes, cap.assertions, random, built)
    fn = exact.entry(state, cap.graph_module, fn)
    if cap.distributed_leaves:
        fn = hooks.distributed.wrap_entry(fn, list(buffers))
    if cap.writes:  # guards to commit atomic for threads sharing what it writes
        fn = locked_entry(fn)
    return fn, text


def _backend_compile(state: CodeState, gm, backend_name: str | None, note: str):
    """``(compiled graph, backend name, note)``: the chosen backend's, or ``fx``'s with a
    note saying why the chosen one was not used."""
    backend = get_backend(backend_name or state.backend)
    reason = backend.supports(gm)
    if reason:
        note = f"backend {backend.name!r} not used: {reason}; ran it with 'fx'"
        backend = get_backend("fx")
    examples = example_inputs(gm)
    try:
        compiled = backend.compile(gm, examples)
        compiling = backend.name not in ("fx", "auto")
        if compiling and config.tune_malloc:
            _glibc_malloc.tune_logged(f"before the first graph compiled by {backend.name!r} runs")
        if compiling and graph_uses_randomness(gm):
            from ..tiering.same_draws import FirstCallsChecked
            compiled = FirstCallsChecked(compiled, get_backend("fx").compile(gm, examples),
                                         backend.name)
        return compiled, backend.name, note
    except Exception as e:
        if backend.name == "fx":
            raise
        note = f"backend {backend.name!r} failed ({type(e).__name__}: {e}); ran it with 'fx'"
        return get_backend("fx").compile(gm, examples), "fx", note
