"""Hoisting out of a rolled loop's body what feeds only the values it appends to lists.

In ``for t in range(n): h = cell(x[t], h); outs.append(decoder(h))`` the decoder feeds no
loop-carried value: run per iteration it is ``n - 1`` small products. Hoisted, the body
returns ``h`` per iteration instead, and after the loop one ``decoder`` runs on all of them
stacked (``[n - 1, B, H]``): one large product, and one gradient accumulation in backward.

Only ops known to act independently along leading dimensions move (elementwise ops,
``linear``/``matmul`` by a loop-invariant matrix, ``embedding`` by an invariant table, ops on
a dimension given from the end); a new leading dimension leaves each row's numbers as they
were, up to rounding (a product of many rows may sum in another order). Ops that draw random
numbers never move: their draws stay in eager's order. ``config.templates == "exact"`` keeps
every op in the body, in eager's order, bit for bit.

The body's values that hoisted ops read (*boundaries*) become extra per-iteration outputs of
the body; the loop stacks them and the hoisted ops run on the stacks.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F

from ...fx_lower.randomness import is_random_node
from ...fx_lower.op_kinds import ELEMENTWISE_FUNCTIONS as _ELEMENTWISE
from ...fx_lower.op_kinds import ELEMENTWISE_METHODS as _ELEMENTWISE_METHODS
from ...fx_lower.op_kinds import writes_in_place, wrote_an_input

# op name -> (position of its dim argument, whether the dim counts in the result's rank)
_ON_DIM = {"cat": (1, False), "stack": (1, True), "chunk": (2, False), "split": (2, False),
           "softmax": (1, False), "log_softmax": (1, False), "narrow": (1, False)}
_ON_DIM_FUNCTIONS = {torch.cat, torch.stack, torch.chunk, torch.split, torch.softmax,
                     torch.log_softmax, F.softmax, F.log_softmax, torch.narrow}


@dataclass
class HoistPlan:
    """What moves: ``nodes`` (body nodes, in graph order), the ``boundaries`` they read from
    the body (per-iteration values the body now returns), and which appended values are
    computed after the loop."""

    nodes: list = field(default_factory=list)
    boundaries: list = field(default_factory=list)
    appended: set = field(default_factory=set)   # appended result nodes that are hoisted
    why_not: str = ""                            # why an appended value stayed in the body

    def __bool__(self) -> bool:
        return bool(self.appended)


def plan(body_nodes: list, index_node, needed: list, appended: list, carried_heads: set,
         exact: bool) -> HoistPlan:
    """Which of ``body_nodes`` can move after the loop. ``needed``: the body's results that
    the next iteration or a check reads (they stay); ``appended``: the appended results;
    ``carried_heads``: the graph nodes that stand for the carried values at an iteration's
    start (per-iteration values too)."""
    if exact:
        return HoistPlan(why_not="templates='exact' keeps the body in eager's order")
    writer = body_writes(body_nodes)
    if writer is not None:  # a hoisted op would read what the last iteration left
        return HoistPlan(why_not=f"{_name(writer)} writes in place in the body")
    in_body = set(body_nodes)
    row = set(in_body) | set(carried_heads)
    why = {node: why_not_row_wise(node, row, index_node) for node in body_nodes}
    carried = _ancestors([n for n in needed if n in in_body], in_body)
    feeding = _ancestors([n for n in appended if n in in_body], in_body)
    # a node that stays needs what it reads in the body too
    kept = _ancestors([n for n in body_nodes if n in carried or n not in feeding
                       or why[n] is not None], in_body)
    nodes = [n for n in body_nodes if n not in kept]
    moved = set(nodes)
    stays = [n for n in body_nodes if n in feeding and n not in carried and why[n] is not None]
    why_not = f"{_name(stays[-1])}: {why[stays[-1]]}" if stays else \
        "what is appended feeds the values carried to the next iteration"
    boundaries = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in row and arg not in moved and arg not in boundaries:
                boundaries.append(arg)
    if not all(isinstance(b.meta.get("example"), torch.Tensor) for b in boundaries):
        return HoistPlan(why_not="a hoistable op reads a per-iteration value that is no tensor")
    hoisted = {n for n in appended if n in moved}
    return HoistPlan(nodes, boundaries, hoisted, "" if hoisted else why_not)


def body_writes(nodes) -> torch.fx.Node | None:
    """The first of a body's ``nodes`` that may write into a tensor (``op_kinds.
    writes_in_place``; one capture saw write into its inputs, ``op_kinds.wrote_an_input``:
    ``h.__setitem__(0, v)``, ``h.__imul__(2)``, ``aten.mul_``, whose names do not say so; an
    inner rolled loop whose body does): moving work before or after the loop would move it
    across that write."""
    for node in nodes:
        inner = getattr(node.target, "body", None)
        if writes_in_place(node) or wrote_an_input(node) \
                or isinstance(inner, torch.fx.GraphModule) \
                and body_writes(inner.graph.nodes) is not None:
            return node
    return None


def _ancestors(roots: list, within: set) -> set:
    seen, pending = set(), list(roots)
    while pending:
        node = pending.pop()
        if node in seen or node not in within:
            continue
        seen.add(node)
        pending += node.all_input_nodes
    return seen


def why_not_row_wise(node: torch.fx.Node, row: set, index_node) -> str | None:
    """None when running ``node`` once on its per-iteration operands stacked along a new
    leading dimension gives each iteration's result in that dimension."""
    if node.op not in ("call_function", "call_method"):
        return "not an op"
    if index_node in node.all_input_nodes:
        return "reads the loop index"
    if is_random_node(node):
        return "draws random numbers (they stay in eager's order)"
    row_args = [a for a in node.all_input_nodes if a in row]
    if not row_args:
        return "reads no per-iteration value"
    example = node.meta.get("example")
    target, method = node.target, node.op == "call_method"
    if target is operator.getitem:  # an item of a tuple-valued op's result (chunk, max)
        return None if isinstance(node.args[1], int) and node.args[0] in row and not isinstance(
            node.args[0].meta.get("example"), torch.Tensor) else "an indexing"
    if not isinstance(example, torch.Tensor) and not _tensor_items(node):
        return "its result is not a tensor"
    if (method and target in _ELEMENTWISE_METHODS) or (not method and target in _ELEMENTWISE):
        ndim = example.dim() if isinstance(example, torch.Tensor) else -1
        if any(_ndim(a) != ndim for a in row_args):
            return "a per-iteration operand of another rank than the result (broadcasting)"
        return None
    if _is_linear(target) or target in (torch.matmul, torch.mm, operator.matmul) or (
            method and target in ("matmul", "mm")):
        if target in (torch.mm,) or (method and target == "mm"):
            return "mm takes two-dimensional operands only"
        first = node.args[0]
        if first in row and not any(a in row for a in node.all_input_nodes if a is not first):
            return None
        return "a matrix product whose second operand changes per iteration"
    if target is F.embedding:
        return None if node.args[0] in row and node.args[1] not in row else \
            "an embedding lookup whose table changes per iteration"
    if _dim_op(node) is not None:
        return _dim_op_row_wise(node, row)
    return "not known to act independently along leading dimensions"


