"""``batch_foreach``: the same elementwise op applied to many independent tensors (an
optimizer update, parameter by parameter) becomes one ``torch._foreach_*`` call.

    a0 = m0.lerp(g0, w); a1 = m1.lerp(g1, w)        →  a = torch._foreach_lerp([m0, m1], [g0, g1], w)
    d0 = p0.addcdiv(x0, y0, value=s0); d1 = ...     →  torch._foreach_addcdiv([p0, p1], [x0, x1], [y0, y1], [s0, s1])

On CPU a foreach op is the per-tensor op run in a C++ loop (ATen's "slow path"): the same
kernel on the same operands, so the same bits, without one Python call per tensor
(``tests/test_fx_passes.py`` checks every rule of ``_RULES`` against the per-tensor op).
CUDA's fused foreach kernels have not been checked here: only CPU tensors are batched.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ._torch_foreach import foreach_op
from .passes import Rewrite, rewritten_copy

# Per-tensor op -> its foreach op, by operand form. ``tensors``: how many tensor operands
# (self first); ``scalar``: the position (int) or keyword (str) of the one Python-number
# operand, with its default; ``alpha``: a keyword every member must pass the same.
#   t.lerp(e, w)            == _foreach_lerp([t], [e], w)        (w: one number or a list)
#   t.addcdiv(a, b, value=v) == _foreach_addcdiv([t], [a], [b], v)
#   t.add(o, alpha=a)       == _foreach_add([t], [o], alpha=a)   (a: the same for all)
#   t.add(s) / t + s        == _foreach_add([t], s)
@dataclass(frozen=True)
class Rule:
    foreach: str
    tensors: int
    scalar: int | str | None = None
    default: float | int | None = None
    alpha: bool = False


_RULES = {  # (base op name, other operand is a number) -> Rule
    ("add", False): Rule("add", 2, alpha=True), ("add", True): Rule("add", 1, 1),
    ("sub", False): Rule("sub", 2, alpha=True), ("sub", True): Rule("sub", 1, 1),
    ("mul", False): Rule("mul", 2), ("mul", True): Rule("mul", 1, 1),
    ("div", False): Rule("div", 2), ("div", True): Rule("div", 1, 1),
    ("lerp", True): Rule("lerp", 2, 2),
    ("addcmul", True): Rule("addcmul", 3, "value", 1),
    ("addcdiv", True): Rule("addcdiv", 3, "value", 1),
    ("sqrt", False): Rule("sqrt", 1), ("neg", False): Rule("neg", 1),
    ("maximum", False): Rule("maximum", 2),
}
_METHODS = {"add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "sqrt", "neg"}
_INPLACE_METHODS = {"add_", "sub_", "mul_", "div_"}  # batched only on a private temporary
_FUNCTIONS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
              operator.truediv: "div", torch.maximum: "maximum", torch.sqrt: "sqrt"}
_KWARGS = {"add": {"alpha"}, "sub": {"alpha"}, "addcmul": {"value"}, "addcdiv": {"value"}}
# Pure arithmetic on Python numbers (``1 - beta1``, ``lr / bias_correction``).
_NUMBER_OPS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
               operator.neg, operator.floordiv, operator.mod}


@dataclass(frozen=True)
class _Use:
    """One batchable node in normal form."""
    rule: Rule
    inplace: bool
    tensors: tuple
    scalar: object  # None (no number operand), a Python number, or a number-valued Node
    alpha: object


def batch_foreach(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Groups nodes applying the same elementwise op (same operand form, dtype, ``alpha``;
    Python-number operands may differ: they go in a scalar list) to independent CPU tensors
    into one ``torch._foreach_*`` call per group, and returns a new GraphModule
    (``meta["foreach_groups"]``: how many; ``gm`` is not changed).

    Nodes are only reordered inside a run of pure nodes (these ops, ``clone``, arithmetic on
    Python numbers, and in-place updates of a temporary nothing else reads): within such a
    run each node is placed by its depth, and the members of a group share one depth, so no
    member depends on another and every operand is ready before the group. A node needing
    autograd, a view, a mutation of anything else, a change of grad mode or an unknown call
    ends a run. Graphs with dynamic sizes are left alone."""
    return rewritten_copy(gm, BATCH_FOREACH)


