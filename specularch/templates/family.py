"""The paths of one recursive function (a *template family*), choosing a path per node, and
evaluating a structure: planning it into instances (post-order, as eager calls them), then
running the instances one by one (exact) or by wavefront (``wavefront.py``)."""
from __future__ import annotations

import builtins
import sys
from dataclasses import dataclass, field

from ..config import config
from ..guards.guard import refers_to_dead
from ..guards.sources import Source
from ..records import Unsupported
from .paths import Path, capture_path, source_getter

MAX_PATHS = 64          # paths per family; past this a new path falls back (cache_limit-like)
MAX_INSTANCES = 1_000_000


class TemplateMiss(Exception):
    """A node of the structure needs what the running graph did not pass (a path captured
    after the graph, reading another context tensor), or cannot be captured: the call runs
    eagerly, leaving nothing changed (the graph commits nothing before it returns)."""


@dataclass
class Plan:
    """A structure as template instances, children before parents (eager's call order)."""

    paths: list = field(default_factory=list)      # per instance: its Path
    nodes: list = field(default_factory=list)      # per instance: per-node input values
    kids: list = field(default_factory=list)       # per instance: child instance ids
    heights: list = field(default_factory=list)    # per instance: 0 for a leaf of the walk
    roots: list = field(default_factory=list)      # instance id per root


