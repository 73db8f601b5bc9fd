"""Rolled ``for obj in objs`` loops over a list of user objects from the call whose attributes
the body reads as tensors or numbers: captured once, whatever the length.

The list is passed whole as a list of tensors is (``lists.py``): one graph input, an
``ObjectListV``, guarded by ``ObjectListGuard`` (every item of item 0's class; the length not
guarded). In an iteration the item is a ``RowV``, ``objs[k]``; each attribute the body reads
is a graph node ``getattr(objs[k], name)`` and a guard over every item (``ItemAttrGuard``):

* a tensor with item 0's dtype/device/shape/requires_grad in every item: a tensor;
* an ``int`` (or ``float``) in every item: a run-time number, as a size is (a branch on it,
  a list index with it, refuses the roll: the body would depend on one item's value);
* anything else equal in every item (``None``, a string, a flag): a constant.

Anything else done with an item (a method call, a write, ``id()``/``is``, an attribute of
another kind, a Python write to an object of its class earlier in the call, which the graph
would not see when it reads the items) makes capture start again with the loop unrolled,
and ``explain()`` says why.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...guards.lists import ItemAttrGuard, leaf_state, uniform
from .._torch_dispatch import storage_key
from ..values.rolled import ItemNumberV, TensorListV
from ..values import TensorV, Value

_NUMBERS = (int, float)
_MISSING = object()


def plain_objects(items: list) -> bool:
    """Instances of one user class whose attributes live in their ``__dict__`` (no
    ``__getattr__``, properties or slots decide what a read returns)."""
    if not items:
        return False
    cls = type(items[0])
    return type(cls) is type and cls.__module__ not in ("builtins", "torch") \
        and not issubclass(cls, (nn.Module, torch.Tensor, BaseException, tuple, list, dict, type)) \
        and cls.__getattribute__ is object.__getattribute__ and not hasattr(cls, "__getattr__") \
        and all(type(x) is cls and isinstance(getattr(x, "__dict__", None), dict) for x in items)


class ObjectListV(TensorListV):
    """A list of user objects passed whole: iterated only by its rolled loop (``RowV``)."""

    holds_tensors = False
    walk = ""  # the link of a linked walk from ``source`` (``walk.py``), not a list

    def __repr__(self):
        return f"ObjectListV({self.source}, {self.length!r})"


class RowV(Value):
    """``objs[k]`` in a rolled loop over an ``ObjectListV``: only its attributes are read
    (``at``: ``k`` at capture, the item whose values stand for every item's)."""

    def __init__(self, of: ObjectListV, node, at: int, loop, successor: bool = False):
        self.of, self.node, self.at, self.loop = of, node, at, loop
        self.successor = successor  # ``node.next`` of a walk: only stored back into ``node``
        self.example = of.examples[at] if at < len(of.examples) else None

    def concrete(self):
        if self.successor:
            self.loop.refuse(f"its body uses `.{self.of.walk}` other than to step to the next node")
        self.loop.refuse(f"its body uses an item of {self.of.source} other than by reading "
                         "its attributes (a call, identity, a write)")

    def python_type(self):
        return type(self.example)

    def __repr__(self):
        at = f".{self.of.walk}" if self.successor else f"[{self.node.args[1]}]"
        return f"RowV({self.of.source}{at})"


def attr(tracer, v: RowV, name: str) -> Value:
    """``obj.name`` of an item: one node per read, guarded over every item of the list."""
    lst, loop = v.of, v.loop
    if v.successor:
        v.concrete()  # the node after the last is None: reading it is eager's AttributeError
    if name == lst.walk:
        return RowV(lst, None, v.at + 1, loop, successor=True)
    values = [x.__dict__.get(name, _MISSING) for x in lst.examples]
    no_earlier_writes(tracer, lst, loop)
    if hasattr(type(v.example), name):
        loop.refuse(f"its body reads `{name}` of the items' class (a method, a class attribute: "
                    "only instance attributes are read per item)")
    if any(x is _MISSING for x in values):
        loop.refuse(f"an item of {lst.source} has no attribute `{name}`")
    node = tracer.graph.call_function(getattr, (v.node, name))
    value = values[v.at]
    if isinstance(value, torch.Tensor):
        if not uniform(values):
            loop.refuse(f"the items' `{name}` differ in dtype, shape or requires_grad")
        tracer.guards.add(ItemAttrGuard.of_tensor(lst.source, name, value, leaf_state, tracer.where(),
                                                  walk=lst.walk))
        _externals(tracer, values, node)
        node.meta["example"] = value
        return TensorV(node, value)
    if type(value) in _NUMBERS and all(type(x) is type(value) for x in values):
        tracer.guards.add(ItemAttrGuard(lst.source, name=name, kind=type(value), where=tracer.where(),
                                        walk=lst.walk))
        node.meta["example"] = value
        return ItemNumberV(value, node, None, tracer, f"{lst.source}[k].{name}", part=(lst, name))
    if not all(_same(x, value) for x in values):
        loop.refuse(f"the items' `{name}` differ and are neither tensors nor numbers")
    tracer.guards.add(ItemAttrGuard(lst.source, name=name, equal=(value,), where=tracer.where(),
                                    walk=lst.walk))
    tracer.graph.erase_node(node)
    return tracer.wrap_python(value)


def _same(x, y) -> bool:
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:
        return False


def _externals(tracer, values: list, node) -> None:
    """The items' tensors outlive the call: a write into one is refused (no source could
    commit it), as for a list of tensors."""
    for t in values:
        if t.numel():
            key = storage_key(t)
            if key in tracer._external:
                tracer.viewed.add(key)
            tracer._external.setdefault(key, TensorV(node, t))


def no_earlier_writes(tracer, lst: ObjectListV, loop) -> None:
    """The graph reads the items when it runs, before the commit: a Python write to an object
    of their class earlier in the call (through another path) would not be seen."""
    cls = type(lst.examples[0])
    for w in tracer.heap.pending():
        if type(getattr(getattr(w, "target", None), "obj", None)) is cls:
            loop.refuse(f"the call writes an attribute of a {cls.__name__} before the loop "
                        f"(the rolled loop reads the items of {lst.source} when the graph runs)")
