"""Capture: run one call's bytecode symbolically and produce an FX graph, its guards, its
inputs (as sources) and a description of how to rebuild the Python return value.

``capture`` never changes user-visible state: real ops run on real inputs but writes into
pre-existing tensors are refused (``_torch_dispatch.MutationCheck``), the RNG state and the
grad mode are restored afterwards, and every write to Python objects is ``Unsupported``.
"""
from __future__ import annotations

import collections
import functools
import time
import types
from dataclasses import dataclass, field, replace

import torch
import torch.fx

from ..fx_lower.randomness import generator_states, is_random_node, restore_generators
from ..fx_lower import _torch_fx_sources as fx_sources, history
from ..fx_lower.op_kinds import in_place_by_name
from ..guards import GuardSet
from ..guards.sources import CellSource, LocalSource, Source
from ..records import Unsupported
from ..shadow_heap import Rebuild, lint, lint_writes
from ..shadow_heap import rebuild as rb
from . import alias_guards, commit_inplace, hooks
from . import ops  # noqa: F401  (its handlers fill the opcode table the frames read)
from .speculation import branch_merge, deferred, saved_versions, view_writes
from .library import grad_mode
from ._torch_dispatch import storage_key, version_bumps
from .library import deque as deque_model
from .assumptions import Assumptions
from .values.deque import DequeV
from .frame import Frame
from .inputs import wrap_arguments
from .library.printing import StrV
from .rolled import head as rolled_head, lists as rolled_lists
from .rolled.hoist import stack_whole
from .rolled.lists import RollList
from .rolled.loops import LoopReport
from .values.rolled import RollRefused
from .library.stdlib_objects import counter_from_pairs
from .values.symint import SymV
from .tracer import Tracer
from .library.training import item_snapshot
from .values.scalar import ScalarV
from .values import (CellV, ConstV, DictV, DictViewV, FreshObjV, ListV, NewObjV, ObjV, SetV, TensorV, TupleV,
                     UntrackedContainerV, Value)


# Failures that speculation itself decided on: their eager entries are meant to stay.
_DECIDED_BY_SPECULATION = ("data_dependent_branch", "assumption_failed", "cache_limit")


@dataclass
class Capture:
    graph_module: torch.fx.GraphModule
    guards: GuardSet
    input_sources: list[Source]
    output: Rebuild        # how to rebuild the return value (see ``SpecBuilder``)
    seconds: float = 0.0
    writes: list = field(default_factory=list)       # lowered shadow-heap writes, in program order
    distributed_leaves: list = field(default_factory=list)  # broadcast from rank 0 once
    assertions: list = field(default_factory=list)   # (output index, expected, where, site)
    loops: list = field(default_factory=list)        # rolled_loops.LoopReport per loop
    draws: int = 0  # random.random() calls its path makes (guards/draws.py settles them)

    @property
    def code(self) -> str:
        return self.graph_module.code.strip()


def capture(code: types.CodeType, globals_: dict, argnames: tuple, slots: tuple,
            cells: tuple | None, assumptions: Assumptions = Assumptions(), *,
            max_instructions: int, inline_depth: int) -> Capture:
    """``assumptions`` say which argument sizes, Python numbers, containers and tensor
    branches the graph must not specialise on (profiling/relaxation).

    A loop rolled by ``rolled/loops.py`` that is not regular (``RollRefused``), or an attempt
    with rolled loops that fails in any other way, is captured again with those loops
    unrolled, as they were before loops were rolled; ``Capture.loops`` says why."""
    unrolled: list[LoopReport] = []
    while True:
        attempt: list[Tracer] = []
        try:
            cap = _capture_once(code, globals_, argnames, slots, cells, assumptions, attempt,
                                max_instructions=max_instructions, inline_depth=inline_depth)
        except RollList as e:  # the list is passed whole into the graph: again
            assumptions = replace(assumptions, rolled_lists=assumptions.rolled_lists | {
                (e.source, e.site, e.where)})
            continue
        except Exception as e:
            refused = _refused_loops(e, attempt, assumptions.rolled_lists)
            if not refused or refused.keys() <= assumptions.unrolled_loops:
                if isinstance(e, Unsupported):  # (explain() says why a loop stayed unrolled)
                    e.unrolled_loops = unrolled + [r for r in (attempt[0].loops if attempt else ())
                                                   if not r.rolled and r.why]
                raise
            unrolled += refused.values()
            assumptions = replace(assumptions,
                                  unrolled_loops=assumptions.unrolled_loops | refused.keys(),
                                  rolled_lists={e for e in assumptions.rolled_lists
                                                if e[1] not in refused})
            continue
        cap.loops = unrolled + cap.loops
        return cap


