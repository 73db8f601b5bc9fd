"""Values of the symbolic executor: what sits on the stack and in locals during capture.

Every value knows its concrete Python counterpart (capture runs with real inputs, so a
tensor value carries the real result of the op that made it) and, when it was read from
outside the frame, its ``source``. Tensors also carry the FX node that computes them.
"""
from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ...guards.sources import Source


class Value:
    source: Source | None = None
    kind_text = ""  # what a message calls such a value (``kind``), where its class says more


    def concrete(self) -> Any:
        """The real Python object this value stands for at capture time."""
        raise NotImplementedError

    def python_type(self) -> type:
        return type(self.concrete())

    def __repr__(self) -> str:
        try:
            shown = repr(self.concrete())
        except _NoConcrete as e:  # (a message about such a value must not fail itself)
            shown = str(e)
        return f"{type(self).__name__}({shown})"


@dataclass(eq=False, repr=False)
class ConstV(Value):
    """An immutable Python value (int, str, None, dtype, torch.Size, tuple of consts, ...)."""

    value: Any
    source: Source | None = None

    def concrete(self):
        return self.value


@dataclass(eq=False, repr=False)
class TensorV(Value):
    node: torch.fx.Node
    example: torch.Tensor
    source: Source | None = None
    updated: bool = False  # an outliving tensor written in place (committed by the heap)
    dynamic: bool = False  # its shape may differ between calls (sizes are SymV)
    real: Any = None       # graph inputs: the real tensor object (example may become a copy)
    dyn_dims: frozenset = frozenset()  # for graph inputs: which dims are dynamic
    stale_leaf: Any = None  # (node, tensor) of the leaf requiring grad it replaced (leaf_writes)

    def concrete(self):
        return self.example

    def python_type(self):
        return type(self.example)

    def __repr__(self):
        return f"TensorV({self.node.name}, {tuple(self.example.shape)})"


@dataclass(eq=False, repr=False)
class TupleV(Value):
    items: list
    cls: type = tuple  # a namedtuple / structseq class when not a plain tuple
    source: Source | None = None

    def concrete(self):
        return self.build([i.concrete() for i in self.items])

    def build(self, vals: list):
        if self.cls is tuple:
            return tuple(vals)
        if hasattr(self.cls, "_make"):
            return self.cls._make(vals)
        return self.cls(vals)

    def python_type(self):
        return self.cls


@dataclass(eq=False, repr=False)
class SliceV(Value):
    """``a:b:c`` with a bound that is a symbolic number (a dynamic size, a rolled loop's
    index): indexing a tensor with it is a graph op on those numbers (``x[:n]``,
    ``x[t:t + 1]``), the result's sizes dynamic; anything else takes its value (a guard)."""

    parts: list  # start, stop, step (Values)

    def concrete(self):
        return slice(*[p.concrete() for p in self.parts])

    def python_type(self):
        return slice


def _items_through_view(cls: type) -> type:
    """``items`` of a list/dict value: its own until the shadow heap opens a view on it (the
    first write to a list/dict that existed before the call, ``ShadowHeap.touch_container``),
    then the view's (``shadow_heap/views.py``), which holds what the call wrote."""
    def get(self):
        view = self._view
        return self._own if view is None else view.current

    def set_(self, items) -> None:
        view = self._view
        if view is None:
            self._own = items
        else:
            view.current = items

    def open_view(self, view) -> None:
        self._view = view

    def close_view(self, items) -> None:
        self._view, self._own = None, items

    cls.items, cls._view = property(get, set_), None
    cls.open_view, cls.close_view = open_view, close_view
    return cls


@_items_through_view
@dataclass(eq=False, repr=False)
class ListV(Value):
    """A list. With a source it existed before the call (and must not be mutated here)."""

    items: list
    source: Source | None = None

    def concrete(self):
        return [i.concrete() for i in self.items]

    def python_type(self):
        return list


@dataclass(eq=False, repr=False)
class ModuleSliceV(ListV):
    """``layers[1:]`` of a ModuleList / Sequential / ParameterList: a list of the children
    (iterated, indexed, ``len``); a slice of a Sequential can also be called (the children
    in turn, as ``Sequential.forward`` does)."""

    callable: bool = False


