"""Graph passes. Each takes a GraphModule and returns a new one (the input is not changed);
the result's ``meta["constructed_by"]`` names the pass."""
from __future__ import annotations

import copy
import heapq
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

# call_method ops whose Python-number keyword becomes a multiplication by a 0-d tensor:
# method -> (keyword, out-of-place form using the scaled operand).
_SCALED_KEYWORD = {"add": "alpha", "add_": "alpha", "sub": "alpha", "sub_": "alpha",
                   "addcdiv_": "value", "addcmul_": "value"}


def example_inputs(gm: torch.fx.GraphModule) -> list:
    """The values capture saw for ``gm``'s inputs (each placeholder's ``example``), in order:
    what a backend compiles the graph for."""
    return [n.meta.get("example") for n in gm.graph.nodes if n.op == "placeholder"]


def scalar_inputs_as_tensors(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[int]]:
    """Python-number inputs (a learning rate, Adam's step count) become 0-d float64 tensor
    inputs, so a compiler that would specialise on a number's value cannot. Keyword scalars
    (``alpha=``, ``value=``) fed by them are folded into the tensor operand:
    ``p.add_(g, alpha=a)`` → ``p.add_(g * a)``; ``p.addcdiv_(t1, t2, value=v)`` →
    ``p.add_(t1 / t2 * v)``. Where such a number meets a tensor it is first cast to the
    dtype of that op's result in eager (``(loss * lr.to(float32))``): a Python number does
    not promote a tensor's dtype, a 0-d float64 tensor promotes a 0-d float32 one (a
    ``loss * scale`` came back float64). Returns the new module and the positions of
    converted inputs."""
    new = copy.deepcopy(gm)
    graph = new.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    converted = [i for i, n in enumerate(placeholders) if isinstance(n.meta.get("example"), (int, float))]
    numbers = {placeholders[i] for i in converted}
    for node in list(graph.nodes):  # arithmetic on those numbers only: 0-d tensors too now
        if node.op == "call_function" and node.target.__module__ in ("_operator", "operator") and \
                any(isinstance(a, torch.fx.Node) and a in numbers for a in node.args) and \
                not isinstance(node.meta.get("example"), torch.Tensor):
            numbers.add(node)
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in _SCALED_KEYWORD:
            continue
        key = _SCALED_KEYWORD[node.target]
        scale = node.kwargs.get(key)
        if not isinstance(scale, torch.fx.Node) or scale not in numbers:
            continue
        with graph.inserting_before(node):
            if node.target == "addcdiv_":
                operand = graph.call_function(operator.truediv, (node.args[1], node.args[2]))
            elif node.target == "addcmul_":
                operand = graph.call_function(operator.mul, (node.args[1], node.args[2]))
            else:
                operand = node.args[1]
            scaled = graph.call_function(operator.mul, (operand, _as_dtype_of(graph, scale, node)))
        kwargs = {k: v for k, v in node.kwargs.items() if k != key}
        target = node.target if node.target in ("add", "add_", "sub", "sub_") else "add_"
        node.target = target
        node.args = (node.args[0], scaled)
        node.kwargs = kwargs
    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method") and node not in numbers:
            for number in [a for a in node.all_input_nodes if a in numbers]:
                node.replace_input_with(number, _as_dtype_of(graph, number, node))
    graph.lint()
    new.recompile()
    new.meta = dict(gm.meta, constructed_by="specularch.fx_lower.passes.scalar_inputs_as_tensors")
    return new, converted


def _as_dtype_of(graph: torch.fx.Graph, number: torch.fx.Node, user: torch.fx.Node) -> torch.fx.Node:
    """``number`` (a 0-d tensor now) cast, before ``user``, to the dtype of ``user``'s result
    in eager; itself where that is not known."""
    dtype = getattr(user.meta.get("example"), "dtype", None)
    if dtype is None:
        return number
    with graph.inserting_before(user):
        return graph.call_method("to", (number, dtype))


# Python numbers a graph may return, as the 0-d tensors a flattened graph returns them in;
# ``.item()`` of such a tensor gives back a number of the same type.
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


def number_outputs(gm: torch.fx.GraphModule) -> list[int] | None:
    """Positions of the graph's outputs that are Python numbers (a dynamic batch size the
    program returns, arithmetic on a number input), or None where some output is neither a
    tensor nor such a number (a compiled graph returns tensors only)."""
    positions = []
    for i, value in enumerate(graph_outputs(gm)):
        example = value.meta.get("example") if isinstance(value, torch.fx.Node) else value
        if isinstance(example, torch.Tensor):
            continue
        if type(example) not in _NUMBER_DTYPES or not isinstance(value, torch.fx.Node):
            return None
        positions.append(i)
    return positions