def _batch(graph: torch.fx.Graph) -> int:
    numbers = _merge_number_arithmetic(graph)
    return sum(_batch_run(graph, run, numbers) for run in _pure_runs(graph, numbers))


BATCH_FOREACH = Rewrite(_batch, "specularch.fx_lower.foreach.batch_foreach", "foreach_groups")


def _is_number(value) -> bool:
    return type(value) in (int, float)


def _merge_number_arithmetic(graph: torch.fx.Graph) -> set:
    """The number-valued nodes; identical arithmetic on them is merged into one node (pure:
    ``1 - beta1`` computed per parameter becomes one value the group can share)."""
    numbers, seen = set(), {}
    for node in list(graph.nodes):
        if node.op == "placeholder" and _is_number(node.meta.get("example")):
            numbers.add(node)
        elif node.op == "call_function" and node.target in _NUMBER_OPS and not node.kwargs and \
                all(a in numbers if isinstance(a, torch.fx.Node) else _is_number(a) for a in node.args):
            key = (node.target, tuple((a, None) if isinstance(a, torch.fx.Node) else (type(a), a)
                                      for a in node.args))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node
                numbers.add(node)
    return numbers


def _tensor(node) -> torch.Tensor | None:
    value = node.meta.get("example") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter) else None


def _use(node: torch.fx.Node, numbers: set) -> _Use | None:
    """``node`` in normal form when it is a batchable op on dense CPU floating tensors of one
    dtype and shape whose result needs no autograd; else None."""
    if node.op == "call_method" and (node.target in _METHODS or node.target in _INPLACE_METHODS):
        base, inplace = node.target.rstrip("_"), node.target.endswith("_")
    elif node.op == "call_function" and node.target in _FUNCTIONS:
        base, inplace = _FUNCTIONS[node.target], False
    else:
        return None
    args, kwargs = list(node.args), dict(node.kwargs)
    if set(kwargs) - _KWARGS.get(base, set()) or not args:
        return None
    number_form = len(args) > 1 and not isinstance(args[1], torch.fx.Node) or \
        (len(args) > 1 and args[1] in numbers)
    rule = _RULES.get((base, number_form or base in ("lerp", "addcmul", "addcdiv")))
    if rule is None:
        return None
    scalar = None
    if isinstance(rule.scalar, int):
        if len(args) != rule.scalar + 1 or kwargs:
            return None
        scalar = args.pop()
    elif isinstance(rule.scalar, str):
        if len(args) > rule.tensors + 1:
            return None
        scalar = args.pop() if len(args) == rule.tensors + 1 else kwargs.pop(rule.scalar, rule.default)
    alpha = kwargs.pop("alpha", None) if rule.alpha else None
    if kwargs or len(args) != rule.tensors or (scalar is not None and not (
            scalar in numbers if isinstance(scalar, torch.fx.Node) else _is_number(scalar))) or \
            (alpha is not None and not (alpha in numbers if isinstance(alpha, torch.fx.Node) else _is_number(alpha))):
        return None
    # Operands may require grad (a parameter read under no_grad); the result must not: then
    # no autograd graph is recorded, by the per-tensor op or by the foreach op.
    first, result = _tensor(args[0]), _tensor(node)
    examples = [_tensor(a) for a in args] + [result]
    if first is None or result is None or result.requires_grad or any(
            t is None or t.layout is not torch.strided or t.device.type != "cpu"
            or not t.dtype.is_floating_point or t.is_inference()
            or t.dtype != first.dtype or t.shape != first.shape for t in examples):
        return None
    if (scalar is not None or alpha is not None) and first.dtype in (torch.bfloat16, torch.float16):
        return None  # (CPU foreach ops round a number to the dtype first: shadow_heap/replay.py)
    return _Use(rule, inplace, tuple(args), scalar, alpha)


def _private(operand: torch.fx.Node, update: torch.fx.Node, numbers: set, position: dict) -> bool:
    """Whether ``update`` (in place) writes a fresh tensor that nothing reads before it: the
    result of a batchable op or a ``clone``; its other readers come after ``update`` (and
    are kept after it: ``_batch_run``)."""
    use = _use(operand, numbers)
    fresh = (use is not None and not use.inplace) or (
        operand.op == "call_method" and operand.target == "clone")
    return fresh and all(position[u] > position[update] for u in operand.users if u is not update)