def _refused_loops(error: Exception, attempt: list, lists: frozenset) -> dict:
    """site -> report of the loops to unroll after ``error``: the loop refused, or every
    loop this attempt rolled (what followed may not support the rolled form), and every list
    it passed whole (``rolled/lists.py``)."""
    over_lists = {site: LoopReport(where, False, why, site=site, form=rolled_lists.form(source))
                  for (source, site, where), why in rolled_lists.refused(error, lists).items()}
    if isinstance(error, RollRefused):
        return {**over_lists, error.site: LoopReport(error.where, False, error.why,
                                                     site=error.site, form=error.form)}
    rolled = [r for r in attempt[0].loops if r.rolled] if attempt else []
    why = getattr(error, "explanation", None) or f"{type(error).__name__}: {error}"
    return {**{r.site: LoopReport(r.where, False, f"capture failed with it rolled ({why})",
                                  site=r.site, form=r.form) for r in rolled}, **over_lists}


def _size_hints(placeholders: list, hints) -> list:
    """(position, shape) pairs for the graph inputs with dynamic dims read from an argument
    slot that ``hints`` has a shape of the same rank for (plain values: sent to the worker).
    Empty where a compile must trace at the call's own sizes: a dynamic input that is not
    contiguous (zeros of the hinted sizes would not have its strides); the caller leaves
    out graphs that assume anything in the graph (a size they check may hold at this
    call's sizes only) or take Python numbers (one may be a size of this call: ``view(n, -1)``)."""
    out = []
    for i, n in enumerate(placeholders):
        value = n.meta.get("value")
        if not getattr(value, "dyn_dims", None):
            continue
        if not value.example.is_contiguous():
            return []
        slot = getattr(value.source, "index", None)
        if type(value.source) is LocalSource and slot in hints and len(hints[slot]) == value.example.dim():
            out.append([i, list(hints[slot])])
    return out


