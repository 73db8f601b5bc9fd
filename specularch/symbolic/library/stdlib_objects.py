"""Standard-library objects made or used in the optimized call, modelled over values.

* ``collections.deque``: a ``DequeV`` (see ``deque_model.py``).
* ``collections.Counter``: a ``DictV`` of class Counter. Its counting logic runs on the real
  Counter class over constant keys and counts (``most_common`` orders ties as CPython does
  because CPython computes it); a missing key reads 0 without being stored.
* namedtuple instances: ``_replace`` (``_asdict`` is in ``methods.py``).
* ``enum`` members are constants (hashable singletons): dict keys, ``==``, ``.value`` /
  ``.name``; ``Color(1)`` looks the member up (eager's ``_missing_`` hook must be Enum's own).
* ``operator.methodcaller`` objects: the method call they stand for.
* frozen ``dataclasses``: their generated ``__init__`` writes fields with
  ``object.__setattr__``, modelled on an object made in the call; any other write to a frozen
  instance raises ``FrozenInstanceError`` in eager, so the call runs eagerly.
  ``dataclasses.asdict`` / ``astuple`` of fields that are constants (they deep-copy tensors:
  not modelled, falls back).
* ``functools.lru_cache``-wrapped helpers, called with constant arguments. The choice: the
  helper's ``__wrapped__`` is inlined (so everything it reads is guarded like any inlined
  code) and must have no effect (no heap write, print or graph op) and return an immutable
  constant; the real cached function is then called once, at capture, with those constants,
  and both answers must agree. So the result baked into the graph is what eager returns on
  every call the guards let through: the cache's entry if it still holds one (it was computed
  from state the guards pin), a fresh computation otherwise. The cache's bookkeeping is
  eager's: the commit makes the lookup eager makes (``_CacheLookup``, in program order), so
  ``cache_info()`` hits and misses grow, the LRU order moves and an evicted or cleared entry
  is computed and stored again; the capture's own lookup stands for its call's. Non-constant
  arguments (the cache keys on them, by identity for
  tensors), a helper with effects, a mutable or tensor result (eager hands back the very
  cached object each time), or disagreeing answers: the call runs eagerly.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import operator

from ...records import Unsupported
from . import deque as deque_model
from .builtins import _all_const, _concrete_call, model
from .stdlib import INSTANCE_CALLS, _no_kwargs
from ..values import ConstV, DictV, IterV, NewObjV, ObjV, TupleV, Value, is_const
from ..models import provides
from ..attrs import load_attr
from ..calls import call
from ..operators import _INPLACE, concrete_op, consume, ensure_local
from ..values import ListV
from ...guards.sources import AttrSource

model(collections.deque)(deque_model.construct)


def wrap_made(tracer, value) -> Value:
    """A Counter or deque computed from constants during capture as a value of its own kind
    (anything else as ``tracer.wrap_python`` wraps it)."""
    if type(value) is collections.Counter:
        return DictV({k: tracer.wrap_python(v) for k, v in value.items()}, cls=collections.Counter)
    if type(value) is collections.deque:
        return deque_model.wrap(tracer, value)
    return tracer.wrap_python(value)


@provides("stdlib_binary")
def binary(tracer, op, a: Value, b: Value) -> Value | None:
    """``op`` with a deque or Counter operand (None for other operands)."""
    if isinstance(a, deque_model.DequeV) or isinstance(b, deque_model.DequeV):
        result = deque_model.binary(tracer, op, a, b)
        return wrap_made(tracer, result.obj) if isinstance(result, ObjV) else result
    if not any(isinstance(v, DictV) and v.cls is collections.Counter for v in (a, b)):
        return None
    if not (is_const(a) and is_const(b)):
        raise Unsupported("unsupported_call", f"Counter {op.__name__} with counts that are not constants")
    result = concrete_op(tracer, op, a, b).concrete()
    if op in _INPLACE and isinstance(a, DictV):  # c += d changes c itself
        ensure_local(tracer, a, op.__name__)
        a.items.clear()
        a.items.update(wrap_made(tracer, result).items)
        return a
    return wrap_made(tracer, result)


# ---- Counter ----------------------------------------------------------------------------------
def _const_counter(d: Value, what: str) -> collections.Counter:
    if not is_const(d):
        raise Unsupported("unsupported_call", f"{what} with counts that are not constants")
    return d.concrete()


@model(collections.Counter)
def _counter(tracer, fn, args, kwargs):
    if len(args) > 1:
        raise Unsupported("exception_handling", "TypeError: Counter expected at most 1 argument")
    source = []
    if args:
        arg = args[0]
        source = [arg if isinstance(arg, DictV) else TupleV(_items(tracer, arg, "Counter()"))]
    return wrap_made(tracer, _concrete_call(tracer, collections.Counter, source, kwargs).concrete())


def _items(tracer, v: Value, what: str) -> list:
    items = consume(tracer, v)
    if not all(is_const(i) for i in items):
        raise Unsupported("unsupported_call", f"{what} counting items that are not constants")
    return items


def counter_method(tracer, d: DictV, name: str, args, kwargs) -> Value | None:
    """Counter's own methods (None for the dict methods it shares)."""
    if d.cls is not collections.Counter:
        return None
    if name in ("most_common", "elements", "total"):
        result = getattr(_const_counter(d, f"Counter.{name}()"), name)(
            *[a.concrete() for a in args], **{k: v.concrete() for k, v in kwargs.items()})
        return IterV([tracer.wrap_python(x) for x in result]) if name == "elements" \
            else tracer.wrap_python(result)
    if name in ("update", "subtract"):
        counts = _const_counter(d, f"Counter.{name}()")
        other = [] if not args else [args[0].concrete() if isinstance(args[0], DictV)
                                     else [i.concrete() for i in _items(tracer, args[0], name)]]
        if not _all_const([], kwargs):
            raise Unsupported("unsupported_call", f"Counter.{name}() with non-constant counts")
        ensure_local(tracer, d, f"Counter.{name}")
        getattr(counts, name)(*other, **{k: v.concrete() for k, v in kwargs.items()})
        d.items.clear()
        d.items.update(wrap_made(tracer, counts).items)
        return ConstV(None)
    if name == "fromkeys":
        raise Unsupported("exception_handling", "NotImplementedError: Counter.fromkeys()")
    return None


