"""Graph inputs: how a tensor, a ``torch.Generator`` or a Python number read from outside
the call becomes a placeholder of the graph, with the guards that reading it implies and the
source the entry reads it from on every call. ``Tracer.wrap`` decides what a real object
becomes; what becomes a graph input is made here.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import types
from typing import Any

import torch
import torch.fx

from ..guards import AliasGuard, InferenceGuard, TensorGuard, TypeGuard
from ..guards.lists import ObjectListGuard, TensorListGuard, leaf_state, list_tensors, uniform, walked
from ..guards.sources import LocalSource, Source
from ..records import Unsupported
from ._torch_dispatch import write_key
from .rolled.objects import ObjectListV, plain_objects
from .values.rolled import TensorListV
from .values.symint import SymV
from .values import GeneratorV, ObjV, TensorV, Value


def wrap_arguments(tracer, argnames: tuple, slots: tuple) -> dict[str, Value]:
    """The values of the frame's arguments, generalised as ``tracer.assumptions`` say. An
    argument the code never reads is not wrapped: nothing the call does depends on it, so
    guarding it (a list's length, a tensor's shape) would only capture again."""
    dims, scalars = tracer.assumptions.dynamic_dims, tracer.assumptions.symbolic_scalars
    unread = unread_arguments(tracer.code, argnames)
    return {name: ObjV(value, LocalSource(i, name)) if name in unread else
            wrap_argument(tracer, value, LocalSource(i, name), dims.get(i, frozenset()), i in scalars)
            for i, (name, value) in enumerate(zip(argnames, slots))}


_INTROSPECTION = frozenset({"locals", "vars", "super", "dir", "eval", "exec", "_getframe",
                            "currentframe", "f_locals"})


@functools.lru_cache(maxsize=512)
def unread_arguments(code: types.CodeType, argnames: tuple) -> frozenset:
    """The arguments no instruction of ``code`` reads (only ``STORE_FAST`` names them), in
    code that cannot reach its frame's locals another way (``locals()``, zero-argument
    ``super()``, ``sys._getframe()``)."""
    if _INTROSPECTION & set(code.co_names):
        return frozenset()
    named = {i.argval for i in dis.get_instructions(code) if i.opname != "STORE_FAST"
             and isinstance(i.argval, str)}
    return frozenset(argnames) - named


def wrap_argument(tracer, obj: Any, source: Source, dynamic_dims: frozenset,
                  symbolic: bool) -> Value:
    """An argument slot, generalised as profiling/relaxation decided."""
    if dynamic_dims and isinstance(obj, torch.Tensor) and id(obj) not in tracer._by_tensor_id:
        return wrap_tensor(tracer, obj, source, frozenset(d for d in dynamic_dims if d < obj.dim()))
    if symbolic and type(obj) in (int, float):
        tracer.add_guard(TypeGuard, source, type(obj))
        node = placeholder(tracer, node_name(source))
        node.meta["example"] = obj
        tracer.input_sources.append(source)
        value = SymV(obj, node, source.expr(), tracer, str(source))
        tracer._by_source[source] = value
        return value
    return tracer.wrap(obj, source)


def wrap_tensor(tracer, t: torch.Tensor, source: Source | None,
                dyn_dims: frozenset = frozenset()) -> TensorV:
    """``t`` read from ``source``: a guarded placeholder (``dyn_dims``: sizes left free), or
    a constant of the graph when it has no source; one value per tensor however reached."""
    seen = tracer._by_tensor_id.get(id(t))
    if seen is not None:
        if source is not None and seen.source is not None:
            tracer.add_guard(AliasGuard, source, other=seen.source)
        return seen
    if source is None:
        name = f"_const{len(tracer.constants)}"
        tracer.constants[name] = t
        node = tracer.graph.get_attr(name)
    else:
        tracer.add_guard(TensorGuard, source, t.__class__, t.dtype, t.device, tuple(t.shape),
                         tuple(t.stride()), t.requires_grad, dynamic=dyn_dims,
                         contiguous=t.is_contiguous(), leaf=leaf_state(t))
        if t.is_inference():  # its views are inference tensors (see grad_mode.output_spec)
            tracer.add_guard(InferenceGuard, source)
        node = placeholder(tracer, node_name(source))
        tracer.input_sources.append(source)
    node.meta["example"] = t
    value = TensorV(node, t, source, dynamic=bool(dyn_dims), dyn_dims=dyn_dims, real=t)
    node.meta["value"] = value
    tracer._by_tensor_id[id(t)] = value
    key = write_key(t)
    sharer = tracer._external.setdefault(key, value)
    if sharer is not value:  # another input shares this memory (a view made earlier)
        if sharer.updated:
            raise Unsupported("input_mutation", f"{source} shares memory with "
                              f"{sharer.source}, which this call wrote in place before")
        tracer.viewed.add(key)  # in-place writes into this memory are refused
    return value


def wrap_generator(tracer, g: torch.Generator, source: Source | None) -> GeneratorV:
    """A ``torch.Generator`` is a graph input (the graph draws from the caller's generator
    on every call); capture draws from it too, so its state is put back afterwards."""
    if source is None:
        raise Unsupported("unsupported_call", "a torch.Generator that is not reached through "
                          "an argument, a global or an attribute cannot be passed to the graph")
    tracer.generators.setdefault(id(g), (g, g.get_state()))
    tracer.add_guard(TypeGuard, source, type(g))
    node = placeholder(tracer, node_name(source))
    node.meta["example"] = g
    tracer.input_sources.append(source)
    return GeneratorV(g, source, node=node)


def wrap_tensor_list(tracer, obj: list, source: Source, where: str) -> Value | None:
    """The list at ``source`` as one graph input, for the rolled loop at ``where`` over it
    (``rolled/lists.py``), or its objects' (``rolled/objects.py``); None when its
    items no longer fit (it changed since)."""
    if plain_objects(obj):
        tracer.guards.add(ObjectListGuard(source, item_type=type(obj[0]), where=tracer.where()))
        return ObjectListV(*_whole_list(tracer, obj, source), where, source)
    if not uniform(obj):
        return None
    tracer.guards.add(TensorListGuard.of(source, obj[0], leaf_state, tracer.where()))
    node, items, length = _whole_list(tracer, obj, source)
    value = TensorListV(node, items, length, where, source)
    for t in list_tensors(obj):  # a write into an item is refused: no source could commit it
        key = write_key(t)
        if key in tracer._external:  # another input: the graph would read the old value
            tracer.viewed.add(key)
        tracer._external.setdefault(key, TensorV(node, t))
    return value


def wrap_walk(tracer, source: Source, link: str, nodes: list, where: str) -> ObjectListV:
    """The nodes of the linked walk from the object at ``source`` by ``link`` (``nodes`` at
    capture), walked when the graph runs, for the rolled loop at ``where``
    (``rolled/walk.py``); guarded: every node of item 0's class."""
    tracer.guards.add(ObjectListGuard(source, item_type=type(nodes[0]), walk=link,
                                      where=tracer.where()))
    head = next((w.node.args[0] for w in tracer.walks if w.source == source), None)
    if head is None:  # a second walk from the same head (a helper called twice) shares its input
        head = placeholder(tracer, node_name(source))
        head.meta["example"] = nodes[0]
        tracer.input_sources.append(source)
    node = tracer.graph.call_function(walked, (head, link))
    node.meta["example"] = list(nodes)
    length = tracer.graph.call_function(len, (node,))
    length.meta["example"] = len(nodes)
    value = ObjectListV(node, list(nodes), SymV(len(nodes), length, None, tracer,
                                                f"the nodes of {source} walked by .{link}"),
                        where, source)
    value.walk = link
    tracer.walks.append(value)  # its nodes' tensors are guarded against written ones (alias_guards.py)
    return value


def _whole_list(tracer, obj: list, source: Source) -> tuple:
    """(its node, its items, its length) of a list that is one graph input."""
    node = placeholder(tracer, node_name(source))
    node.meta["example"] = list(obj)
    tracer.input_sources.append(source)
    length = tracer.graph.call_function(len, (node,))
    length.meta["example"] = len(obj)
    return node, list(obj), SymV(len(obj), length, f"len({source.expr()})", tracer, f"len({source})")


def placeholder(tracer, name: str) -> torch.fx.Node:
    """A new input of the graph. Inputs are read while ops are already recorded, but FX
    wants every placeholder before the first op: each goes after the last one."""
    anchor = tracer._last_placeholder
    if anchor is None:
        first = next(iter(tracer.graph.nodes), None)
        ctx = tracer.graph.inserting_before(first) if first is not None else contextlib.nullcontext()
    else:
        ctx = tracer.graph.inserting_after(anchor)
    with ctx:
        node = tracer.graph.placeholder(name)
    tracer._last_placeholder = node
    return node


def node_name(source: Source) -> str:
    text = "".join(c if c.isalnum() else "_" for c in str(source))
    while "__" in text:
        text = text.replace("__", "_")
    return text.strip("_") or "input"
