"""One cache entry = one generated Python function doing the whole fast path of a call:

    def entry(L, C, G, B):
        try:
            <guards, each source evaluated once>        # return MISS on the first failure
            <graph inputs and every object the commit will touch, read from their sources>
        except Exception:
            return MISS
        c0 = CLOCK()                                # clock reads made before any tensor op
        try:
            R = GRAPH(s0, s3, ...)
        except BaseException:                       # also KeyboardInterrupt
            SET_GRAD(GRAD)                            # the guarded grad mode, as before the graph
            raise
        if bool(R[4]) is not True: return FAILED[0]    # in-graph assumptions
        c1 = CLOCK(); n0 = ...                      # clocks after the graph; numbers computed
                                                    # from .item() values (symbolic/speculation/deferred.py)
        <objects created in the call, built from R and constants>  # shadow_heap/rebuild.py
        <checks that no write will raise, else CommitRefused>      # shadow_heap/checks.py
        <shadow-heap commit: the deferred writes, in program order> # shadow_heap/writes.py
        return <the Python return value>

Every source is read before the graph runs, so the commit writes into the objects as they
were before the call, and nothing is written unless every guard and assertion passed.
"""
from __future__ import annotations

import statistics
import time
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .guards import GlobalStateGuard, GuardSet, SourceNamer, TensorGuard, guard_lines
from .guards.slots import compact_locals
from .guards.sources import PINNED
from .shadow_heap import Rebuild
from .shadow_heap.release import NAMESPACE as RELEASE_NAMESPACE, early_releases, release_lines
from .shadow_heap.render import COMMIT_NAMESPACE, Renderer, check_lines, commit_lines

MISS = object()

@dataclass(frozen=True)
class AssumptionFailed:
    """Returned by an entry whose in-graph assumption did not hold (nothing committed)."""

    where: str
    site: tuple
    expected: bool

    def explanation(self) -> str:
        if self.site[0] == "rolled_loop":
            return ("an assumption inside a rolled loop's body (a size, a tensor branch or a "
                    "test on a `.item()` value) did not hold in a later iteration")
        if self.site[0] == "gradients":  # (symbolic/library/training.py)
            return ("the graph assumed backward() gives a gradient to the tensors it gave one at "
                    "capture, and only those, but this call's backward reached others")
        if self.site[0] in ("specialize", "compare"):
            return ("the graph assumed a size computed inside the function keeps the value it "
                    "had at capture (it steers Python control flow), but it changed")
        if self.site[-1] == "item":  # (speculation/item_args.speculated)
            return (f"the graph assumed this test on a `.item()` value is {self.expected}, "
                    f"but it was {not self.expected}")
        return (f"the graph assumed this branch on a tensor value is {self.expected}, "
                f"but it was {not self.expected}")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _only_plain_tensors(guards: GuardSet) -> bool:
    return all(g.tensor_type in _PLAIN_TENSORS for g in guards if isinstance(g, TensorGuard))


def _clock_reads(render: Renderer, phase: str) -> list[str]:
    """The clock reads of one side of the graph, in program order."""
    return [f"c{seq} = {render.const(fn)}()" for seq, (fn, at) in sorted(render.clocks.items())
            if at == phase]


def _before_writes(lines: list[str], random_graph: bool) -> list[str]:
    """What runs after the graph and before any write: the numbers the commit computes
    (symbolic/speculation/deferred.py), and the checks that no write will raise
    (shadow_heap/checks.py). One that raises (a division by a zero ``.item()``, a
    ``CommitRefused``) leaves every object untouched, and the dispatcher runs the call
    eagerly, which raises eager's error; that run must draw what the graph drew."""
    if not lines or not random_graph:
        return [f"    {line}" for line in lines]
    return ["    try:", *[f"        {line}" for line in lines],
            "    except BaseException:", "        SET_RNG(RNG)", "        raise"]


def _runs_on_fx(graph_fn: Callable) -> bool:
    """Whether ``graph_fn`` is a GraphModule's own code (``fx``). Only such a graph releases
    old gradients before it runs (``shadow_heap/release.py``): one that raises is run again
    eagerly, which needs no gradient, where a compiling backend's is retried with ``fx``
    (``misses.fx_instead``), whose guards must see the state the call started with."""
    return isinstance(getattr(graph_fn, "__self__", None), torch.fx.GraphModule)


def _guarded_grad_mode(guards: GuardSet) -> bool:
    """The grad mode a call passing ``guards`` runs in (every capture guards it)."""
    return next(g.grad_enabled for g in guards if isinstance(g, GlobalStateGuard))