def _capture_once(code: types.CodeType, globals_: dict, argnames: tuple, slots: tuple,
                  cells: tuple | None, assumptions: Assumptions, attempt: list, *,
                  max_instructions: int, inline_depth: int) -> Capture:
    start = time.perf_counter()
    since = fx_sources.mark()
    tracer = Tracer(code, globals_, assumptions, max_instructions=max_instructions,
                    inline_depth=inline_depth)
    attempt.append(tracer)
    try:
        locals_ = wrap_arguments(tracer, argnames, slots)
    except Unsupported as e:
        e.guards = tracer.guards
        raise
    free = {name: CellV(None, real=cell, source=CellSource(i, name))
            for i, (name, cell) in enumerate(zip(code.co_freevars, cells or ()))}
    try:
        with _restore_process_state(tracer):
            with saved_versions.tracking(tracer):
                result = Frame(tracer, code, globals_, locals_, free).run()
            grad_mode.check_at_return(tracer)
            deferred.settle(tracer)  # clock reads: before or after the graph
            alias_guards.guard_writes(tracer)
            specs = SpecBuilder(globals_, view_writes.copies(tracer))
            writes = tracer.heap.lower(specs)
            spec = specs.build(result)
            seen = tracer.merged_aliases.at_end(tracer, [
                specs.outputs[i].meta["example"] for i in specs.as_values
                if isinstance(specs.outputs[i].meta.get("example"), torch.Tensor)])
            if seen is not None:
                why, at = seen
                raise branch_merge.refuse(why, at, tracer.merged_aliases.what.get(
                    at, "branch on a tensor value"))
            assertions = [(specs.out(node).index, expected, where, site)
                          for node, expected, where, site in tracer.assertions]
            view_writes.check(tracer, specs.outputs)  # views read after a deferred write
            # updates nothing in the graph reads: run in place by the commit, not copied
            writes = commit_inplace.replay_updates(tracer, specs, writes, spec, assertions)
            _lint(spec, writes, len(specs.outputs))
            if tracer.generators and assertions:
                raise Unsupported("data_dependent_branch", "speculating on a tensor value in a "
                                  "graph that draws from a torch.Generator is not supported (a "
                                  "failed assumption could not give the generator its state back)")
    except Unsupported as e:
        e.guards = tracer.guards  # the path to the failure: later calls on it run eagerly
        if tracer.assertions and e.kind not in _DECIDED_BY_SPECULATION:
            e.value_dependent = True  # reached under a speculated tensor branch
        raise
    tracer.graph.output(tuple(specs.outputs))
    if tracer.template_calls and hooks.after_graph is not None:
        hooks.after_graph(tracer)  # the trees of a batch: one wavefront (templates/merge.py)
    stack_whole(tracer.graph)  # a list a hoisted rolled loop appended to, stacked
    if not tracer.assumptions.exact_loops:
        rolled_head.join_heads(tracer.graph)  # its first item computed with the others
    _eliminate_dead_code(tracer.graph)
    inputs = _drop_unused_inputs(tracer.graph, tracer.input_sources)
    tracer.graph.lint()
    root = torch.nn.Module()
    for name, tensor in tracer.constants.items():
        setattr(root, name, tensor)
    gm = torch.fx.GraphModule(root, tracer.graph, class_name=f"Captured_{_ident(code.co_name)}")
    gm.meta["constructed_by"] = "specularch.symbolic.capture"
    gm.meta["unrolled_recursion"] = dict(tracer.unrolled)  # see templates/callsite.py
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gm.meta["scalar_inputs"] = any(isinstance(n.meta.get("example"), (int, float)) for n in placeholders)
    gm.meta["dynamic_dims"] = bool(tracer._sizes) or any(
        getattr(n.meta.get("value"), "dynamic", False) for n in placeholders)
    gm.meta["dynamic_inputs"] = [  # (position, dims) pairs: plain values, sent to the tiering worker
        [i, sorted(n.meta["value"].dyn_dims)] for i, n in enumerate(placeholders)
        if getattr(n.meta.get("value"), "dyn_dims", None)]
    gm.meta["sizes_below_two"] = tracer.guarded_below_two()  # (static_sizes.py)
    gm.meta["size_hints"] = [] if assertions or gm.meta["scalar_inputs"] else \
        _size_hints(placeholders, assumptions.size_hints)
    gm.meta["rolled_loops"] = any(r.rolled for r in tracer.loops)
    gm.meta["opaque_inputs"] = any(not isinstance(n.meta.get("example"), (torch.Tensor, int, float))
                                   for n in placeholders)
    gm.meta["in_graph_assumptions"] = bool(assertions)  # outputs the entry function checks
    gm.meta["non_tensor_outputs"] = any(
        not isinstance(n.meta.get("example"), torch.Tensor) for n in specs.outputs)
    gm.meta["value_outputs"] = sorted(specs.as_values)  # what the program sees as tensors
    gm.meta["outputs_require_grad"] = any(
        isinstance(n.meta.get("example"), torch.Tensor) and n.meta["example"].requires_grad
        for i, n in enumerate(specs.outputs) if i in specs.as_values)
    if tracer.distributed_leaves and assertions:
        raise Unsupported("data_dependent_branch", "a distributed training step cannot speculate "
                          "on tensor values yet (all ranks must take the same path)")
    fx_sources.release_with(gm, since)  # torch.fx keeps generated code's text for good
    # a cached graph must not keep its capture's autograd history alive (it holds the
    # parameters' AccumulateGrad nodes, with their shapes at capture: fx_lower/history.py)
    history.release(gm)
    return Capture(gm, tracer.guards, inputs, spec, time.perf_counter() - start,
                   writes=writes, assertions=assertions,
                   distributed_leaves=tracer.distributed_leaves, loops=list(tracer.loops),
                   draws=len(tracer.draws))