@_items_through_view
@dataclass(eq=False, repr=False)
class DictV(Value):
    """A dict with constant keys (kept as Python objects) and Value values. ``cls`` is
    ``dict``, ``collections.OrderedDict`` or ``collections.defaultdict`` (then ``factory``
    is its ``default_factory``, called on a missing ``d[k]``)."""

    items: dict
    source: Source | None = None
    cls: type = dict
    factory: Value | None = None

    def concrete(self):
        items = {k: v.concrete() for k, v in self.items.items()}
        if self.cls is dict:
            return items
        if self.cls is collections.defaultdict:
            return self.cls(None if self.factory is None else self.factory.concrete(), items)
        return self.cls(items)

    def python_type(self):
        return self.cls

    def like(self, items: dict) -> "DictV":
        """A new dict of the same kind (``d.copy()``, a merged branch) holding ``items``."""
        return DictV(items, cls=self.cls, factory=self.factory)


@dataclass(eq=False, repr=False)
class DictViewV(Value):
    """``d.keys()`` / ``d.values()`` / ``d.items()`` of a ``DictV``: like CPython's views it
    holds no items of its own but reads its dict each time it is used, so writes to the
    dict after the view was made are seen (``keys = d.keys(); d[k] = v; k in keys``)."""

    mapping: DictV
    kind: str  # "keys", "values" or "items"

    def current(self) -> list:
        """The view's items as values, read from the dict as it is now."""
        items = self.mapping.items
        if self.kind == "keys":
            return [ConstV(k) for k in items]
        if self.kind == "values":
            return list(items.values())
        return [TupleV([ConstV(k), v]) for k, v in items.items()]

    def concrete(self):
        d = self.mapping
        if self.kind == "keys":  # only the keys count: values need not be concrete
            return d.cls.fromkeys(d.items).keys()
        return getattr(d.concrete(), self.kind)()

    def python_type(self):
        return type(getattr(self.mapping.cls(), self.kind)())

    def __repr__(self):
        return f"DictViewV({self.kind})"


@dataclass(eq=False, repr=False)
class SetV(Value):
    """A set of constants built during capture."""

    items: set
    source: Source | None = None

    def concrete(self):
        return set(self.items)

    def python_type(self):
        return set


@dataclass(eq=False, repr=False)
class ObjV(Value):
    """Any other object: modules, functions, classes, nn.Modules, user objects."""

    obj: Any
    source: Source | None = None

    def concrete(self):
        return self.obj

    def __repr__(self):
        return f"ObjV({type(self.obj).__name__})"


@dataclass(eq=False, repr=False)
class FreshObjV(ObjV):
    """A real object built at capture time that stands for one eager makes anew on every call
    (``nn.ReLU()`` in forward): usable inside the call, refused where it would outlive it."""


@dataclass(eq=False, repr=False)
class GeneratorV(ObjV):
    """A ``torch.Generator`` read from outside the frame: a graph input (``node``)."""

    node: Any = None


@dataclass(eq=False, repr=False)
class FuncV(Value):
    """A function created during capture (lambda, nested def, comprehension body)."""

    code: Any
    globals: dict
    name: str
    defaults: tuple = ()
    kwdefaults: dict = field(default_factory=dict)
    closure: tuple = ()  # of CellV

    def concrete(self):
        raise _NoConcrete("a function created during capture")

    def python_type(self):
        import types
        return types.FunctionType

    def __repr__(self):
        return f"FuncV({self.name})"


@dataclass(eq=False, repr=False)
class CellV(Value):
    """A closure cell: a captured local of a traced frame, or a real outer cell.

    A real cell (``real``) is read lazily and guarded through ``source``; writing into a real
    cell (``nonlocal x = ...`` in the optimized function) outlives the call.
    """

    contents: Value | None = None
    real: Any = None
    source: Source | None = None

    def concrete(self):
        raise _NoConcrete("a closure cell")

    def __repr__(self):
        return f"CellV({self.contents!r})"


