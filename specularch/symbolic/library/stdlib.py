"""Standard-library helpers that model code calls, run as their Python logic over values.

``functools.reduce``, ``itertools.chain`` / ``chain.from_iterable`` / ``product`` /
``accumulate``, ``collections.OrderedDict`` / ``defaultdict`` and ``operator.itemgetter`` /
``attrgetter`` objects. Nothing here hands a symbolic value to the C implementation: the
items are iterated as a ``for`` loop would (so what is iterated is guarded the same way),
the functions given to them are inlined or become graph nodes, and the dicts are ``DictV``
values of the right class. Registered in ``builtins_model.BUILTINS`` (and ``INSTANCE_CALLS``
for objects that are called).
"""
from __future__ import annotations

import collections
import functools
import itertools
import operator

from ...records import Unsupported
from ..exceptions import python_error
from .. import operators as ops
from .builtins import _dict, model
from ..values import ConstV, DictV, IterV, ObjV, TupleV, Value
from ..models import provides
from ..attrs import load_attr
from ..calls import call

_OPERATORS = frozenset(ops.BINARY_OPS)


def _apply2(tracer, fn: Value, a: Value, b: Value) -> Value:
    """``fn(a, b)``: ``operator.add``/``mul``/... as the operator itself (sizes stay symbolic,
    sequences concatenate), anything else as an ordinary call."""
    if isinstance(fn, ObjV) and ops_hashable(fn.obj) and fn.obj in _OPERATORS:
        return ops.binary(tracer, fn.obj, a, b)
    return call(tracer, fn, [a, b], {})


def ops_hashable(obj) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _no_kwargs(name: str, kwargs: dict) -> None:
    if kwargs:
        raise Unsupported("unsupported_call", f"{name}() with keyword arguments")


@model(functools.reduce)
def _reduce(tracer, fn, args, kwargs):
    _no_kwargs("functools.reduce", kwargs)
    if len(args) not in (2, 3):
        raise Unsupported("exception_handling", "TypeError: reduce() takes 2 or 3 arguments")
    items = ops.consume(tracer, args[1])
    if len(args) == 3:
        acc, rest = args[2], items
    elif items:
        acc, rest = items[0], items[1:]
    else:
        raise Unsupported("exception_handling",
                          "TypeError: reduce() of empty iterable with no initial value")
    for item in rest:
        acc = _apply2(tracer, args[0], acc, item)
    return acc


@model(itertools.chain)
def _chain(tracer, fn, args, kwargs):
    _no_kwargs("itertools.chain", kwargs)
    return IterV([], source=(item for a in args for item in ops.lazy(tracer, a)))


@model(itertools.chain.from_iterable)
def _chain_from_iterable(tracer, fn, args, kwargs):
    _no_kwargs("itertools.chain.from_iterable", kwargs)
    return IterV([], source=(item for a in ops.lazy(tracer, args[0]) for item in ops.lazy(tracer, a)))


@model(itertools.product)
def _product(tracer, fn, args, kwargs):
    repeat = kwargs.pop("repeat", ConstV(1))
    _no_kwargs("itertools.product", kwargs)
    if not isinstance(repeat, ConstV) or not isinstance(repeat.value, int):
        raise Unsupported("unsupported_call", "itertools.product(repeat=) with a non-constant count")
    if repeat.value < 0:
        raise Unsupported("exception_handling", "ValueError: repeat argument cannot be negative")
    pools = [ops.consume(tracer, a) for a in args] * repeat.value
    return IterV([TupleV(list(row)) for row in itertools.product(*pools)])


@model(itertools.accumulate)
def _accumulate(tracer, fn, args, kwargs):
    func = kwargs.pop("func", args[1] if len(args) > 1 else ConstV(None))
    initial = kwargs.pop("initial", ConstV(None))
    _no_kwargs("itertools.accumulate", kwargs)
    if len(args) > 2:
        raise Unsupported("exception_handling", "TypeError: accumulate() takes at most 2 arguments")
    if isinstance(func, ConstV) and func.value is None:
        func = ObjV(operator.add)
    start = None if isinstance(initial, ConstV) and initial.value is None else initial
    return IterV([], source=_accumulated(tracer, func, ops.iterate(tracer, args[0]), start))


def _accumulated(tracer, func: Value, it, acc: Value | None):
    """accumulate's items, each computed when asked for (``func`` runs when eager runs it)."""
    if acc is not None:
        yield acc
    while (item := it.next()) is not None:
        acc = item if acc is None else _apply2(tracer, func, acc, item)
        yield acc


# ---- collections ----------------------------------------------------------------------------
_KEY_TYPES = (str, int, float, bool, bytes, type(None))


