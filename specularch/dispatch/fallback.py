"""Fallbacks: a call that runs the original Python, and the record that says why.

Every way out of the graph path ends here: a capture that failed, a path remembered as eager,
a graph whose in-graph assumption failed or that raised, a generator function. Records are
deduplicated per state (``remember``) and count the calls that ran eagerly for them; a failed
capture's guards become an eager entry, so the same path does not try to capture again.
Strict mode (``config.strict``) raises ``SpecularchStrictError`` instead of running eagerly.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import log
from ..config import config
from ..eager_run import FRAME_HOOK, EagerRun
from ..entry_function import AssumptionFailed
from ..guards import draws
from ..records import FALLBACK_KINDS, FallbackRecord, SpecularchStrictError, Unsupported
from ..shadow_heap import CommitRefused
from ..symbolic.speculation import branch_merge
from ..symbolic.speculation.raising_branch import raising_nodes
from ..symbolic import exceptions
from . import hooks
from ..templates.family import TemplateMiss
from .state import LOCK, CodeState, EagerEntry, GraphEntry

VALUE_DEPENDENT_RETRIES = 8  # captures failing on tensor values before the path stays eager


def note_generator(state: CodeState) -> None:
    """An optimized generator function was called: it always runs eagerly; say so."""
    target = state.target
    state.stats.calls += 1
    state.stats.fallback_calls += 1
    record = remember(state, FallbackRecord(
        "generator", f"{target.name} is a generator function; generators run eagerly",
        FALLBACK_KINDS["generator"][1], target.filename, target.firstlineno, target.name))
    record.count += 1
    if config.strict:
        raise SpecularchStrictError(f"specularch strict mode: {target.name} falls back.\n{record}")


def fallback(state: CodeState, slots, cells, error: Unsupported, *, at_def: bool = False,
             reaches_backward: bool = False) -> Any:
    """Record ``error`` and run the original for this call."""
    record = note_fallback(state, error, at_def=at_def, reaches_backward=reaches_backward)
    return run_eager(state, slots, cells, record, reaches_backward=reaches_backward)


def note_fallback(state: CodeState, error: Unsupported, *, at_def: bool = False,
                  ran: bool = False, reaches_backward: bool = False) -> FallbackRecord:
    """Record a fallback (and the eager entry for its path); ``ran``: the eager run already
    happened (it is counted here)."""
    target = state.target
    if at_def or error.filename is None:
        error.filename = error.filename or target.filename
        error.lineno = error.lineno or target.firstlineno
        error.function = error.function or target.name
    record = remember(state, error.record())
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


def remember(state: CodeState, record: FallbackRecord) -> FallbackRecord:
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


def defer_eager(state: CodeState, slots, cells, record: FallbackRecord,
                reaches_backward: bool = False) -> Any:
    """A path remembered as eager: an ``EagerRun`` for the caller to run (its frames are what
    a recursive function that runs eagerly nests per level), or, where the run needs more
    than the frame hook (strict mode, torch.distributed), the result of ``run_eager``."""
    if config.strict or hooks.distributed.active():
        return run_eager(state, slots, cells, record, reaches_backward)
    record.count += 1
    state.stats.fallback_calls += 1
    return EagerRun(record, state.target, cells)


def run_eager(state: CodeState, slots, cells, record: FallbackRecord,
              reaches_backward: bool = False) -> Any:
    distributed = hooks.distributed
    if config.strict:
        if distributed.active():
            distributed.refuse_strict(state, record, reaches_backward)
        raise SpecularchStrictError(f"specularch strict mode: {state.target.name} would fall back "
                                    f"to eager.\n{record}") from None  # the record says why
    record.count += 1
    state.stats.fallback_calls += 1
    draws.rewind()  # the original makes the call's random.random() draws itself
    if distributed.active():
        result = distributed.run_eager(state, slots, cells, record, reaches_backward)
    else:
        with FRAME_HOOK.active():
            result = state.target.call_original(slots, cells)
    log.warn_fallback(record)  # a call that returned without its graph (not one that raised)
    return result


def assumption_failed(state: CodeState, entry: GraphEntry, failure: AssumptionFailed,
                      slots, cells) -> Any:
    """An in-graph assumption failed (nothing was committed): drop the graph, remember the
    site so the next capture does not assume it again, run the original."""
    torch.set_grad_enabled(entry.grad_enabled)
    return fallback(state, slots, cells, _forget(state, entry, failure))


def _forget(state: CodeState, entry: GraphEntry, failure: AssumptionFailed,
            more: str = "") -> Unsupported:
    """Drop ``entry``, remember its failed site so the next capture does not assume it
    again; the fallback to record, at the assumption's line (``more``: added to its
    explanation)."""
    with LOCK:
        if entry in state.entries:
            state.entries.remove(entry)
            state.keep_unrolled(getattr(entry.capture, "loops", ()))
        state.unstable_sites.add(failure.site)
        state.stats.assumption_failures += 1
        if failure.site[0] in ("specialize", "compare"):  # a size of an intermediate tensor
            state.general.sizes_steer_python(failure.where)
    filename, _, line = failure.where.rpartition(":")
    error = Unsupported("assumption_failed", failure.explanation() + more, _hint(failure))
    error.filename, error.lineno, error.function = filename, int(line or 0), state.target.name
    return error


def template_missed(state: CodeState, entry: GraphEntry, miss: Exception, slots, cells) -> Any:
    """A recursion template met a node its graph cannot run (a new path reading what the
    graph does not pass): nothing was committed; drop the graph (the next capture passes what
    the family's paths need now) and run the original."""
    torch.set_grad_enabled(entry.grad_enabled)
    with LOCK:
        if entry in state.entries:
            state.entries.remove(entry)
        state.stats.assumption_failures += 1
    return fallback(state, slots, cells, Unsupported(
        "assumption_failed", f"template: {miss}",
        "Expected once per new kind of node: the next call captures again and passes what the "
        "new path reads. If it repeats, explain() lists the family's paths and why one cannot "
        "be a template."))


def graph_raised(state: CodeState, entry: GraphEntry, error: Exception, slots, cells) -> Any:
    """An ``fx`` graph raised (nothing was committed). Run the original first to tell the
    user's own error (eager raises too: the graph only met it first, e.g. an index out of
    range) from a graph that raised where eager does not."""
    if isinstance(error, TemplateMiss):
        return template_missed(state, entry, error, slots, cells)
    if isinstance(error, CommitRefused):
        # What the commit relied on changed since capture (a class gained __setattr__, a
        # gradient's shape): drop the graph, the next call captures under what holds now.
        with LOCK:
            if entry in state.entries:
                state.entries.remove(entry)
    sized = _size_assumption(entry) if not isinstance(error, CommitRefused) else None
    if sized is not None:
        # a size the graph assumed (checked after it ran) may have changed and made an op
        # fail before the check (`unbind` into fewer parts than captured, then `parts[4]`):
        # that assumption's failure, as if checked first (the original runs either way)
        return assumption_failed(state, entry, AssumptionFailed(*sized, True), slots, cells)
    if entry.capture.distributed_leaves and hooks.distributed.active():
        return hooks.distributed.step_graph_raised(
            state, error, lambda failure: fallback(state, slots, cells, failure, at_def=True))
    what = f"the compiled graph raised {type(error).__name__}: {error}"
    if config.strict:
        raise SpecularchStrictError(f"specularch strict mode: {state.target.name}: {what}")
    draws.rewind()
    try:
        with FRAME_HOOK.active():
            result = state.target.call_original(slots, cells)
    except Exception as eager_error:
        failure = Unsupported("exception_handling",
                              f"{what}; the original code raises {type(eager_error).__name__} "
                              f"too (the call ran eagerly and raised it)")
        outcome = eager_error
    else:
        failure, outcome = _eager_did_not_raise(entry, error, what), None
        if isinstance(error, CommitRefused):
            failure = Unsupported("side_effect", f"{error}; the call ran eagerly")
        elif failure.kind != "data_dependent_branch":  # (not a merged branch's other side)
            assumed = _assumed_before(entry, error)
            if assumed is not None:  # (eager took the other way: `if v != 0 and 1 / v > 1`)
                return _assumed_wrongly(state, entry, assumed, result)
    record = note_fallback(state, failure, at_def=True, ran=True)
    if outcome is not None:
        raise outcome
    log.warn_fallback(record)
    return result


def _hint(failure: AssumptionFailed) -> str | None:
    """The kind's own hint (a tensor branch), except for a test on a ``.item()`` value, whose
    hint names its usual unmergeable case (an early ``break``)."""
    if failure.site[-1] != "item":
        return None
    return ("Expected for tests that really flip. A plain if/else on it whose sides have no side "
            "effects is captured with both sides (torch.where) from the next call on; otherwise "
            "(an early `break` on a predicted token) its path runs eagerly: keep the test in "
            "tensors (torch.where, masking) to stay in one graph.")


def _assumed_before(entry: GraphEntry, error: Exception) -> AssumptionFailed | None:
    """The in-graph assumption (a tensor branch, a test on a ``.item()`` value) computed last
    before the op that raised, where the graph raised at an op after one and eager did not:
    that assumption cannot have held (the graph went on down the path it assumed, eager took
    the other, where nothing raises); None where no assumption comes before the raise."""
    gm = entry.capture.graph_module
    raised = [n for n in raising_nodes(error, [gm]) if n.graph is gm.graph]
    if not raised or not entry.capture.assertions:
        return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    before = [(order[outputs[index]], where, site, expected)
              for index, expected, where, site in entry.capture.assertions
              if isinstance(outputs[index], torch.fx.Node) and order[outputs[index]] < order[raised[-1]]]
    if not before:
        return None
    _, where, site, expected = max(before, key=lambda b: b[0])
    return AssumptionFailed(where, site, expected)


def _assumed_wrongly(state: CodeState, entry: GraphEntry, failure: AssumptionFailed,
                     result: Any) -> Any:
    """``assumption_failed`` for a call whose original already ran (and returned ``result``)."""
    error = _forget(state, entry, failure, " (the graph raised on the path it assumed; the "
                    "call ran eagerly)")
    log.warn_fallback(note_fallback(state, error, ran=True))
    return result


def _size_assumption(entry: GraphEntry) -> tuple | None:
    """(where, site) of the first size of an intermediate the graph assumed, if any."""
    for _, _, where, site in entry.capture.assertions:
        if site[0] in ("specialize", "compare"):
            return where, site
    return None


def _eager_did_not_raise(entry: GraphEntry, error: Exception, what: str) -> Unsupported:
    """A graph raised where the original code does not: an op on the side of a merged
    tensor branch that this call does not take (the graph computes both sides), an op under
    a try the code handles, or else a bug of ours (``backend_error``)."""
    graphs = [entry.capture.graph_module, getattr(entry.graph_fn, "__self__", None)]
    side = branch_merge.side_not_taken(error, graphs)
    if side is None:
        return exceptions.eager_did_not_raise(error, graphs, what)
    (filename, lineno, function), op_at, tested = side
    failure = Unsupported(
        "data_dependent_branch",
        f"the {tested} at {filename}:{lineno} is captured with both sides "
        f"(selected with torch.where); the side this call does not take raised "
        f"{type(error).__name__}: {error} (at {op_at or 'an op of that side'}), where eager "
        f"never runs it; the call ran eagerly and returned eager's result",
        "Make that side valid for every input (clamp the index, avoid a zero divisor) or "
        "select with torch.where yourself; results are correct either way, only slower.")
    failure.filename, failure.lineno, failure.function = filename, lineno, function
    return failure