def number_outputs_as_tensors(gm: torch.fx.GraphModule, positions: list[int]) -> None:
    """Makes the outputs at ``positions`` (``number_outputs``) 0-d tensors, in place: a
    symbolic size ``s`` becomes ``scalar_tensor(s)`` (int64, float64 or bool, as the number's
    type), a number input made a tensor (``scalar_inputs_as_tensors``) stays one. The caller
    turns them back with ``.item()``."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    values = list(graph_outputs(gm))
    with gm.graph.inserting_before(output):
        for i in positions:
            dtype = _NUMBER_DTYPES[type(values[i].meta["example"])]
            values[i] = gm.graph.call_function(number_as_tensor, (values[i], dtype))
    output.args = (type(output.args[0])(values) if isinstance(output.args[0], (tuple, list))
                   else values[0],)
    gm.graph.lint()
    gm.recompile()


def number_as_tensor(value, dtype: torch.dtype) -> torch.Tensor:
    """A number output as a 0-d tensor of ``dtype`` (traced by ``make_fx``: a symbolic size
    becomes ``aten.scalar_tensor``). A number input's arithmetic already is a 0-d tensor;
    one of another dtype (int64 ``n / 3`` gives float32 where Python gives a float64) raises
    rather than return another number than eager."""
    if isinstance(value, torch.Tensor):
        if value.dtype != dtype:
            raise TypeError(f"a number output computed as a {value.dtype} tensor, not {dtype}")
        return value
    return torch.scalar_tensor(value, dtype=dtype)


def graph_outputs(gm: torch.fx.GraphModule) -> list:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    values = output.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def as_tensor_input(value, device=None) -> torch.Tensor:
    """A Python-number graph input as the 0-d tensor ``scalar_inputs_as_tensors`` expects."""
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64,
                        device=device)


# In-place methods a fresh clone may be folded into, and their out-of-place forms:
#   c = p.clone(); c.op_(*args)  ==  c = p.op(*args)
# The same kernel writes every element from the same operands, only into a fresh tensor
# instead of over the copy: the bits are equal, and one pass over memory (the clone) is gone.
_OUT_OF_PLACE = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "lerp_": "lerp",
                 "addcmul_": "addcmul", "addcdiv_": "addcdiv"}


def fold_clones(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``c = p.clone()`` followed at once by in-place updates of ``c`` (how capture computes a
    write into a parameter, ``.grad`` or optimizer state: ``symbolic/tracer.py``
    ``_functionalize``) becomes the out-of-place ops: ``c = p.clone(); c.lerp_(g, w);``
    → ``c = p.lerp(g, w)``; ``c.mul_(b); c.addcmul_(g, g, value=v)`` → ``t = c.mul(b);
    t.addcmul(g, g, value=v)``. Later reads of ``c`` read the last result.

    A chain is folded only when it cannot change a bit or an alias: the first update directly
    follows the clone (nothing can write ``p`` in between), ``c`` is not read between the
    updates (no view of it sees a later one), nothing in it requires grad, and each
    out-of-place op gives, on meta tensors, the clone's dtype, shape and strides. Graphs with
    dynamic sizes are left alone (strides checked at one shape need not hold at another).
    Returns a new GraphModule (the input is not changed) sharing ``gm``'s attributes."""
    return rewritten_copy(gm, FOLD_CLONES)


def _fold(graph: torch.fx.Graph) -> int:
    # The output node reads most updated tensors: replacing its inputs one alias at a
    # time rewrites its (program-sized) argument tuple per alias, so it is done once.
    renamed: dict = {}
    count = sum(_fold_chain(graph, node, renamed) for node in list(graph.nodes)
                if node.op == "call_method" and node.target == "clone")
    if renamed:
        output = next(iter(reversed(graph.nodes)))
        output.args = torch.fx.node.map_arg(output.args, lambda n: renamed.get(n, n))
        for alias in reversed(renamed):
            graph.erase_node(alias)
    return count


@dataclass(frozen=True)
class Rewrite:
    """A graph rewrite run by ``rewritten_copy``: ``run(graph) -> how many rewrites`` changes
    the graph in place; ``constructed_by`` names the pass, ``count_key`` the ``meta`` entry
    that gets the count."""
    run: Callable[[torch.fx.Graph], int]
    constructed_by: str
    count_key: str


FOLD_CLONES = Rewrite(_fold, "specularch.fx_lower.passes.fold_clones", "folded_clones")