def _checked_keys(d: DictV) -> DictV:
    for k in d.items:
        if not isinstance(k, _KEY_TYPES) and not (
                type(k) is tuple and all(isinstance(i, _KEY_TYPES) for i in k)):
            raise Unsupported("unsupported_call", f"a dict keyed by a {type(k).__name__}")
    return d


@model(collections.OrderedDict)
def _ordered_dict(tracer, fn, args, kwargs):
    if len(args) > 1:
        raise Unsupported("exception_handling", "TypeError: OrderedDict expected at most 1 argument")
    d = _checked_keys(_dict(tracer, dict, args, kwargs))
    return DictV(d.items, cls=collections.OrderedDict)


@model(collections.defaultdict)
def _defaultdict(tracer, fn, args, kwargs):
    factory = args[0] if args else ConstV(None)
    if len(args) > 2:
        raise Unsupported("exception_handling", "TypeError: defaultdict expected at most 2 arguments")
    if isinstance(factory, ConstV) and factory.value is None:
        factory = None
    elif isinstance(factory, ConstV) or (isinstance(factory, ObjV) and not callable(factory.obj)):
        raise Unsupported("exception_handling", "TypeError: first argument must be callable or None")
    d = _checked_keys(_dict(tracer, dict, args[1:], kwargs))
    return DictV(d.items, cls=collections.defaultdict, factory=factory)


@provides("missing_item")
def missing_item(tracer, d: DictV, key) -> Value:
    """``d[key]`` for a key ``d`` lacks: a defaultdict calls its factory and stores the result
    (``__missing__``); any other dict raises KeyError (the call runs eagerly)."""
    if d.cls is collections.Counter:  # Counter.__missing__: 0, not stored
        return ConstV(0)
    if d.factory is None:
        raise python_error(KeyError(key), f"KeyError: {key!r} during capture")
    value = call(tracer, d.factory, [], {})
    ops.setitem(tracer, d, ConstV(key), value)
    return value


def ordered_dict_method(tracer, d: DictV, name: str, args, kwargs) -> Value | None:
    """``move_to_end`` / ``popitem`` (an OrderedDict's take ``last``); None for other names."""
    if name not in ("move_to_end", "popitem"):
        return None
    last = kwargs.get("last", args[-1] if (name == "popitem" and args)
                      or (name == "move_to_end" and len(args) > 1) else ConstV(True))
    if not isinstance(last, ConstV) or (d.cls is not collections.OrderedDict and (args or kwargs)):
        if d.cls is not collections.OrderedDict and name == "popitem":
            raise Unsupported("exception_handling", "TypeError: dict.popitem() takes no arguments")
        raise Unsupported("unsupported_call", f"{name}() with a non-constant `last`")
    if name == "move_to_end" and d.cls is not collections.OrderedDict:
        raise Unsupported("exception_handling", f"AttributeError: 'dict' has no attribute {name!r}")
    ops.ensure_local(tracer, d, f"{d.cls.__name__}.{name}")
    if name == "popitem":
        if not d.items:
            raise python_error(KeyError("popitem(): dictionary is empty"))
        key = next(reversed(d.items)) if last.value else next(iter(d.items))
        return TupleV([ConstV(key), d.items.pop(key)])
    key = args[0].concrete()
    if key not in d.items:
        raise python_error(KeyError(key), f"KeyError: {key!r}")
    value = d.items.pop(key)
    if last.value:
        d.items[key] = value
    else:
        rest = dict(d.items)
        d.items.clear()
        d.items[key] = value
        d.items.update(rest)
    return ConstV(None)


# ---- operator.itemgetter / attrgetter objects -------------------------------------------------
def _call_itemgetter(tracer, obj, args, kwargs) -> Value:
    _no_kwargs("itemgetter", kwargs)
    keys = obj.__reduce__()[1]
    got = [ops.getitem(tracer, args[0], tracer.wrap_python(k)) for k in keys]
    return got[0] if len(keys) == 1 else TupleV(got)


def _call_attrgetter(tracer, obj, args, kwargs) -> Value:
    _no_kwargs("attrgetter", kwargs)
    got = []
    for dotted in obj.__reduce__()[1]:
        v = args[0]
        for part in dotted.split("."):
            v = load_attr(tracer, tracer.frames[-1], v, part)
        got.append(v)
    return got[0] if len(got) == 1 else TupleV(got)


# type of a called object -> handler (tracer, obj, args, kwargs)
INSTANCE_CALLS = {operator.itemgetter: _call_itemgetter, operator.attrgetter: _call_attrgetter}



# deque / Counter / enum / dataclasses / lru_cache / methodcaller and more itertools
from . import stdlib_iter, stdlib_objects, warnings  # noqa: E402,F401
