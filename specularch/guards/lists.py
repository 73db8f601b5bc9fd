"""The guard of a list passed whole into a graph (a rolled ``for x in xs`` loop,
``symbolic/rolled/lists.py``): every item is like item 0 (a tensor with its
metadata, or a tuple of such tensors); the length is not guarded (the loop's trip count is a
run-time value)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from .aliasing import DistinctGuard, storages_distinct
from .guard import Guard, TensorGuard, _short, const_name, equal_condition


@dataclass(frozen=True, eq=False)
class TensorListGuard(Guard):
    """``type(v) is list`` and each item like ``item``: a ``TensorGuard`` without a source
    (type, dtype, device, shape, strides, requires_grad, leaf state), or a tuple of them (an
    item of ``(input, target)`` pairs)."""

    item: TensorGuard | tuple = None

    def conditions(self, v, consts):
        if isinstance(self.item, tuple):
            each = [f"type(x) is {const_name(consts, tuple)}", f"len(x) == {len(self.item)}"]
            for j, g in enumerate(self.item):
                each += [f"type(x[{j}]) is {const_name(consts, g)}"] if isinstance(g, type) else \
                    g.conditions(f"x[{j}]", consts)
        else:
            each = self.item.conditions("x", consts)
        return [f"type({v}) is {const_name(consts, list)}", f"all({' and '.join(each)} for x in {v})"]

    def describe(self):
        shown = [g.__name__ if isinstance(g, type) else g.describe().split(": ", 1)[1]
                 for g in self._guards()]
        text = f"({', '.join(shown)})" if isinstance(self.item, tuple) else shown[0]
        return f"{self.source}: a list of {text} (any length)"

    def _guards(self) -> tuple:
        return self.item if isinstance(self.item, tuple) else (self.item,)

    def mismatch(self, value):
        if type(value) is not list:
            return f"expected a list, got {type(value).__qualname__}"
        pairs = isinstance(self.item, tuple)
        for k, x in enumerate(value):
            if pairs and (type(x) is not tuple or len(x) != len(self.item)):
                return f"[{k}] expected a tuple of {len(self.item)}, got {_short(x)}"
            for j, (g, t) in enumerate(zip(self._guards(), x if pairs else (x,))):
                at = f"[{k}][{j}]" if pairs else f"[{k}]"
                if isinstance(g, type):
                    if type(t) is not g:
                        return f"{at} expected an {g.__name__}, got {_short(t)}"
                    continue
                if not isinstance(t, torch.Tensor):
                    return f"{at} expected a tensor, got {_short(t)}"
                if g.mismatch(t) != "did not match":
                    return f"{at} {g.mismatch(t)} (got {_short(t)})"
        return "did not match"

    @staticmethod
    def of(source, item, leaf, where: str = "") -> "TensorListGuard":
        """The guard for a list whose item 0 is ``item`` (a tensor or a tuple of tensors)."""
        def one(t: torch.Tensor) -> TensorGuard | type:
            if type(t) in NUMBERS:
                return type(t)  # a per-item number: a run-time value of the body
            return TensorGuard(None, type(t), t.dtype, t.device, tuple(t.shape), tuple(t.stride()),
                               t.requires_grad, leaf=leaf(t))
        spec = tuple(one(t) for t in item) if isinstance(item, tuple) else one(item)
        return TensorListGuard(source, item=spec, where=where)


def list_tensors(lst) -> list:
    """The tensors of a list passed whole (its items, the items of its tuples, or the
    attributes of its objects)."""
    return [t for x in lst for t in _parts(x) if isinstance(t, torch.Tensor)]


def _parts(x) -> tuple:
    if type(x) is tuple:
        return x
    if isinstance(x, torch.Tensor):
        return (x,)
    attrs = getattr(x, "__dict__", None)
    return tuple(attrs.values()) if isinstance(attrs, dict) else ()


_BROKEN = object()     # ends a walk that a node without the link, or a cycle, broke
WALK_LIMIT = 1 << 20


def walked(head, link: str) -> list:
    """``[head, head.link, head.link.link, ...]`` up to ``None`` (``symbolic/rolled/walk.py``);
    a walk that meets a node without the instance attribute ``link``, or runs on past
    ``WALK_LIMIT`` nodes (a cycle), ends with ``_BROKEN``, which no guard lets through."""
    nodes = []
    while head is not None:
        if len(nodes) == WALK_LIMIT:
            return nodes + [_BROKEN]
        nodes.append(head)
        attrs = getattr(head, "__dict__", None)
        if not isinstance(attrs, dict) or link not in attrs:
            return nodes + [_BROKEN]
        head = attrs[link]
    return nodes


def _items(guard, v: str, consts: dict, link: str | None = None) -> str:
    """The expression of the items a guard checks: the list, or the walk from its head (by
    ``link``, or by the guard's own)."""
    link = guard.walk if link is None else link
    return f"{const_name(consts, walked)}({v}, {link!r})" if link else v


@dataclass(frozen=True, eq=False)
class ObjectListGuard(Guard):
    """A list of user objects passed whole (``symbolic/rolled/objects.py``), or the nodes a linked
    walk from ``source`` by ``walk`` meets (``symbolic/rolled/walk.py``): every item of one class;
    the length not guarded. What the loop reads of the items is ``ItemAttrGuard``'s."""

    item_type: type = None
    walk: str = ""

    def key(self):
        return ("ObjectList", str(self.source), self.walk)

    def conditions(self, v, consts):
        cls = const_name(consts, self.item_type)
        items = _items(self, v, consts)
        whole = [] if self.walk else [f"type({v}) is {const_name(consts, list)}"]
        return whole + [f"all(type(x) is {cls} for x in {items})"]

    def describe(self):
        if self.walk:
            return f"{self.source}: walked by .{self.walk}, {self.item_type.__qualname__} nodes (any length)"
        return f"{self.source}: a list of {self.item_type.__qualname__} (any length)"

    def mismatch(self, value):
        if self.walk:
            value = walked(value, self.walk)
        elif type(value) is not list:
            return f"expected a list, got {type(value).__qualname__}"
        for k, x in enumerate(value):
            if x is _BROKEN:
                return f"node {k - 1} has no attribute `{self.walk}`, or the walk is a cycle"
            if type(x) is not self.item_type:
                return f"[{k}] expected a {self.item_type.__qualname__}, got {_short(x)}"
        return "did not match"


@dataclass(frozen=True, eq=False)
class ItemAttrGuard(Guard):
    """Every item of a list of objects passed whole has the instance attribute ``name``:
    a tensor like ``tensor``, a number of type ``kind``, or equal to ``equal[0]``."""

    name: str = ""
    tensor: TensorGuard | None = None
    kind: type | None = None
    equal: tuple = ()
    walk: str = ""      # the items are the nodes of the walk from ``source`` by this link

    def key(self):
        return ("ItemAttr", str(self.source), self.name, self.walk)

    def conditions(self, v, consts):
        x = f"x.__dict__[{self.name!r}]"
        if self.tensor is not None:
            each = self.tensor.conditions(x, consts)
        elif self.kind is not None:
            each = [f"type({x}) is {const_name(consts, self.kind)}"]
        else:
            each = [equal_condition(x, self.equal[0], consts)]
        return [f"all({self.name!r} in x.__dict__ and {' and '.join(each)} for x in "
                f"{_items(self, v, consts)})"]

    def describe(self):
        what = (self.tensor.describe().split(": ", 1)[1] if self.tensor is not None else
                f"an {self.kind.__name__}" if self.kind is not None else f"== {self.equal[0]!r}")
        items = f"{self.source} (walked by .{self.walk})" if self.walk else str(self.source)
        return f"{items}[*].{self.name}: {what}"

    def mismatch(self, value):
        for k, x in enumerate(walked(value, self.walk) if self.walk else value):
            got = getattr(x, "__dict__", {}).get(self.name, "(missing)")
            if not _ok(self, got):
                at = f"(walked by .{self.walk}) node {k}" if self.walk else f"[{k}]"
                return f"{at}.{self.name} expected {self.describe().split(': ', 1)[1]}, got {_short(got)}"
        return "did not match"

    @staticmethod
    def of_tensor(source, name: str, t: torch.Tensor, leaf, where: str = "",
                  walk: str = "") -> "ItemAttrGuard":
        spec = TensorGuard(None, type(t), t.dtype, t.device, tuple(t.shape), tuple(t.stride()),
                           t.requires_grad, leaf=leaf(t))
        return ItemAttrGuard(source, name=name, tensor=spec, where=where, walk=walk)


def _ok(guard: ItemAttrGuard, got) -> bool:
    """Whether one item's attribute passes ``guard`` (its conditions on a list of one)."""
    consts: dict = {}
    try:
        flat = dataclasses.replace(guard, walk="")  # one item, not a walk from it
        return all(eval(c, {**consts, "type": type}, {"v": [_Holder(guard.name, got)]})
                   for c in flat.conditions("v", consts))
    except Exception:
        return False


class _Holder:
    def __init__(self, name, value):
        self.__dict__[name] = value


@dataclass(frozen=True, eq=False)
class ListDistinctGuard(DistinctGuard):
    """Tensors the call writes share no memory with the items of lists passed whole
    (``others``), or with the tensors of the nodes of linked walks from ``others`` (``walks``:
    each other's link, ``""`` for a list): the rolled body reads those items when the graph
    runs, before the commit, so it would not see a write eager's loop sees."""

    walks: tuple = ()

    def key(self):
        return ("ListDistinct", tuple(map(str, self.written)), tuple(map(str, self.others)),
                self.walks)

    def conditions(self, v, consts, name_of=lambda s: s.expr()):
        check, flat = const_name(consts, storages_distinct), const_name(consts, list_tensors)
        written = "".join(f"{name_of(s)}, " for s in self.written)
        items = " + ".join(f"{flat}({_items(self, name_of(s), consts, link)})"
                           for s, link in zip(self.others, self._links()))
        return [f"{check}(({written}), {items})"]

    def _links(self) -> tuple:
        return self.walks or ("",) * len(self.others)

    def describe(self):
        others = ", ".join(f"{s} (walked by .{link})" if link else str(s)
                           for s, link in zip(self.others, self._links()))
        return f"written {', '.join(map(str, self.written))} share no memory with the items of {others}"


def leaf_state(t: torch.Tensor) -> bool | None:
    """Whether ``t`` has no autograd history, for a tensor that requires grad and is not a
    Parameter (always a leaf); None: not guarded."""
    if not t.requires_grad or isinstance(t, nn.Parameter):
        return None
    return t.grad_fn is None


def uniform(items: list) -> bool:
    """Whether ``items`` are tensors (or plain tuples of tensors and numbers) that all share
    item 0's metadata (a number: its type): what ``TensorListGuard.of(item 0)`` lets through."""
    def metadata(x, part=False):
        if part and type(x) in NUMBERS:
            return type(x)
        if not part and type(x) is tuple and any(isinstance(t, torch.Tensor) for t in x):
            parts = tuple(metadata(t, True) for t in x)
            return None if None in parts else parts
        if not isinstance(x, torch.Tensor) or x.is_inference():
            return None
        return (type(x), x.dtype, x.device, x.shape, x.stride(), x.requires_grad, leaf_state(x))
    first = metadata(items[0]) if items else None
    return first is not None and all(metadata(x) == first for x in items[1:])


NUMBERS = (int, float)  # a tuple's part that is a per-item number (not bool: a flag steers)
