"""Capturing one path of a recursive function.

The function's body runs symbolically on one real node of the structure (a separate tracer,
so a refusal leaves the enclosing capture untouched). Every guard whose source starts at a
*structure* parameter is a path guard (checked per node); every other guard is a context
guard (about ``self``, globals, torch: checked once per call). The recursive calls become
*holes*: graph inputs fed with the callee's results, computed for the example by evaluating
the family on the real child (which may capture the child's path first).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from ..config import config
from ..fx_lower.randomness import is_random_node
from ..guards import ExprGuard, GuardSet, ValueGuard
from ..guards.sources import LocalSource, Source
from ..records import Unsupported
from ..symbolic.assumptions import Assumptions
from ..symbolic.capture import _restore_process_state
from ..symbolic.inputs import placeholder
from ..symbolic.frame import Frame
from ..symbolic.tracer import Tracer
from ..symbolic.values import ConstV, TensorV, TupleV, Value
from ..guards.sources import PINNED

_UNSUPPORTED_FLAGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR


@dataclass(frozen=True)
class Hole:
    """One recursive call in a path: where its structure arguments come from (sources over
    the node's parameters). Its results are the placeholders whose ``Input`` names it."""

    sources: tuple[Source, ...]


@dataclass(frozen=True)
class Input:
    """One placeholder of a path graph: ``ctx`` (a tensor of the context, by family-wide
    index), ``node`` (a per-node Python number or tensor, by source) or ``hole``."""

    kind: str
    index: int            # ctx: family ctx index; node: position in node_sources; hole: hole
    slot: int = 0         # hole: which output of the callee


@dataclass
class Path:
    gm: torch.fx.GraphModule
    inputs: tuple[Input, ...]
    node_sources: tuple[Source, ...]
    holes: tuple[Hole, ...]
    arity: int | None            # None: one tensor; n: a tuple of n tensors
    path_guards: GuardSet
    ctx_guards: GuardSet
    random: bool                 # draws random numbers: only exact (post-order) evaluation
    check: Callable = dataclasses.field(repr=False, default=None)
    ctx_check: Callable = dataclasses.field(repr=False, default=None)
    node_getter: Callable = dataclasses.field(repr=False, default=None)
    hole_getter: Callable = dataclasses.field(repr=False, default=None)
    runs: int = 0
    batched: Any = None          # rowwise.Batched, or the reason it cannot batch (str)

    def __post_init__(self):
        self.check = self.path_guards.compile()
        self.ctx_check = self.ctx_guards.compile()
        self.node_getter = source_getter(self.node_sources)
        self.hole_getter = source_getter([s for h in self.holes for s in h.sources])

    def describe(self) -> str:
        lines = [line.split(" — ")[0] for line in self.path_guards.readable()]
        return "; ".join(lines) or "(any node)"


def source_getter(sources) -> Callable:
    """``get(L, G) -> tuple``: the values of ``sources`` for one node (one generated function:
    a Python expression per source)."""
    body = ", ".join(s.expr() for s in sources)
    ns: dict[str, Any] = {}
    ns["O"] = PINNED
    exec(f"def get(L, G):\n    return ({body}{',' if sources else ''})\n", ns)
    return ns["get"]


class TemplateCapture:
    """The state a path capture keeps on its tracer (``tracer.template``)."""

    def __init__(self, family, real_locals: list):
        self.family = family
        self.real_locals = real_locals
        self.locals: dict[str, Value] = {}
        self.holes: list[Hole] = []

    def hole(self, tracer, bound: dict[str, Value]) -> Value:
        """The recursive call ``f(*bound)`` inside the path: a graph input per result."""
        family = self.family
        sources = []
        for i, name in enumerate(family.params):
            value = bound[name]
            if i in family.ctx_params:
                if value is not self.locals[name]:
                    raise Unsupported("unsupported_call", f"the recursive call of {family.name} "
                                      f"passes another `{name}` than it was given")
                continue
            source = getattr(value, "source", None)
            root = source.root() if source is not None else None
            if not (isinstance(root, LocalSource) and root.index in family.struct_params):
                raise Unsupported("unsupported_call", f"the recursive call of {family.name} passes "
                                  f"`{name}` computed in the call, not a part of its structure "
                                  "arguments")
            sources.append(source)
        if any(is_random_node(n) for n in tracer.graph.nodes):
            raise Unsupported("unsupported_call", f"{family.name} draws random numbers before a "
                              "recursive call (the template could not keep eager's order)")
        child = list(self.real_locals)
        for i, value in zip(family.struct_params, source_getter(sources)(self.real_locals,
                                                                          family.globals)):
            child[i] = value
        example = family.evaluate_example(child)
        k = len(self.holes)
        results = example if isinstance(example, tuple) else (example,)
        values = []
        for j, tensor in enumerate(results):
            node = placeholder(tracer, f"hole{k}_{j}")
            node.meta["example"] = tensor
            node.meta["template_hole"] = (k, j)
            values.append(TensorV(node, tensor))
        self.holes.append(Hole(tuple(sources)))
        return TupleV(values) if isinstance(example, tuple) else values[0]


def capture_path(family, real_locals: list) -> Path:
    """One path of ``family`` for the node in ``real_locals`` (its structure parameters).

    The node's numbers are captured again as inputs (one path for every value), except those
    that steer Python (``if node.value < 0``, ``range(node.count)``): a guard on one of those
    is an expression of the node, which the path must check per node, so it stays a constant
    the path is guarded on (a ``ValueGuard`` of the node's: structural)."""
    symbolic: set = set()
    steering: set = set()
    for _ in range(3):
        tracer, result, tpl = _run(family, real_locals, symbolic)
        steered = {s for s in symbolic if _steers(s, tracer.guards)}
        if steered:  # capture again with those constants
            symbolic -= steered
            steering |= steered
            continue
        numbers = {g.source for g in tracer.guards if isinstance(g, ValueGuard)
                   and type(g.expected) in (int, float) and _is_structural(family, g.source)}
        if not numbers - symbolic - steering:
            break
        symbolic |= numbers - steering
    return _finish(family, tracer, result, tpl)


def _steers(source: Source, guards) -> bool:
    """Whether a guard that names no source (a symbolic number's comparison, ``ExprGuard``)
    is an expression of ``source``: checked once per call, not per node, it would hold the
    first node's answer for every node."""
    expr = source.expr()
    return any(isinstance(g, ExprGuard) and g.source is None and expr in g.expr for g in guards)


def _run(family, real_locals: list, symbolic: set):
    code = family.code
    tracer = Tracer(code, family.globals, Assumptions(symbolic_sources=frozenset(symbolic)),
                    max_instructions=config.max_instructions, inline_depth=config.inline_depth)
    tpl = TemplateCapture(family, real_locals)
    tracer.template = tpl
    tpl.locals = {name: tracer.wrap(value, LocalSource(i, name))
                  for i, (name, value) in enumerate(zip(family.params, real_locals))}
    with _restore_process_state(tracer):
        result = Frame(tracer, code, family.globals, dict(tpl.locals), {}).run()
    return tracer, result, tpl


def _finish(family, tracer, result: Value, tpl: TemplateCapture) -> Path:
    _refuse_effects(family, tracer)
    outputs, arity = _outputs(family, result)
    tracer.graph.output(tuple(v.node for v in outputs) if arity is not None else outputs[0].node)
    inputs, node_sources = _inputs(family, tracer)
    gm = torch.fx.GraphModule(_constants(tracer), tracer.graph,
                              class_name=f"Template_{family.code.co_name}")
    path_guards, ctx_guards = GuardSet(), GuardSet()
    for g in tracer.guards:
        (path_guards if _guard_is_structural(family, g) else ctx_guards).add(g)
    return Path(gm, tuple(inputs), tuple(node_sources), tuple(tpl.holes), arity, path_guards,
                ctx_guards, any(is_random_node(n) for n in gm.graph.nodes))


def _refuse_effects(family, tracer) -> None:
    why = None
    if tracer.heap.pending():
        why = "writes to Python objects or tensors from outside the call"
    elif tracer.assertions:
        why = f"branches on tensor values ({tracer.assertions[0][2]})"
    elif tracer.generators:
        why = "draws from a torch.Generator"
    elif tracer.view_writes or tracer.opt_state:
        why = "writes tensors in place"
    if why is not None:
        raise Unsupported("side_effect", f"{family.name} {why}: it stays unrolled")


def _outputs(family, result: Value) -> tuple[list[TensorV], int | None]:
    if isinstance(result, TensorV):
        return [result], None
    if isinstance(result, TupleV) and result.cls is tuple and result.items and all(
            isinstance(i, TensorV) for i in result.items):
        return list(result.items), len(result.items)
    kind = "a constant" if isinstance(result, ConstV) else type(result).__name__
    raise Unsupported("unsupported_call", f"{family.name} returns {kind}; templates need a "
                      "tensor or a tuple of tensors")


def _inputs(family, tracer) -> tuple[list[Input], list[Source]]:
    sources = iter(tracer.input_sources)
    inputs, node_sources = [], []
    for node in [n for n in tracer.graph.nodes if n.op == "placeholder"]:
        hole = node.meta.get("template_hole")
        if hole is not None:  # kept even when unused: every hole result is fed
            inputs.append(Input("hole", hole[0], hole[1]))
            continue
        source = next(sources)
        if not node.users:
            tracer.graph.erase_node(node)
            continue
        if _is_structural(family, source):
            inputs.append(Input("node", len(node_sources)))
            node_sources.append(source)
        else:
            if not isinstance(node.meta.get("example"), torch.Tensor):
                raise Unsupported("unsupported_call", f"{family.name} reads {source} as a number "
                                  "input of the template; only tensors of the context are")
            inputs.append(Input("ctx", family.ctx_index(source)))
    return inputs, node_sources


def _constants(tracer) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, tensor in tracer.constants.items():
        setattr(root, name, tensor)
    return root


def _is_structural(family, source: Source | None) -> bool:
    root = source.root() if source is not None else None
    return isinstance(root, LocalSource) and root.index in family.struct_params


def _guard_is_structural(family, guard) -> bool:
    return any(_is_structural(family, v) for v in _guard_sources(guard))


def _guard_sources(guard):
    for f in dataclasses.fields(guard):
        value = getattr(guard, f.name)
        if isinstance(value, Source):
            yield value


def check_signature(code) -> str | None:
    """Why ``code`` cannot be a template family (None: it can)."""
    if code.co_flags & _UNSUPPORTED_FLAGS:
        return "it takes *args/**kwargs or is a generator"
    if code.co_kwonlyargcount or code.co_freevars:
        return "it has keyword-only parameters or is a closure"
    return None