def counter_from_pairs(pairs) -> collections.Counter:
    """The commit's rebuild of a Counter made in the call, in its order (``Counter(pairs)``
    would count the pairs)."""
    made = collections.Counter()
    dict.update(made, pairs)
    return made


# ---- namedtuple instances ---------------------------------------------------------------------
def namedtuple_method(tracer, t: TupleV, name: str, args, kwargs) -> Value | None:
    if name != "_replace" or not hasattr(t.cls, "_fields"):
        return None
    if args:
        raise Unsupported("exception_handling", "TypeError: _replace() takes keyword arguments")
    unknown = set(kwargs) - set(t.cls._fields)
    if unknown:
        raise Unsupported("exception_handling", f"ValueError: Got unexpected field names: {sorted(unknown)!r}")
    return TupleV([kwargs.get(f, item) for f, item in zip(t.cls._fields, t.items)], t.cls)


# ---- enum -------------------------------------------------------------------------------------
def _call_enum_class(tracer, cls, args, kwargs) -> Value:
    """``Color(1)``: the member with that value (a lookup; ``Enum('Name', ...)`` makes a class)."""
    if len(args) != 1 or kwargs or not is_const(args[0]):
        raise Unsupported("unsupported_call", f"{cls.__name__}(...) other than a member lookup by a constant")
    if getattr(cls._missing_, "__func__", None) is not enum.Enum._missing_.__func__:
        raise Unsupported("unsupported_call", f"{cls.__name__} defines _missing_ (runs code on a lookup)")
    return _concrete_call(tracer, cls, args, {})


INSTANCE_CALLS[enum.EnumType] = _call_enum_class


# ---- operator.methodcaller --------------------------------------------------------------------
def _call_methodcaller(tracer, obj, args, kwargs) -> Value:
    _no_kwargs("methodcaller", kwargs)
    maker, bound = obj.__reduce__()
    if isinstance(maker, functools.partial):  # methodcaller(name, *args, **kw)
        name, keywords = maker.args[0], maker.keywords
    else:
        (name, *bound), keywords = bound, {}
    method = load_attr(tracer, tracer.frames[-1], args[0], name)
    return call(tracer, method, [tracer.wrap_python(a) for a in bound],
                {k: tracer.wrap_python(v) for k, v in keywords.items()})


INSTANCE_CALLS[operator.methodcaller] = _call_methodcaller


# ---- dataclasses ------------------------------------------------------------------------------
def frozen_dataclass_hook(cls: type, name: str) -> bool:
    """Whether ``cls.<name>`` (``__setattr__`` / ``__delattr__``) is the one ``@dataclass(frozen=
    True)`` generates, which only refuses writes (modelled: writes to a frozen instance made
    in the call fall back)."""
    fn = getattr(cls, name, None)
    code = getattr(fn, "__code__", None)
    owner = next((k for k in cls.__mro__ if k.__dict__.get(name) is fn), None)
    params = getattr(owner, "__dataclass_params__", None)
    return code is not None and code.co_filename == "<string>" and params is not None and params.frozen


@provides("refuse_frozen_write")
def refuse_frozen_write(obj: NewObjV, name: str) -> None:
    if frozen_dataclass_hook(obj.cls, "__setattr__"):
        raise Unsupported("exception_handling", f"FrozenInstanceError: cannot assign to field {name!r}")