class Family:
    def __init__(self, code, globals_: dict, params: tuple[str, ...], ctx_params: frozenset,
                 struct_params: frozenset):
        self.code = code
        self.globals = globals_
        self.name = code.co_qualname
        self.params = params
        self.ctx_params = ctx_params
        self.struct_params = struct_params
        self._struct_order = tuple(sorted(struct_params))
        self.paths: list[Path] = []
        self.ctx_sources: list[Source] = []   # context tensors, over the template's locals
        self._ctx_getters: list = []          # one per ctx source
        self.last_call: dict = {}       # instances, levels, batch sizes of the latest run
        self.closed: str | None = None  # why paths are no longer captured at run time
        self.builtins = globals_.get("__builtins__", builtins)
        if not isinstance(self.builtins, dict):
            self.builtins = self.builtins.__dict__
        self.stats = {"calls": 0, "instances": 0, "batches": 0, "batched_instances": 0,
                      "largest_batch": 0, "captures": 0}

    # ---- context ------------------------------------------------------------------------
    def ctx_index(self, source: Source) -> int:
        """The family-wide position of a context tensor's source (the graph passes them in
        this order)."""
        if source not in self.ctx_sources:
            self.ctx_sources.append(source)
        return self.ctx_sources.index(source)

    def ctx_values(self, L: list, enabled: list[Path]) -> tuple:
        """The context tensors read from the real context objects (during capture): those
        the ``enabled`` paths read, None for the others (another model's, say)."""
        needed = {inp.index for p in enabled for inp in p.inputs if inp.kind == "ctx"}
        while len(self._ctx_getters) < len(self.ctx_sources):
            self._ctx_getters.append(source_getter([self.ctx_sources[len(self._ctx_getters)]]))
        return tuple(get(L, self.globals)[0] if i in needed else None
                     for i, get in enumerate(self._ctx_getters))

    def enabled_paths(self, L: list) -> list[Path]:
        """The paths whose context guards hold for this call's context objects."""
        return [p for p in self.paths if p.ctx_check(L, (), self.globals, self.builtins)]

    # ---- planning -----------------------------------------------------------------------
    def select(self, L: list, enabled: list[Path], capture: bool) -> Path:
        for path in enabled:
            if path.check(L, (), self.globals, self.builtins):
                return path
        for path in self.paths:  # captured since ``enabled`` was made (a nested walk)
            if path not in enabled and path.ctx_check(L, (), self.globals, self.builtins):
                enabled.append(path)
                if path.check(L, (), self.globals, self.builtins):
                    return path
        if not capture:
            raise TemplateMiss(f"a node of {self.name} takes a path not captured yet")
        self.paths[:] = [p for p in self.paths if not refers_to_dead(p.ctx_guards)]
        if len(self.paths) >= MAX_PATHS:
            raise Unsupported("cache_limit", f"{self.name}: more than {MAX_PATHS} template paths")
        path = capture_path(self, L)
        self.stats["captures"] += 1
        for other in self.paths:  # a nested capture may have found the same path first
            if other.path_guards.readable() == path.path_guards.readable() and other.check(
                    L, (), self.globals, self.builtins) and other.ctx_check(
                    L, (), self.globals, self.builtins):
                if other not in enabled:
                    enabled.append(other)
                return other
        self.paths.append(path)
        enabled.append(path)
        return path

    def plan(self, roots: list[list], enabled: list[Path], capture: bool) -> Plan:
        """Walk the structures from ``roots`` (one locals list each) into instances."""
        plan = Plan()
        for L in roots:
            plan.roots.append(self._plan_one(plan, L, enabled, capture))
        return plan

    def _plan_one(self, plan: Plan, L: list, enabled: list[Path], capture: bool) -> int:
        """Instances of the structure under ``L`` in post-order (eager's call order); an
        explicit stack of [locals, path, children, next child, child ids], bounded by the
        depth eager could reach. The hot loop of a call: kept free of per-node allocations
        it can avoid."""
        G, paths, nodes, kids_of, heights = self.globals, plan.paths, plan.nodes, plan.kids, plan.heights
        stack: list = []
        current = L
        # eager recurses one Python frame per level at least: a structure nearly as deep as
        # the recursion limit runs eagerly, which raises RecursionError where eager does
        deepest = sys.getrecursionlimit() - _frame_depth() - 8
        while True:
            path = self.select(current, enabled, capture)
            children = self._children(path, current)
            if children:
                stack.append([current, path, children, 1, []])
                current = children[0]
                if len(stack) + len(paths) > MAX_INSTANCES or len(stack) >= deepest:
                    raise TemplateMiss(f"{self.name}: the structure is deeper than the "
                                       "recursion limit lets eager go, or a cycle")
                continue
            index = len(paths)
            paths.append(path)
            nodes.append(path.node_getter(current, G))
            kids_of.append(())
            heights.append(0)
            while stack:  # climb while the parents are complete
                top = stack[-1]
                top[4].append(index)
                if top[3] < len(top[2]):
                    current = top[2][top[3]]
                    top[3] += 1
                    break
                stack.pop()
                kids = top[4]
                index = len(paths)
                paths.append(top[1])
                nodes.append(top[1].node_getter(top[0], G))
                kids_of.append(kids)
                heights.append(1 + max(heights[k] for k in kids))
            else:
                return index

    def _children(self, path: Path, L: list) -> list:
        values = path.hole_getter(L, self.globals)
        if not values:
            return ()
        children, order, i = [], self._struct_order, 0
        for _ in path.holes:
            child = L.copy()
            for p in order:
                child[p] = values[i]
                i += 1
            children.append(child)
        return children

    # ---- running ------------------------------------------------------------------------
    def run_exact(self, plan: Plan, ctx: tuple) -> list:
        outs: list = [None] * len(plan.paths)
        for i, path in enumerate(plan.paths):
            outs[i] = path.gm.forward(*_arguments(path, ctx, plan.nodes[i], plan.kids[i], outs))
            path.runs += 1
        return [outs[r] for r in plan.roots]

    def evaluate_example(self, L: list):
        """The value of the call for the real node in ``L``, during a capture (capturing
        paths the structure needs)."""
        enabled = self.enabled_paths(L)
        plan = self.plan([L], enabled, capture=True)
        self.example_paths = frozenset(id(p) for p in plan.paths)  # (callsite: ``only``)
        try:
            return self.run_exact(plan, self.ctx_values(L, enabled))[0]
        except Unsupported:
            raise
        except Exception as e:  # a torch op raising on these values, as eager's call does
            raise Unsupported("exception_handling", f"the recursion raised {type(e).__name__} "
                              f"during capture: {e}") from None

    def run(self, structs: tuple, ctx_objects: tuple, ctx: tuple, only: frozenset | None = None):
        """The graph node: the value of the call on a new structure (``structs``: the
        structure arguments; ``ctx_objects``: the others; ``ctx``: the context tensors the
        graph read, in ``ctx_sources`` order; ``only``: see ``run_many``)."""
        return self.run_many((structs,), ctx_objects, ctx, only)[0]

    def run_many(self, structs_per_call: tuple, ctx_objects: tuple, ctx: tuple,
                 only: frozenset | None = None) -> tuple:
        """Several independent calls of the family with one context (the trees of a batch:
        ``templates/merge.py``) as one walk: their instances share the wavefront's levels.
        ``only``: the paths the graph's capture ran (ids), where the graph also differentiates
        (``loss.backward()``: its gradient node covers the tensors those paths read, and its
        optimizer step the parameters that got a gradient): another path is a miss."""
        roots = [self.locals_for(structs, ctx_objects) for structs in structs_per_call]
        enabled = self.enabled_paths(roots[0])
        try:  # a new path is captured here (pure: symbolic execution, template graphs)
            plan = self.plan(roots, enabled, capture=self.closed is None and only is None)
        except Unsupported as e:
            self.closed = e.explanation
            raise TemplateMiss(f"a node of {self.name} takes a path that cannot be a template: "
                               f"{e.explanation}") from None
        if only is not None and any(id(p) not in only for p in plan.paths):
            raise TemplateMiss(f"a node of {self.name} takes a path the graph's capture did not "
                               "run, and the graph differentiates: its gradients would be missing")
        self.stats["calls"] += len(roots)
        self.stats["instances"] += len(plan.paths)
        exact = any(p.random for p in plan.paths) or config.templates == "exact"
        self.last_call = {"instances": len(plan.paths), "exact": exact, "batches": [],
                          "levels": 1 + max(plan.heights), "roots": len(roots)}
        if exact:
            return tuple(self.run_exact(plan, ctx))
        from .wavefront import run_batched
        return tuple(run_batched(self, plan, ctx))

    def locals_for(self, structs: tuple, ctx_objects: tuple) -> list:
        L: list = [None] * len(self.params)
        for i, v in zip(sorted(self.struct_params), structs):
            L[i] = v
        for i, v in zip(sorted(self.ctx_params), ctx_objects):
            L[i] = v
        return L