@dataclass(eq=False, repr=False)
class MethodV(Value):
    """``self.name`` resolved to a callable: a Python function to inline (``func``) or a
    method of a tensor/container/constant, identified by ``name``."""

    self_value: Value
    func: Value | None = None
    name: str = ""

    def concrete(self):
        return getattr(self.self_value.concrete(), self.name)

    def __repr__(self):
        return f"MethodV({self.self_value!r}.{self.name})"


@dataclass(eq=False, repr=False)
class IterV(Value):
    """An iterator (capture unrolls loops): ``items`` known so far, ``pos`` the next one to
    hand out. ``source``, when given, yields the rest one at a time, when they are asked for:
    an iterator over a list reads the list as it is then, ``map``/``accumulate`` call their
    function then (so side effects keep eager's order and a list changed meanwhile is seen)."""

    items: list
    pos: int = 0
    source: Any = None

    def next(self) -> Value | None:
        if self.pos >= len(self.items) and not self._pull():
            return None
        self.pos += 1
        return self.items[self.pos - 1]

    def rest(self) -> list:
        """The items still to come, used up (``list(it)``: a second call gives [])."""
        while self._pull():
            pass
        items = self.items[self.pos:]
        self.pos = len(self.items)
        return items

    def _pull(self) -> bool:
        if self.source is None:
            return False
        try:
            self.items.append(next(self.source))
        except StopIteration:
            self.source = None
            return False
        return True

    def concrete(self):
        raise _NoConcrete("an iterator")

    def __repr__(self):
        return f"IterV({len(self.items) - self.pos} left)"


@dataclass(eq=False, repr=False)
class SuperV(Value):
    cls: type
    self_value: Value

    def concrete(self):
        return super(self.cls, self.self_value.concrete())


@dataclass(eq=False, repr=False)
class GradModeV(Value):
    """``torch.no_grad()`` / ``enable_grad()`` / ``set_grad_enabled(b)`` /
    ``inference_mode(b)`` as a context manager (see ``grad_mode.py``)."""

    enabled: bool
    prior: bool | None = None
    switched: bool = False           # set_grad_enabled: switched (and ``prior`` read) when made
    inference: bool | None = None    # inference_mode(b): b; None for the others
    context: Any = None              # the real inference-mode guard while capture is inside
    nodes_before: Any = None         # graph nodes that existed when the block was entered

    def concrete(self):
        raise _NoConcrete("a grad-mode context manager")

    def python_type(self):
        if self.inference is not None:
            return torch.inference_mode
        if self.switched:
            return torch.set_grad_enabled
        return torch.enable_grad if self.enabled else torch.no_grad

    def __repr__(self):
        return f"GradModeV({self.python_type().__name__})"


@dataclass(eq=False, repr=False)
class CtxExitV(Value):
    """The bound ``__exit__`` pushed by BEFORE_WITH."""

    ctx: Value

    def concrete(self):
        raise _NoConcrete("a context manager exit")


@dataclass(eq=False, repr=False)
class NewObjV(Value):
    """An instance of a plain Python class created during capture (its attributes are
    values; it becomes a real object only if it is returned)."""

    cls: type
    attrs: dict
    cls_source: Source | None = None

    def concrete(self):
        raise _NoConcrete(f"a {self.cls.__name__} created during capture")

    def python_type(self):
        return self.cls

    def __repr__(self):
        return f"NewObjV({self.cls.__name__})"


@dataclass(eq=False, repr=False)
class PartialV(Value):
    """``functools.partial(func, *args, **kwargs)`` created during capture."""

    func: Value
    args: list
    kwargs: dict

    def concrete(self):
        raise _NoConcrete("a functools.partial created during capture")

    def __repr__(self):
        return f"PartialV({self.func!r})"


class UntrackedContainerV(Value):
    """A list or dict that existed before the call and that a relaxation stopped tracking as a
    whole (its length/keys are not guarded). Only the accesses the subclass allows are
    captured; anything else needs the whole contents after all, so ``concrete()`` raises
    ``RelaxationRefused`` and the dispatcher tracks the container again."""

    source: Source

    def concrete(self):
        raise RelaxationRefused(self.source)