def _dim_op(node: torch.fx.Node):
    if node.op == "call_method":
        return node.target if node.target in _ON_DIM and node.target not in ("cat", "stack") \
            else None
    return node.target.__name__ if node.target in _ON_DIM_FUNCTIONS else None


def _dim_op_row_wise(node: torch.fx.Node, row: set) -> str | None:
    if node.target in (torch.cat, torch.stack):
        items = node.args[0]
        if not isinstance(items, (list, tuple)) or not all(i in row for i in items):
            return "joins a loop-invariant tensor with per-iteration ones"
    dim = _dim(node)
    if not isinstance(dim, int):
        return "an op over all dimensions"
    return None


def _dim(node: torch.fx.Node):
    name = _dim_op(node)  # a method's tensor is its args[0] too: the same positions
    position, _ = _ON_DIM[name]
    default = 0 if name in ("cat", "stack", "chunk", "split") else None
    return node.kwargs.get("dim", node.args[position] if len(node.args) > position else default)


def from_the_end(node: torch.fx.Node) -> tuple:
    """``node``'s args and kwargs with a dim counted from the end: a new leading dimension
    moves every dimension counted from the start by one."""
    name = _dim_op(node)
    dim = _dim(node) if name is not None else None
    if dim is None or dim < 0:
        return node.args, node.kwargs
    position, in_result = _ON_DIM[name]
    negative = dim - (_result_rank(node) if in_result else _input_rank(node))
    if "dim" not in node.kwargs and len(node.args) > position:
        return (*node.args[:position], negative, *node.args[position + 1:]), node.kwargs
    return node.args, {**node.kwargs, "dim": negative}


