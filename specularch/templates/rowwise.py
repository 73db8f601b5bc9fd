"""Can a path graph run many instances at once, and in what form?

A path graph is *row-wise* when every value that depends on the node (its numbers, its
children's results) has a leading dimension of size 1 that each op carries through unchanged:
elementwise ops, ``linear``/``matmul`` by a context matrix, ``cat``/``chunk``/``split`` and
reductions on other dimensions, ``embedding`` lookups. Then stacking *n* instances along that
dimension and running the same graph once computes all of them: only rounding differs (a
matrix product of n rows may sum in another order than n products of one row). Anything else
(an op not known to act row by row, a reduction over the batch dimension, a per-node value
without that leading 1) keeps the path instance by instance, with the reason recorded.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from ..fx_lower.op_kinds import ELEMENTWISE_FUNCTIONS as _ELEMENTWISE
from ..fx_lower.op_kinds import ELEMENTWISE_METHODS as _ELEMENTWISE_METHODS

_ON_DIM = {torch.cat, torch.chunk, torch.split, torch.softmax, torch.log_softmax, F.softmax,
           F.log_softmax, torch.sum, torch.mean, torch.narrow, torch.stack}
_ON_DIM_METHODS = {"chunk", "split", "softmax", "log_softmax", "sum", "mean", "narrow"}
_FACTORIES = (torch.tensor,)


@dataclass
class Batched:
    """The batched form: the path graph with each ``torch.tensor([number])`` replaced by a
    placeholder that receives the numbers of all instances as one tensor."""

    gm: torch.fx.GraphModule
    number_dtypes: dict   # input position -> (dtype, device, rank) of the tensor of numbers
    deferred: tuple = ()  # input positions of weights whose gradient is made once per call
                          # (weight_grads.py): ``gm`` takes their ``Rows`` after the inputs


def batched_form(path) -> Batched | str:
    """The batched form of ``path``, or why it has none."""
    graph = path.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    row: set = set()
    numbers: dict = {}
    for position, (node, inp) in enumerate(zip(placeholders, path.inputs)):
        example = node.meta.get("example")
        if inp.kind == "ctx":
            continue
        if isinstance(example, torch.Tensor):
            if example.dim() == 0 or example.shape[0] != 1:
                return f"per-node input {node.name} has no leading dimension of size 1"
            row.add(node)
            continue
        found = _number_factory(node)
        if found is None:
            return f"the node's number {node.name} is used other than in torch.tensor([x])"
        factory, depth = found
        example = factory.meta["example"]
        numbers[position] = (example.dtype, example.device, depth)
        row.add(factory)
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or node in row:
            continue
        if not any(isinstance(a, torch.fx.Node) and a in row for a in node.all_input_nodes):
            continue  # computed from the context alone: once per batch
        why = _row_wise(node, row)
        if why is not None:
            return f"{_name(node)}: {why}"
        row.add(node)
    outputs = graph.find_nodes(op="output")[0].args[0]
    for out in outputs if isinstance(outputs, tuple) else (outputs,):
        if out not in row:
            return "an output does not depend on the node"
    return Batched(_rewrite(path.gm, numbers), numbers)


def _number_factory(placeholder: torch.fx.Node):
    """The ``torch.tensor([x])`` (or ``[[x]]``, ...) that is the number's only use, and how
    deeply ``x`` is nested (the per-instance tensor's rank)."""
    users = list(placeholder.users)
    if len(users) != 1:
        return None
    user = users[0]
    if user.op != "call_function" or user.target not in _FACTORIES or not user.args \
            or not set(user.kwargs) <= {"device", "dtype"}:
        return None
    data, depth = user.args[0], 0
    while isinstance(data, (list, tuple)) and len(data) == 1:
        data, depth = data[0], depth + 1
    return (user, depth) if data is placeholder and depth else None


def _row_wise(node: torch.fx.Node, row: set) -> str | None:
    example = _example(node)
    if node.target is operator.getitem and isinstance(node.args[1], int):
        if not isinstance(node.args[0], torch.fx.Node) \
                or isinstance(_example(node.args[0]), torch.Tensor):
            return "an indexing of a tensor (its first dimension is the batch's)"
        return None if _rows(example) else "an item without a leading 1"
    if not _rows(example):
        return "its result has no leading dimension of size 1"
    ndim = _ndim(example)
    target, method = node.target, node.op == "call_method"
    if (method and target in _ELEMENTWISE_METHODS) or (not method and target in _ELEMENTWISE):
        row_args = [a for a in _flat(node.args) + _flat(list(node.kwargs.values()))
                    if isinstance(a, torch.fx.Node) and a in row]
        if any(_ndim(_example(a)) != ndim for a in row_args):
            return "a per-node operand of another rank than the result"
        return None
    if _is_linear(target) or target in (torch.matmul, torch.mm, operator.matmul) or (
            method and target in ("matmul", "mm")):
        first = node.args[0]
        rest = [a for a in node.all_input_nodes if a is not first]
        if first in row and not any(a in row for a in rest):
            return None
        return "a matrix product whose second operand depends on the node"
    if target in (F.embedding, torch.embedding):
        if node.args[1] in row or not _rows(_example(node.args[0])):
            return "an embedding lookup whose table depends on the node"
        return None
    if (method and target in _ON_DIM_METHODS) or (not method and target in _ON_DIM):
        return _dim_not_zero(node, ndim)
    return "not known to act row by row"


_DIM_ARG = {"cat": (1, 0), "stack": (1, 0), "chunk": (2, 0), "split": (2, 0),
            "narrow": (1, None), "softmax": (1, None), "log_softmax": (1, None),
            "sum": (1, None), "mean": (1, None)}


def _dim_not_zero(node: torch.fx.Node, ndim: int) -> str | None:
    name = node.target if isinstance(node.target, str) else node.target.__name__
    position, default = _DIM_ARG[name]
    dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else default)
    if not isinstance(dim, int):
        return "an op over all dimensions"
    return None if dim % max(ndim, 1) != 0 else "an op over the batch dimension"


def _is_linear(target) -> bool:
    return target is F.linear or getattr(target, "__name__", "") == "linear"


def _example(node: torch.fx.Node):
    """The node's example value; a tuple-valued op (chunk) has it on its getitem users."""
    example = node.meta.get("example")
    if example is None and node.users and all(u.target is operator.getitem for u in node.users):
        items = sorted((u.args[1], u.meta.get("example")) for u in node.users)
        return tuple(e for _, e in items)
    return example


def _rows(example) -> bool:
    if isinstance(example, torch.Tensor):
        return example.dim() > 0 and example.shape[0] == 1
    if isinstance(example, (tuple, list)):
        return bool(example) and all(_rows(e) for e in example)
    return False


def _ndim(example) -> int:
    if isinstance(example, torch.Tensor):
        return example.dim()
    if isinstance(example, (tuple, list)) and example:
        return _ndim(example[0])
    return -1


def _flat(args) -> list:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out


def _name(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__",
                                                                       str(node.target))
    return f"`{target}`"


def _rewrite(gm: torch.fx.GraphModule, numbers: dict) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    factories = {}
    for position in numbers:
        factories[next(iter(placeholders[position].users))] = placeholders[position]
    for node in gm.graph.nodes:
        if node in factories:
            env[node] = env[factories[node]]  # the numbers arrive as one tensor already
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    return torch.fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}_batched")