def _frame_depth() -> int:
    frame, depth = sys._getframe(1), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def ctx_tensor(ctx: tuple, index: int):
    """Context tensor ``index`` as the graph passed it; a path captured after the graph (or
    another context's path) may read one it did not pass: the call then runs eagerly."""
    value = ctx[index] if index < len(ctx) else None
    if value is None:
        raise TemplateMiss("a template path reads a context tensor the graph did not pass")
    return value


def _arguments(path: Path, ctx: tuple, nodes: tuple, kids: list, outs: list) -> list:
    args = []
    for inp in path.inputs:
        if inp.kind == "ctx":
            args.append(ctx_tensor(ctx, inp.index))
        elif inp.kind == "node":
            args.append(nodes[inp.index])
        else:
            out = outs[kids[inp.index]]
            args.append(out[inp.slot] if isinstance(out, tuple) else out)
    return args


# Families by the identity of their code object and globals: equal code objects compare
# equal (two imports of one file, e.g. through a symlink) but run in different globals.
_FAMILIES: dict[tuple[int, int], Family] = {}


def family_for(code, globals_: dict, params: tuple, ctx_params: frozenset,
               struct_params: frozenset) -> Family:
    key = (id(code), id(globals_))
    found = _FAMILIES.get(key)
    if found is not None and found.code is code and found.globals is globals_ \
            and found.ctx_params == ctx_params and found.struct_params == struct_params:
        return found
    family = Family(code, globals_, params, ctx_params, struct_params)
    _FAMILIES[key] = family  # (holds the code and globals: ids are not reused while here)
    return family


def families() -> list[Family]:
    return list(_FAMILIES.values())


def reset() -> None:
    """Forget every family (``specularch.reset()``)."""
    _FAMILIES.clear()