def build_entry_function(guards: GuardSet, input_sources: list, output_spec: Rebuild, graph_fn: Callable,
                fast_tensors: bool = True, writes: list = (), assertions: list = (),
                random_graph: bool = False, built: dict | None = None) -> tuple[Callable, str]:
    """The entry function and its source text (kept for explain()). ``writes``: the lowered
    shadow-heap records (``shadow_heap/writes.py``), committed in program order.

    ``built``: where the entries of one capture keep their generated code. The text does
    not depend on the graph (whether it releases old gradients early is ``EARLY`` in its
    namespace), so a later graph of the same capture (a tiering candidate) gets the code
    already compiled, bound to a namespace of its own with that graph as ``GRAPH``:
    generating and compiling an entry's text is milliseconds of Python holding the GIL
    (5-11 ms for a small training step), which a program's step running beside the
    background compiler waits for."""
    key = (fast_tensors, random_graph)
    if built is not None and key in built:
        return _rebound(*built[key], graph_fn, guards)
    consts: dict[str, Any] = {}
    namer = SourceNamer()
    body = guard_lines(guards, namer, consts, fast_tensors)
    inputs = [namer.name(s) for s in input_sources]
    render = Renderer(namer, consts)
    # Last step's .grad, freed before the graph where it runs on fx (``EARLY``); their writes
    # stay in the commit's gradient assignments too (for fx: ``None`` again, in program order).
    release = release_lines(render, early_releases(list(writes), input_sources, output_spec,
                                                   assertions, guards))
    checks = check_lines(render, writes)
    commit = commit_lines(render, writes, _only_plain_tensors(guards))
    result = render.expr(output_spec)
    body += namer.lines
    failed = [AssumptionFailed(where, site, expected) for _, expected, where, site in assertions]
    src = ["def entry(L, C, G, B):", "    try:"]
    src += [f"        {line}" for line in body] or ["        pass"]
    src += ["    except Exception:", "        return MISS"]
    call = f"R = GRAPH({', '.join(inputs)})"
    # The graph switches grad mode around its no_grad blocks: one stopped inside such a block
    # (an error, or Ctrl-C's KeyboardInterrupt) must not leave the caller's mode switched; the
    # guards passed, so the mode before the graph is the guarded one. The eager re-run after
    # a failed assumption or a graph that raised must draw the same random numbers as if the
    # graph had never run.
    restore = ["SET_GRAD(GRAD)", *(["SET_RNG(RNG)"] if random_graph else [])]
    src += ["    RNG = GET_RNG()"] if random_graph else []
    src += [f"    {line}" for line in _clock_reads(render, "before")]
    src += ["    if EARLY:", *[f"        {line}" for line in release]] if release else []
    src += ["    try:", f"        {call}", "    except BaseException:",
            *[f"        {line}" for line in restore], "        raise"]
    for i, (index, expected, _, _) in enumerate(assertions):
        restore = "SET_RNG(RNG); " if random_graph else ""
        src.append(f"    if bool(R[{index}]) is not {expected}: {restore}return FAILED[{i}]")
    src += [f"    {line}" for line in _clock_reads(render, "after")]
    src += _before_writes(render.numbers, random_graph)
    src += [f"    {line}" for line in render.prelude]
    src += _before_writes(checks, random_graph)
    src += [f"    {line}" for line in commit]
    src.append(f"    return {result}")
    text = "\n".join(src) + "\n"
    ns: dict[str, Any] = dict(consts, **COMMIT_NAMESPACE, **RELEASE_NAMESPACE, MISS=MISS,
                              GRAPH=graph_fn, EARLY=_runs_on_fx(graph_fn), O=PINNED, FAILED=failed,
                              GET_RNG=torch.get_rng_state, SET_RNG=torch.set_rng_state,
                              SET_GRAD=torch.set_grad_enabled, GRAD=_guarded_grad_mode(guards))
    exec(compile(text, "<specularch entry>", "exec"), ns)
    entry = ns["entry"]
    entry.__code__ = compact_locals(entry.__code__)  # a big entry's frame fits the data stack
    guards.timer = _guard_timer(ns)
    if built is not None:
        built[key] = (entry.__code__, ns, text)
    return entry, text


def _rebound(code: types.CodeType, namespace: dict, text: str, graph_fn: Callable,
             guards: GuardSet) -> tuple[Callable, str]:
    """An entry function running ``code`` (another entry's) with ``graph_fn`` as its graph.
    Everything else in its namespace is the capture's, shared: constants, guarded objects
    (held weakly), the tensor checker (it keeps no state between calls)."""
    ns = dict(namespace, GRAPH=graph_fn, EARLY=_runs_on_fx(graph_fn))
    ns["entry"] = entry = types.FunctionType(code, ns, "entry")
    guards.timer = _guard_timer(ns)
    return entry, text


GUARD_TIMING_CALLS = 50
GUARD_TIMING_BUDGET_S = 0.01  # of compile time: a 10,000-guard check runs fewer times


class _GraphReached(Exception):
    """Raised by the stand-in graph of a guard timing: the check before the graph is done."""


def _guard_timer(namespace: dict) -> Callable:
    """A function timing, in µs, what a call does before its graph runs (the guards and the
    reads of the graph's inputs), or None when the guards do not pass: it runs the entry
    with a stand-in graph that notes the time and stops it (nothing is committed). Called
    once, at compile time, on the capturing call, before the entry is in the cache (no
    other thread runs it meanwhile). Old gradients are not released (``RELEASE_GRADS``): the
    call that follows must pass the same guards."""
    def time_guards(L, C, G, B) -> float | None:
        entry, graph, reached = namespace["entry"], namespace["GRAPH"], []
        release = namespace["RELEASE_GRADS"]

        def stand_in(*args):
            reached.append(time.perf_counter())
            raise _GraphReached

        def once() -> float | None:
            start = time.perf_counter()
            try:
                entry(L, C, G, B)
            except _GraphReached:
                return reached[-1] - start
            return None

        namespace["GRAPH"], namespace["RELEASE_GRADS"] = stand_in, _no_release
        try:
            # The first run is not counted: right after a capture it also pays for the
            # garbage collection that capture deferred (``misses.gc_paused``).
            first = once()
            if first is None:
                return None
            calls = max(3, min(GUARD_TIMING_CALLS, int(GUARD_TIMING_BUDGET_S / max(first, 1e-9))))
            return statistics.median([once() or first for _ in range(calls)]) * 1e6
        finally:
            namespace["GRAPH"], namespace["RELEASE_GRADS"] = graph, release
    return time_guards


def _no_release(tensors: tuple) -> None:
    pass