def rewritten_copy(gm: torch.fx.GraphModule, *rewrites: Rewrite) -> torch.fx.GraphModule:
    """A new GraphModule sharing ``gm``'s attributes, over a copy of its graph changed by
    each rewrite in turn (graphs with dynamic sizes are left as they are); ``meta`` says
    which pass made it (the last one) and each pass's count. Several rewrites share one
    copy of the graph and one generation of its code: both cost the graph's size."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    counts = {r.count_key: 0 if gm.meta.get("dynamic_dims") else r.run(graph) for r in rewrites}
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(gm.meta, constructed_by=rewrites[-1].constructed_by, **counts)
    if any(counts.values()):
        graph.lint()
    return new


def _fold_chain(graph: torch.fx.Graph, clone: torch.fx.Node, renamed: dict) -> int:
    """Folds the chain of ``clone`` (see ``fold_clones``); the aliases the output node still
    reads go into ``renamed`` (alias -> its folded value) for the caller to replace and
    erase."""
    example = clone.meta.get("example")
    if len(clone.args) != 1 or clone.kwargs or not isinstance(example, torch.Tensor) or \
            example.requires_grad or not isinstance(clone.args[0], torch.fx.Node):
        return 0
    chain = _update_chain(clone)
    aliases = {clone, *chain}
    if not chain or not _same_layout(clone, chain, aliases):
        return 0
    current = clone.args[0]
    for op in chain:
        substitute = lambda n, cur=current: cur if n in aliases else n  # noqa: E731
        with graph.inserting_before(op):
            new = graph.call_method(_OUT_OF_PLACE[op.target],
                                    torch.fx.node.map_arg(op.args, substitute),
                                    torch.fx.node.map_arg(op.kwargs, substitute))
        new.meta = dict(op.meta, example=example, mutates=False)
        current = new
    for alias in [clone, *chain]:
        alias.replace_all_uses_with(current, delete_user_cb=lambda user: user.op != "output")
    for alias in reversed([clone, *chain]):
        if alias.users:
            renamed[alias] = current
        else:
            graph.erase_node(alias)
    return 1


def _update_chain(clone: torch.fx.Node) -> list:
    """The in-place updates of ``clone``'s tensor, in program order: the first must be the
    node right after the clone, the chain ends at the first other read of the tensor.
    Only the readers of the clone and of its updates are visited (in the order fx keeps for
    nodes), not the nodes in between: the walk costs the chain's size, not the graph's."""
    first = clone.next
    if not _updates(first, {clone}):
        return []
    aliases, chain = {clone, first}, [first]
    readers = [u for a in aliases for u in a.users if u is not first]
    heapq.heapify(readers)
    seen = set(readers)
    while readers:
        node = heapq.heappop(readers)
        if node.op == "output" or not _updates(node, aliases):
            break  # a read: from here on `c` holds its final value
        chain.append(node)
        aliases.add(node)
        for user in node.users:
            if user not in seen:
                seen.add(user)
                heapq.heappush(readers, user)
    return chain


def _updates(node: torch.fx.Node, aliases: set) -> bool:
    """Whether ``node`` is an in-place update (with an out-of-place form) of an alias."""
    return node.op == "call_method" and node.target in _OUT_OF_PLACE and bool(node.args) \
        and node.args[0] in aliases


def _same_layout(clone: torch.fx.Node, chain: list, aliases: set) -> bool:
    """Whether each out-of-place op, run on meta tensors shaped like its operands, gives
    the clone's dtype, shape and strides (type promotion or a layout picked from another
    operand would show here)."""
    example = clone.meta["example"]
    want = (example.dtype, example.shape, example.stride())

    def meta(n):
        value = n.meta.get("example")
        if isinstance(value, torch.Tensor):
            if value.layout is not torch.strided:
                raise TypeError("not strided")
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device="meta")
        if type(value) in (int, float, bool):
            return value
        if value is None and n.op == "call_function" and example.dtype.is_floating_point and \
                getattr(n.target, "__module__", "") in ("_operator", "operator"):
            return 1.0  # arithmetic on Python-number inputs (``1 - beta``): a number, which
            # leaves a floating tensor's dtype as it is whatever its type
        raise TypeError(f"operand {n} has no example")

    try:
        current = meta(clone.args[0])
        for op in chain:
            to_meta = lambda n, cur=current: cur if n in aliases else meta(n)  # noqa: E731
            args = torch.fx.node.map_aggregate(op.args, lambda a: to_meta(a) if isinstance(a, torch.fx.Node) else a)
            kwargs = torch.fx.node.map_aggregate(op.kwargs, lambda a: to_meta(a) if isinstance(a, torch.fx.Node) else a)
            current = getattr(args[0], _OUT_OF_PLACE[op.target])(*args[1:], **kwargs)
            if (current.dtype, current.shape, current.stride()) != want:
                return False
    except Exception:
        return False
    source = clone.args[0].meta.get("example")
    # the clone kept the source's strides (dense source): the kernel walks the same layout
    return isinstance(source, torch.Tensor) and source.stride() == example.stride() and \
        source.dtype == example.dtype
