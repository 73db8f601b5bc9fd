"""A compile job as a file: a captured graph, what its inputs look like, and where the
compiled artefact goes, written by the program (``process.py``) and read by the worker
process (``compile_worker.py``).

The graph travels as its nodes in order, each ``(op, name, target, args, kwargs)`` with the
nodes it reads named (``_Ref``), targets pickled by reference, and is rebuilt node by node.
Not as a pickled ``GraphModule``: that one is rebuilt by tracing its generated code again,
which drops what a tracer does not record (``set_grad_enabled`` calls) and every ``meta``.
Nor as a pickled ``torch.fx.Graph``: its nodes are a linked list, which pickle walks
recursively, a level per node (Inception's 1,640-node step raised ``RecursionError``). Inputs
travel as metadata only (shape, stride, dtype, device): the compilers trace with fake
tensors and never read values; Python numbers travel as they are (they are cheap, and
``scalar_inputs_as_tensors`` must see that they are numbers). The other nodes' examples
travel as metadata too (a number input is cast to the dtype of the op it meets; without
them a ``loss * scale`` came back float64). Capture-time constants (``get_attr``) travel
with their values: they are baked into the compiled code.
"""
from __future__ import annotations

import importlib
import io
import pickle
import sys
from typing import Any

import torch
import torch.fx

# Modules whose functions a graph sent to a worker may call: unpickling a target imports
# its module, and a user's module would run the user's top-level code in the worker.
TRUSTED = ("torch", "operator", "_operator", "math", "builtins", "specularch")


def unsendable(gm: torch.fx.GraphModule) -> str | None:
    """Why ``gm`` cannot be compiled in a worker process; None when it can."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            example = node.meta.get("example")
            if not isinstance(example, (torch.Tensor, bool, int, float)):
                return f"graph input {node.name} is a {type(example).__name__}"
        elif node.op == "call_function":
            module = getattr(node.target, "__module__", None) or ""
            if module.split(".")[0] not in TRUSTED:
                return f"it calls {getattr(node.target, '__qualname__', node.target)} of " \
                       f"module {module or '?'} (a worker process imports only torch)"
        elif node.op == "call_module":
            return "it calls a module"
    return None


def pack(gm: torch.fx.GraphModule, examples: list, **fields: Any) -> dict:
    """``gm`` and its inputs' metadata as a dict of plain, picklable values (plus ``fields``:
    backend, cache settings). Raises what pickling raises for an unsendable target."""
    return {"graph": _dumps(_flat(gm.graph)), "meta": {k: v for k, v in gm.meta.items() if _plain(v)},
            "attrs": {n.target: _attribute(gm, n.target) for n in gm.graph.nodes
                      if n.op == "get_attr"},
            "inputs": [_spec(v) for v in examples],
            "examples": {n.name: _spec(n.meta["example"]) for n in gm.graph.nodes
                         if n.op != "placeholder" and _sendable_example(n.meta.get("example"))},
            **fields}


def unpack(job: dict) -> tuple[torch.fx.GraphModule, list]:
    """The graph module and example inputs ``pack`` described (inputs: zero-filled tensors
    of the same layout)."""
    graph = _rebuilt(pickle.loads(job["graph"]))
    gm = torch.fx.GraphModule(job["attrs"], graph)
    gm.meta.update(job["meta"])
    examples = [_example(spec) for spec in job["inputs"]]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, examples):
        node.meta["example"] = example
    for node in gm.graph.nodes:
        if node.name in job.get("examples", {}):
            node.meta["example"] = _example(job["examples"][node.name], device="meta")
    return gm, examples


class _Ref:
    """A node read by another node, by its name (in a graph's flat form)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return _Ref, (self.name,)


def _flat(graph: torch.fx.Graph) -> list[tuple]:
    """``graph``'s nodes in order, each ``(op, name, target, args, kwargs, type)``, the nodes
    in its arguments as ``_Ref``: what pickle writes without recursing along the graph."""
    return [(n.op, n.name, n.target,
             *torch.fx.map_arg((n.args, n.kwargs), lambda a: _Ref(a.name)), n.type)
            for n in graph.nodes]


def _rebuilt(rows: list[tuple]) -> torch.fx.Graph:
    """The graph ``_flat`` described."""
    graph, nodes = torch.fx.Graph(), {}

    def node(value):
        return nodes[value.name] if isinstance(value, _Ref) else value
    for op, name, target, args, kwargs, type_ in rows:
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), node)
        nodes[name] = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_)
    return graph


def _attribute(gm: torch.fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value.detach() if isinstance(value, torch.Tensor) else value


def _spec(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, str(value.device),
                value.requires_grad, isinstance(value, torch.nn.Parameter))
    return ("value", value)


def _sendable_example(value) -> bool:
    """Other nodes' examples travel too (as metadata: their dtypes decide casts of number
    inputs, ``passes.scalar_inputs_as_tensors``), where they are a tensor or a number."""
    return isinstance(value, (bool, int, float)) or (
        isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter)
        and not value.is_meta)


def _example(spec: tuple, device: str | None = None):
    """The value ``_spec`` described: a zero-filled tensor of that layout (on ``device``,
    ``meta`` for a graph's inner values: no memory), or the number."""
    if spec[0] == "value":
        return spec[1]
    _, shape, stride, dtype, tensor_device, requires_grad, parameter = spec
    tensor = torch.empty_strided(shape, stride, dtype=dtype, device=device or tensor_device).zero_()
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _plain(value) -> bool:
    """A value made of builtins only (a graph's ``meta`` flags and lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


class _Pickler(pickle.Pickler):
    """Functions pickled as the attribute of their module they are (``F.max_pool2d`` is a
    function made inside ``boolean_dispatch``, which pickle cannot name by ``__qualname__``)."""

    def reducer_override(self, obj):
        module, name = getattr(obj, "__module__", None), getattr(obj, "__name__", None)
        if "<locals>" in str(getattr(obj, "__qualname__", "")) and isinstance(module, str) and \
                isinstance(name, str) and \
                module.split(".")[0] in TRUSTED and \
                getattr(sys.modules.get(module), name, None) is obj:
            return _by_name, (module, name)
        return NotImplemented


def _by_name(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(value)
    return buffer.getvalue()
