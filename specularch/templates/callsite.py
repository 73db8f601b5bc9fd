"""Where capture meets recursion (called by ``symbolic.calls.inline`` for every inlined call).

* Inside a path capture, a call of the family's own function is a hole (``paths.py``).
* In an ordinary capture, a call of a function already on the symbolic frame stack is a
  recursion: it becomes one graph node that runs the template family on whatever structure
  the graph is given (``Family.run``), instead of unrolling this structure into the graph.
  When the function cannot be a template (it writes state, recurses on computed values,
  ...), the capture unrolls it as before and ``explain()`` says why.
"""
from __future__ import annotations

import dataclasses
import types

from torch import nn

from ..config import config
from ..guards.sources import LocalSource, Source
from ..records import Unsupported
from ..shadow_heap.writes import (DelAttr, Effect, Print, ReplayTensor, SetAttr, UpdateTensor)
from ..symbolic.inputs import placeholder
from ..symbolic.values import ConstV, DictV, ListV, ObjV, TensorV, TupleV, Value
from .family import TemplateMiss, family_for
from .paths import check_signature

_CONTEXT_TYPES = (nn.Module, types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)

def recursive_call(tracer, code: types.CodeType, globals_: dict, bound: dict[str, Value]):
    """The call's value when it is a recursion handled by templates, else None (inline it)."""
    template = tracer.template
    if template is not None:
        return template.hole(tracer, bound) if code is template.family.code else None
    if config.templates == "off" or code in tracer.unrolled:
        return None
    recursing = any(frame.code is code for frame in tracer.frames)
    if not recursing and not (_names_itself(code) and _looks_structural(bound)):
        return None
    try:
        return _family_call(tracer, code, globals_, bound)
    except (Unsupported, TemplateMiss) as e:
        reason = getattr(e, "explanation", None) or str(e)
        tracer.unrolled[code] = reason  # explain(): capture keeps it on the graph module
        return None


def _names_itself(code: types.CodeType) -> bool:
    """Whether the function may call itself (``self.encode(...)``, ``walk(...)``): then its
    first call is already a template call, so the root of the structure is a template
    instance too (one wavefront per structure, not one per child of the root)."""
    return _names(code, code.co_name)


def _names(code: types.CodeType, name: str) -> bool:
    # comprehensions and generator expressions are nested code objects in 3.11
    return name in code.co_names or any(
        isinstance(c, types.CodeType) and _names(c, name) for c in code.co_consts)


def _looks_structural(bound: dict[str, Value]) -> bool:
    values = list(bound.values())
    return not any(isinstance(v, TensorV) for v in values) and any(
        (isinstance(v, ObjV) and not isinstance(v.obj, _CONTEXT_TYPES)) or isinstance(v, TupleV)
        for v in values if getattr(v, "source", None) is not None)


def _family_call(tracer, code, globals_: dict, bound: dict[str, Value]) -> Value:
    why = check_signature(code)
    if why is not None:
        raise Unsupported("unsupported_call", f"{code.co_qualname}: {why}")
    _refuse_uncommitted_writes(tracer, code)
    params = code.co_varnames[:code.co_argcount]
    ctx, struct = _classify(tracer, code, params, bound)
    family = family_for(code, globals_, params, frozenset(ctx), frozenset(struct))
    L = [_real(bound[name]) for name in params]
    example = family.evaluate_example(L)
    struct_nodes = tuple(_object_input(tracer, bound[params[i]]) for i in sorted(struct))
    ctx_nodes = tuple(_object_input(tracer, bound[params[i]]) for i in sorted(ctx))
    mapping = {i: bound[params[i]].source for i in ctx}
    tensors = []  # what this context's paths read (None: another context's tensor)
    values = family.ctx_values(L, family.enabled_paths(L))
    for source, value in zip(family.ctx_sources, values):
        tensors.append(None if value is None else tracer.wrap(value, rebase(source, mapping)).node)
    node = tracer.graph.create_node("call_function", family.run,
                                    (struct_nodes, ctx_nodes, tuple(tensors)), {})
    node.meta["where"] = tracer.where()
    node.meta["mutates"] = False
    node.meta["writes"] = frozenset()
    node.meta["template_family"] = family
    node.meta["template_paths"] = family.example_paths
    tracer.template_calls.append(family)
    return tracer.wrap_output(node, example)


_READ_SAFE_WRITES = (Print, Effect, UpdateTensor, ReplayTensor)


def _refuse_uncommitted_writes(tracer, code) -> None:
    """The walk reads the real structure, globals and modules while the graph runs, before
    the commit: a Python write earlier in the call (an attribute, a global, an item) would be
    invisible to it. Writes it cannot read are fine: printing, effects, tensor updates (the
    graph passes the updated tensors) and attributes of tensors (``.grad``)."""
    for write in tracer.heap.pending():
        if isinstance(write, _READ_SAFE_WRITES):
            continue
        if isinstance(write, (SetAttr, DelAttr)) and isinstance(write.target, TensorV):
            continue
        where = getattr(write, "where", "") or "the call"
        raise Unsupported("side_effect", f"{code.co_qualname}: a Python write earlier in the "
                          f"call ({type(write).__name__} at {where}) is not committed yet when "
                          "the recursion runs; it stays unrolled")


def _classify(tracer, code, params, bound) -> tuple[list[int], list[int]]:
    ctx, struct = [], []
    for i, name in enumerate(params):
        value = bound[name]
        if getattr(value, "source", None) is None:
            raise Unsupported("unsupported_call", f"{code.co_qualname} recurses on `{name}` "
                              "computed in the call (templates recurse on parts of arguments)")
        if isinstance(value, ObjV) and isinstance(value.obj, _CONTEXT_TYPES):
            ctx.append(i)
        elif isinstance(value, (ObjV, TupleV)) or (isinstance(value, ConstV) and value.value is None):
            struct.append(i)
        elif isinstance(value, (ListV, DictV)) and not tracer.heap.pending():
            struct.append(i)
        else:
            kind = "a tensor" if isinstance(value, TensorV) else type(value).__name__
            raise Unsupported("unsupported_call", f"{code.co_qualname} recurses with `{name}` "
                              f"= {kind}; templates take structures (objects, tuples, lists)")
    if not struct:
        raise Unsupported("unsupported_call", f"{code.co_qualname} has no structure argument")
    return ctx, struct


def _real(value: Value):
    if isinstance(value, ObjV):
        return value.obj
    if isinstance(value, ConstV):
        return value.value
    return value.concrete()  # a tuple/list/dict rebuilt around the same leaf objects


def _object_input(tracer, value: Value):
    """A graph input that is a Python object (the structure, the module), read from its
    source on every call."""
    seen = tracer.object_inputs.get(value.source)
    if seen is not None:
        return seen
    node = placeholder(tracer, "obj_" + "".join(c if c.isalnum() else "_" for c in str(value.source)))
    node.meta["example"] = _real(value)
    tracer.input_sources.append(value.source)
    tracer.object_inputs[value.source] = node
    return node


def rebase(source: Source, mapping: dict[int, Source]) -> Source:
    """``source`` over the template's locals, re-rooted at the call site's sources."""
    if isinstance(source, LocalSource):
        return mapping[source.index]
    base = getattr(source, "base", None)
    if base is None:
        return source  # a global, a builtin, a pinned object
    return dataclasses.replace(source, base=rebase(base, mapping))