class _restore_process_state:
    """Capture runs real ops: put back the RNG streams (the default ones and every
    ``torch.Generator`` the code drew from) and the grad mode afterwards."""

    def __init__(self, tracer):
        self.tracer = tracer

    def __enter__(self):
        self.grad = torch.is_grad_enabled()
        self.rng = generator_states()

    def __exit__(self, *exc):
        grad_mode.unwind(self.tracer)
        torch.set_grad_enabled(self.grad)
        restore_generators(self.rng)
        for generator, state in self.tracer.generators.values():
            generator.set_state(state)
        return False


class SpecBuilder:
    """Describes how to rebuild Python values after the graph ran, as rebuild records
    (``shadow_heap/rebuild.py``), and lowers the shadow heap's writes to records that hold
    them (``shadow_heap/writes.py``). Containers created in the call carry a ``uid`` so one
    object stays one object."""

    def __init__(self, top_globals: dict | None = None, written: dict | None = None) -> None:
        self.top_globals = top_globals
        self.written = written or {}  # copies of tensors written in place (view_writes.copies)
        self.outputs: list[torch.fx.Node] = []
        self._index: dict[torch.fx.Node, int] = {}
        self._building: set[int] = set()
        self._rebuilt: set[int] = set()  # OrderedDict / defaultdict values already rebuilt
        self.as_values: set[int] = set()  # outputs used as values (not only via .item())

    def out(self, node: torch.fx.Node, as_value: bool = True) -> rb.GraphOutput:
        if node not in self._index:
            self._index[node] = len(self.outputs)
            self.outputs.append(node)
        if as_value:
            self.as_values.add(self._index[node])
        return rb.GraphOutput(self._index[node])

    version_bumps = staticmethod(version_bumps)  # for UpdateTensor.lower

    def build(self, v: Value) -> rb.Rebuild:
        if isinstance(v, TensorV):
            if v.updated:  # the real tensor, which the commit fills with the new values
                return rb.FromSource(v.source)
            if v.node.op == "placeholder" and isinstance(v.source, LocalSource) \
                    and v.real is not None and v.example is v.real:
                return rb.FromSource(v.source)  # an argument returned: itself, on any backend
            written = self.written.get(storage_key(v.example)) if self.written else None
            if written is not None and v.example is written[1]:
                return rb.FromSource(written[0])  # `x.mul_(2).add_(1)`: the real tensor itself
            source = view_writes.rebased(v, written)
            if source is not None:  # a view of such a tensor: the same view of the real one
                return rb.CallOf(view_writes.on_written, (rb.FromSource(source), self.out(v.node)))
            return grad_mode.output_spec(v, self.out(v.node))
        if isinstance(v, StrV):  # a string formatted by the commit from the graph's values
            return v.spec(self.build)
        if isinstance(v, ConstV):
            return rb.Constant(v.value)
        if isinstance(v, SymV):  # a number computed by the graph (kept symbolic)
            return self.out(v.node)
        if isinstance(v, ScalarV) and v.node is None:  # arithmetic / clocks (deferred.py)
            return deferred.spec(v, self.build)
        if isinstance(v, ScalarV):  # `t.item()`: read from the graph's output afterwards
            return rb.GraphItem(self.out(item_snapshot(v.node, v.read_after), as_value=False).index)
        if isinstance(v, (ListV, DictV, UntrackedContainerV)) and v.source is not None:
            return rb.FromSource(v.source)
        if isinstance(v, FreshObjV):
            raise Unsupported("unsupported_call", f"a {type(v.obj).__name__} made in the call is "
                              "returned or stored: eager makes a new one on every call")
        if isinstance(v, ObjV):
            return rb.FromSource(v.source) if v.source is not None else rb.Pinned(v.obj)
        if isinstance(v, SetV):
            return rb.SetOf(frozenset(v.items))
        if isinstance(v, DictViewV):  # a live view of the very dict rebuilt (or read) here
            return rb.CallOf(getattr(v.mapping.cls, v.kind), (self.build(v.mapping),))
        if id(v) in self._building:
            raise Unsupported("unsupported_call", "a value that contains itself cannot be rebuilt")
        self._building.add(id(v))
        try:
            return self._container(v)
        finally:
            self._building.discard(id(v))

    def _container(self, v: Value) -> rb.Rebuild:
        if isinstance(v, TupleV):
            return rb.TupleOf(tuple(self.build(i) for i in v.items), v.cls)
        if isinstance(v, DequeV):
            return deque_model.build_spec(self, v)
        if isinstance(v, ListV):
            return rb.ListOf(tuple(self.build(i) for i in v.items), id(v))
        if isinstance(v, DictV) and v.cls is not dict:
            return self._dict_subclass(v)
        if isinstance(v, DictV):
            return rb.DictOf(tuple((k, self.build(i)) for k, i in v.items.items()), id(v))
        if isinstance(v, NewObjV):
            return rb.NewObject(v.cls, tuple((k, self.build(i)) for k, i in v.attrs.items()), id(v))
        raise Unsupported("unsupported_call",
                          f"{v!r} is returned or stored, and cannot be rebuilt after the graph runs")

    def _dict_subclass(self, v) -> rb.TupleOf:
        """An OrderedDict / defaultdict made in the call, rebuilt as ``cls(((k, v), ...))``
        (a ``TupleOf`` whose class is called with one sequence). That record makes a new
        object each time it is used, so a second use (the same dict returned twice, or
        returned and stored) is refused rather than split into two objects."""
        if id(v) in self._rebuilt:
            raise Unsupported("unsupported_call", f"a {v.cls.__name__} made in the call is "
                              "returned or stored in more than one place")
        self._rebuilt.add(id(v))
        maker = counter_from_pairs if v.cls is collections.Counter else v.cls
        if v.cls is collections.defaultdict:
            if v.factory is not None and not isinstance(v.factory, (ObjV, ConstV)):
                raise Unsupported("unsupported_call", "a defaultdict whose default_factory was "
                                  "made in the call is returned or stored")
            maker = functools.partial(collections.defaultdict,
                                      None if v.factory is None else v.factory.concrete())
        pairs = tuple(rb.TupleOf((rb.Constant(k), self.build(i))) for k, i in v.items.items())
        return rb.TupleOf(pairs, maker)