@model(object.__setattr__)
def _object_setattr(tracer, fn, args, kwargs):
    """``object.__setattr__(self, name, value)``: how a frozen dataclass's ``__init__`` sets
    its fields; modelled on an object made in the call."""
    if len(args) == 3 and not kwargs and isinstance(args[0], NewObjV) and isinstance(args[1], ConstV) \
            and isinstance(args[1].value, str):
        args[0].attrs[args[1].value] = args[2]
        return ConstV(None)
    raise Unsupported("unsupported_call", "object.__setattr__ on an object that existed before the call")


@model(dataclasses.asdict, dataclasses.astuple)
def _asdict(tracer, fn, args, kwargs):
    if len(args) != 1 or kwargs or not _is_dataclass_value(args[0]):
        raise Unsupported("unsupported_call", f"dataclasses.{fn.__name__}() other than of one dataclass "
                          "instance made in the call, with the default factory")
    return _convert(tracer, args[0], as_dict=fn is dataclasses.asdict)


def _is_dataclass_value(v: Value) -> bool:
    return isinstance(v, NewObjV) and dataclasses.is_dataclass(v.cls)


def _convert(tracer, v: Value, as_dict: bool) -> Value:
    """``_asdict_inner`` / ``_astuple_inner`` over values: nested dataclasses, tuples, lists
    and dicts are walked; anything else is deep-copied, which only constants survive as is."""
    if _is_dataclass_value(v):
        pairs = [(f.name, _convert(tracer, v.attrs[f.name], as_dict)) for f in dataclasses.fields(v.cls)
                 if f.name in v.attrs]
        if len(pairs) != len(dataclasses.fields(v.cls)):
            raise Unsupported("exception_handling", "AttributeError: a dataclass field was never set")
        return DictV(dict(pairs)) if as_dict else TupleV([p[1] for p in pairs])
    if isinstance(v, TupleV):
        return TupleV([_convert(tracer, i, as_dict) for i in v.items], v.cls)
    if type(v) is ListV:
        return ListV([_convert(tracer, i, as_dict) for i in v.items])
    if isinstance(v, DictV) and v.cls is dict:
        return DictV({k: _convert(tracer, i, as_dict) for k, i in v.items.items()})
    if isinstance(v, ConstV) and type(v.value) is not tuple:
        return v
    raise Unsupported("unsupported_call", f"dataclasses.asdict/astuple deep-copies a {v.python_type().__name__} "
                      "field (copy.deepcopy is not modelled)")


# ---- functools.lru_cache ----------------------------------------------------------------------
def _call_lru_cached(tracer, obj, args, kwargs, source=None) -> Value:
    name = getattr(obj, "__qualname__", "an lru_cache helper")
    if not all(type(a) is ConstV for a in [*args, *kwargs.values()]):  # a SymV too: it varies
        raise Unsupported("unsupported_call", f"{name} (lru_cache) called with non-constant arguments "
                          "(or numbers that vary between calls): the cache keys on them")
    writes, nodes = len(tracer.heap), len(tracer.graph.nodes)
    inner = tracer.wrap(obj.__wrapped__, None if source is None else AttrSource(source, "__wrapped__"))
    result = call(tracer, inner, args, kwargs)
    if len(tracer.heap) != writes or len(tracer.graph.nodes) != nodes:
        raise Unsupported("unsupported_call", f"{name} (lru_cache) has effects or computes on tensors: "
                          "a cache hit in eager skips them")
    if not (type(result) is ConstV or (isinstance(result, ObjV) and isinstance(result.obj, enum.Enum))):
        raise Unsupported("unsupported_call", f"{name} (lru_cache) returns a mutable or tensor value: "
                          "eager hands back the very cached object on each hit")
    cached = _concrete_call(tracer, obj, args, kwargs).concrete()  # eager's lookup for this call
    fresh = result.concrete()
    if type(cached) is not type(fresh) or not (cached is fresh or cached == fresh):
        raise Unsupported("unsupported_call", f"{name} (lru_cache) holds a result that differs from a "
                          "fresh computation (it read state that has changed since)")
    lookup = _CacheLookup(obj, tuple(a.value for a in args), {k: v.value for k, v in kwargs.items()})
    tracer.heap.write_effect(lookup, [], tracer.where())
    return result


class _CacheLookup:
    """The lookup eager makes in each call, made again by each commit: the result is baked
    into the graph, but ``cache_info()``, the LRU order and evictions follow the calls.

    ``owed`` lookups are skipped: the capture looked the value up once (to compare it with a
    fresh computation), which stands for the lookup of the call it captured."""

    def __init__(self, cached, args: tuple, kwargs: dict):
        self.cached, self.args, self.kwargs = cached, args, kwargs
        self.owed = 1

    def __call__(self) -> None:
        if self.owed:
            self.owed -= 1
            return
        self.cached(*self.args, **self.kwargs)


INSTANCE_CALLS[functools._lru_cache_wrapper] = _call_lru_cached