def _movable(node: torch.fx.Node, numbers: set, position: dict) -> bool:
    if node in numbers:
        return node.op == "call_function"
    if node.op == "call_method" and node.target == "clone" and len(node.args) == 1 and not node.kwargs:
        example = _tensor(node)
        return example is not None and not example.requires_grad
    if node.op == "call_method" and node.target == "copy_" and len(node.args) == 2 and not node.kwargs:
        return _tensor(node) is not None and not _tensor(node).requires_grad and \
            _private(node.args[0], node, numbers, position)
    use = _use(node, numbers)
    return use is not None and (not use.inplace or _private(use.tensors[0], node, numbers, position))


def _pure_runs(graph: torch.fx.Graph, numbers: set) -> list[list]:
    position = {n: i for i, n in enumerate(graph.nodes)}
    runs, current = [], []
    for node in graph.nodes:
        if _movable(node, numbers, position):
            current.append(node)
        else:
            if len(current) > 1:
                runs.append(current)
            current = []
    return runs


def _group_key(node, use: _Use, depth: int):
    alpha = use.alpha if isinstance(use.alpha, torch.fx.Node) or use.alpha is None else (type(use.alpha), use.alpha)
    return (use.rule, use.inplace, _tensor(node).dtype, depth, use.scalar is None, alpha)


def _batch_run(graph: torch.fx.Graph, run: list, numbers: set) -> int:
    inside = set(run)
    depth, written_by = {}, {}  # written_by: a private temporary -> its in-place update
    for node in run:
        # a read of a temporary updated in place is placed after the update (not a data edge)
        after = [written_by[a] for a in node.all_input_nodes if written_by.get(a, node) is not node]
        depth[node] = 1 + max((depth[a] for a in [*node.all_input_nodes, *after] if a in inside),
                              default=-1)
        if node.op == "call_method" and node.target.endswith("_"):
            written_by[node.args[0]] = node
    members: dict = {}
    for node in run:
        use = _use(node, numbers)
        if use is not None:
            members.setdefault(_group_key(node, use, depth[node]), []).append(node)
    groups = {nodes[0]: nodes for nodes in members.values() if len(nodes) > 1}
    if not groups:
        return 0
    order = sorted(run, key=lambda n: depth[n])  # stable: program order within a depth
    grouped = {n for nodes in groups.values() for n in nodes}
    anchor = run[0].prev
    for node in order:
        if node in groups:
            anchor = _emit_group(graph, anchor, groups[node], numbers)
        elif node not in grouped:
            anchor.append(node)
            anchor = node
    return len(groups)


def _emit_group(graph: torch.fx.Graph, anchor: torch.fx.Node, nodes: list, numbers: set) -> torch.fx.Node:
    uses = [_use(n, numbers) for n in nodes]  # now: operands may be earlier groups' items
    rule = uses[0].rule
    args = [[u.tensors[i] for u in uses] for i in range(rule.tensors)]
    if rule.scalar is not None:
        scalars = [u.scalar for u in uses]
        same = all(s is scalars[0] or (not isinstance(s, torch.fx.Node) and
                                       not isinstance(scalars[0], torch.fx.Node) and
                                       type(s) is type(scalars[0]) and s == scalars[0]) for s in scalars)
        args.append(scalars[0] if same else scalars)
    kwargs = {"alpha": uses[0].alpha} if uses[0].alpha is not None else {}
    with graph.inserting_after(anchor):
        batched = graph.call_function(foreach_op(rule.foreach, uses[0].inplace), tuple(args), kwargs)
    batched.meta["example"] = None
    anchor = batched
    for i, (node, use) in enumerate(zip(nodes, uses)):
        if use.inplace:  # the temporaries were updated in place: later reads read them
            node.replace_all_uses_with(use.tensors[0])
        else:
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (batched, i))
            item.meta = dict(node.meta)
            node.replace_all_uses_with(item)
            anchor = item
        graph.erase_node(node)
    return anchor