def _lint(spec: Rebuild, writes: list, outputs: int) -> None:
    """A malformed rebuild or write record is a bug of capture: ``MalformedRebuild`` names
    it here (an ``internal_error`` fallback) instead of an entry failing, or rebuilding the
    wrong value, when it runs."""
    lint_writes(writes)
    lint([spec, *(r for w in writes for r in w.rebuilds())], outputs)


def _eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """Drop unused nodes, keeping in-place ops (FX's own DCE cannot see them; ``b.detach_()``,
    ``b.t_()`` by their names, where the mutation check saw no data written), random
    ops (an unused draw still advances the RNG) and ops under a try (``x[i]`` only to see
    whether it raises: the handler runs eagerly if it does, see exceptions.py)."""
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output") or node.users or node.meta.get("mutates") \
                or is_random_node(node) or node.meta.get("in_try") or in_place_by_name(node):
            continue
        graph.erase_node(node)


def _drop_unused_inputs(graph: torch.fx.Graph, sources: list[Source]) -> list[Source]:
    """Inputs read only for their metadata (guarded anyway) need not be passed in. A number
    only the commit reads (``commit_inplace.py``: a learning rate) stays one, unspecialised."""
    kept = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, source in zip(placeholders, sources):
        if node.users or node.meta.get("read_by_commit"):
            kept.append(source)
        else:
            graph.erase_node(node)
    return kept


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name) or "fn"