def _input_rank(node: torch.fx.Node) -> int:
    first = node.args[0]
    if isinstance(first, (list, tuple)):
        first = first[0]
    return _ndim(first)


def _result_rank(node: torch.fx.Node) -> int:
    example = node.meta.get("example")
    return example.dim() if isinstance(example, torch.Tensor) else _input_rank(node) + 1


def _tensor_items(node: torch.fx.Node) -> bool:
    """A tuple-valued op (chunk, split): its items are tensors on its getitem users."""
    return bool(node.users) and all(u.target is operator.getitem and isinstance(
        u.meta.get("example"), torch.Tensor) for u in node.users)


def _ndim(node) -> int:
    example = node.meta.get("example") if isinstance(node, torch.fx.Node) else None
    return example.dim() if isinstance(example, torch.Tensor) else -1


def _is_linear(target) -> bool:
    return target is F.linear or getattr(target, "__name__", "") == "linear"


def _name(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__",
                                                                       str(node.target))
    return f"`{target}`"


class HoistedTail:
    """The graph node's target after a rolled loop: the hoisted ops, run once on the stacked
    per-iteration values the body returned. It returns, per hoisted appended value, its
    values of all the rolled iterations stacked, or None when the loop ran no iteration
    past the first (nothing to stack: its sizes are unknown)."""

    __name__ = "hoisted_tail"

    def __init__(self, gm: torch.fx.GraphModule, appended: list):
        self.gm, self.appended = gm, appended

    def __call__(self, per_iteration: tuple, invariants: tuple) -> tuple:
        if not per_iteration[0]:
            return (None,) * len(self.appended)
        return self.gm(*[torch.stack(values) for values in per_iteration], *invariants)


def tail(ops: list, hoist: HoistPlan) -> tuple:
    """The ``HoistedTail`` of ``ops`` (``(node, op, target, args, kwargs)`` of the hoisted
    nodes, dims counted from the end), and the graph nodes it reads as invariants."""
    graph = torch.fx.Graph()
    env = {b: graph.placeholder(f"stacked_{i}") for i, b in enumerate(hoist.boundaries)}
    invariants: list = []

    def arg(node):
        if node not in env:
            invariants.append(node)
            env[node] = graph.placeholder(f"invariant_{len(invariants)}")
        return env[node]
    for node, op, target, args, kwargs in ops:
        args, kwargs = torch.fx.map_arg((args, kwargs), arg)
        env[node] = graph.create_node(op, target, args, kwargs, name=node.name)
    appended = [node for node, *_ in ops if node in hoist.appended]
    graph.output(tuple(env[a] for a in appended))
    _placeholders_first(graph)
    graph.lint()
    gm = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="HoistedTail")
    gm.meta["constructed_by"] = "specularch.symbolic.rolled.hoist"
    return HoistedTail(gm, appended), invariants


def _placeholders_first(graph: torch.fx.Graph) -> None:
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(node)


def join_stacked(head: list, stacked: torch.Tensor | None) -> list:
    """The list a hoisted loop appended to: its items before the rolled iterations, then one
    item per row of what the hoisted ops computed for all iterations at once."""
    return [*head, *stacked.unbind(0)] if stacked is not None else list(head)


def stack_joined(head: list, stacked: torch.Tensor | None) -> torch.Tensor:
    """``torch.stack(join_stacked(head, stacked))`` without splitting the rows that were
    computed together and copying them back: the same values, one copy fewer each way."""
    if stacked is None:
        return torch.stack(head)
    return torch.cat([torch.stack(head), stacked]) if head else stacked


def stack_whole(graph: torch.fx.Graph) -> None:
    """Rewrite ``torch.stack(join_stacked(head, rows))`` (dim 0, the list used nowhere else)
    into ``stack_joined(head, rows)``."""
    for node in list(graph.nodes):
        joined = node.args[0] if node.target is torch.stack and len(node.args) == 1 else None
        if not isinstance(joined, torch.fx.Node) or joined.target is not join_stacked \
                or node.kwargs.get("dim", 0) or len(joined.users) != 1:
            continue
        with graph.inserting_before(node):
            whole = graph.call_function(stack_joined, joined.args)
        whole.meta = dict(node.meta)
        node.replace_all_uses_with(whole)
        graph.erase_node(node)
        graph.erase_node(joined)