@dataclass(eq=False, repr=False)
class AppendOnlyListV(UntrackedContainerV):
    """A list only appended to (a log, a history): its length is not guarded; appends are
    committed as appends. The items appended in this call can be read back by negative index
    (``log[-1]`` right after ``log.append(x)``), which does not depend on the old length."""

    source: Source
    appended: list = field(default_factory=list)

    def python_type(self):
        return list

    def __repr__(self):
        return f"AppendOnlyListV({self.source})"


@dataclass(eq=False, repr=False)
class KeyedDictV(UntrackedContainerV):
    """A dict used only through single keys (a cache, a memo table): its key set is not
    guarded; a read of ``d[k]`` guards that one entry (and that ``k`` is present), ``k in d``
    guards that one membership, and ``d[k] = v`` is committed as that one item write."""

    source: Source
    written: dict = field(default_factory=dict)  # key -> Value written in this call
    real: Any = None                             # the dict itself (read at capture)

    def python_type(self):
        return dict

    def __repr__(self):
        return f"KeyedDictV({self.source})"


class NullV(Value):
    """The NULL that 3.11 pushes below a callable (PUSH_NULL / LOAD_GLOBAL with NULL)."""

    def concrete(self):
        raise _NoConcrete("NULL")

    def __repr__(self):
        return "NULL"


NULL = NullV()


class _NoConcrete(Exception):
    pass


class RelaxationRefused(Exception):
    """The code reads something a relaxation stopped tracking (e.g. the items of a list
    treated as append-only): the dispatcher undoes that relaxation and captures again."""

    def __init__(self, source):
        super().__init__(str(source))
        self.source = source


def is_const(v: Value) -> bool:
    """True when ``v`` (recursively) holds no tensors, functions, cells or opaque objects."""
    if isinstance(v, ConstV) or type(v).__name__ == "SymV":  # SymV specialises when read
        return True
    if isinstance(v, (TupleV, ListV)):
        return all(is_const(i) for i in v.items)
    if isinstance(v, SliceV):
        return all(is_const(p) for p in v.parts)
    if isinstance(v, DictV):
        return all(is_const(i) for i in v.items.values())
    if isinstance(v, SetV) or (isinstance(v, ObjV) and isinstance(v.obj, enum.Enum)):
        return True  # an enum member: an immutable, hashable singleton
    if isinstance(v, ObjV) and isinstance(v.obj, BaseException) and v.source is None:
        return True  # an exception raised in the call (made from constants: exceptions.py)
    if isinstance(v, DictViewV):
        return v.kind == "keys" or is_const(v.mapping)
    return False


def leaves(v: Value):
    """The non-container values inside ``v`` (tuples, lists and dicts are walked)."""
    if isinstance(v, (TupleV, ListV)):
        for item in v.items:
            yield from leaves(item)
    elif isinstance(v, SliceV):
        yield from v.parts
    elif isinstance(v, DictV):
        for item in v.items.values():
            yield from leaves(item)
    else:
        yield v


def contains_tensor(v: Value) -> bool:
    return any(isinstance(leaf, TensorV) or getattr(leaf, "holds_tensors", False)
               for leaf in leaves(v))


def kind(v: Value) -> str:
    """What ``v`` is, in the user's words, for messages (never a ``…V`` class name)."""
    if not isinstance(v, Value):  # (a container snapshot's raw item: rolled/match.py)
        return "None" if v is None else _a(type(v).__name__)
    if isinstance(v, TensorV):
        return "a tensor"
    if isinstance(v, ObjV):
        return _a(type(v.obj).__name__)
    if isinstance(v, ConstV):
        return "None" if v.value is None else _a(type(v.value).__name__)
    if v.kind_text:
        return v.kind_text
    try:
        return _a(v.python_type().__name__)
    except Exception:  # (no concrete value: its class's name, without the V)
        return _a(type(v).__name__.removesuffix("V").lower())


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
