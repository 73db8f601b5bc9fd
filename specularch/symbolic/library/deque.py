"""``collections.deque`` made in the optimized call: a ``DequeV``, a list value with a ``maxlen``.

A deque indexes, iterates, measures and tests like a list, so ``DequeV`` subclasses ``ListV``
and shares those paths; what differs is modelled here: the methods (``appendleft``,
``popleft``, ``rotate``, ... and the trimming a bounded deque does on every add), ``maxlen``,
slices (a deque refuses them: TypeError), ``+``/``*``/``+=`` (a deque, or TypeError with a
list), and the rebuild after the call (a real ``deque`` with the same ``maxlen``). A deque
that existed before the call is an opaque object: its methods are not modelled and the call
runs eagerly.
"""
from __future__ import annotations

import collections
import operator

from ...records import Unsupported
from ...shadow_heap.rebuild import CallOf, Constant, ListOf, Rebuild
from .. import operators as ops
from ..values import ConstV, Value, is_const
from ..values.deque import DequeV
from ..models import provides


def make(tracer, items: list, maxlen) -> DequeV:
    if maxlen is not None and (not isinstance(maxlen, int) or isinstance(maxlen, bool)):
        raise Unsupported("exception_handling", "TypeError: an integer is required")
    if maxlen is not None and maxlen < 0:
        raise Unsupported("exception_handling", "ValueError: maxlen must be non-negative")
    d = DequeV([], maxlen=maxlen)
    _extend(d, items, left=False)
    return d


def construct(tracer, fn, args, kwargs) -> DequeV:
    """``deque(iterable=(), maxlen=None)``."""
    if len(args) > 2 or set(kwargs) - {"iterable", "maxlen"}:
        raise Unsupported("exception_handling", "TypeError: deque() takes at most 2 arguments")
    iterable = args[0] if args else kwargs.get("iterable")
    maxlen = args[1] if len(args) > 1 else kwargs.get("maxlen", ConstV(None))
    if not isinstance(maxlen, ConstV):
        raise Unsupported("unsupported_call", "deque(maxlen=) with a non-constant maxlen")
    items = ops.consume(tracer, iterable) if iterable is not None else []
    return make(tracer, items, maxlen.value)


def _extend(d: DequeV, items: list, left: bool) -> None:
    for item in items:  # item by item: a bounded deque trims as it goes
        if left:
            d.items.insert(0, item)
        else:
            d.items.append(item)
        d.trim(from_left=not left)


def _index(d: DequeV, k) -> int:
    if not isinstance(k, int):
        raise Unsupported("exception_handling", f"TypeError: sequence index must be integer, "
                          f"not {type(k).__name__!r}")
    return k


@provides("deque_check_key")
def check_key(container, key) -> None:
    """Subscripts of a deque take integers only (``d[1:]`` raises TypeError)."""
    if isinstance(container, DequeV):
        _index(container, key)


def _pop(d: DequeV, left: bool) -> Value:
    if not d.items:
        raise Unsupported("exception_handling", "IndexError: pop from an empty deque")
    return d.items.pop(0 if left else -1)


def _rotate(d: DequeV, n: int) -> None:
    if d.items:
        n %= len(d.items)
        d.items[:] = d.items[-n:] + d.items[:-n] if n else d.items


def _insert(d: DequeV, i: int, value: Value) -> None:
    if d.maxlen is not None and len(d.items) >= d.maxlen:
        raise Unsupported("exception_handling", "IndexError: deque already at its maximum size")
    d.items.insert(i, value)


# name -> (tracer, deque, args) -> Value; these change the deque
_MUTATORS = {
    "append": lambda t, d, a: _extend(d, [a[0]], left=False),
    "appendleft": lambda t, d, a: _extend(d, [a[0]], left=True),
    "extend": lambda t, d, a: _extend(d, ops.consume(t, a[0]), left=False),
    "extendleft": lambda t, d, a: _extend(d, ops.consume(t, a[0]), left=True),
    "pop": lambda t, d, a: _pop(d, left=False),
    "popleft": lambda t, d, a: _pop(d, left=True),
    "rotate": lambda t, d, a: _rotate(d, a[0].concrete() if a else 1),
    "insert": lambda t, d, a: _insert(d, a[0].concrete(), a[1]),
    "clear": lambda t, d, a: d.items.clear(),
    "reverse": lambda t, d, a: d.items.reverse(),
}
_ARITY = {"append": 1, "appendleft": 1, "extend": 1, "extendleft": 1, "pop": 0, "popleft": 0,
          "rotate": (0, 1), "insert": 2, "clear": 0, "reverse": 0, "copy": 0, "count": 1,
          "index": (1, 2, 3), "remove": 1}


def call_method(tracer, d: DequeV, name: str, args: list, kwargs: dict) -> Value:
    arity = _ARITY.get(name)
    if arity is None:
        raise Unsupported("exception_handling" if not hasattr(collections.deque, name) else "unsupported_call",
                          f"deque.{name}")
    if kwargs or len(args) not in (arity if isinstance(arity, tuple) else (arity,)):
        raise Unsupported("exception_handling", f"TypeError: deque.{name}() arguments")
    if name == "copy":
        return DequeV(list(d.items), maxlen=d.maxlen)
    if name in ("count", "index", "remove"):  # the same as a list's
        from .methods import _list_method
        if name == "index" and len(args) > 1:
            raise Unsupported("unsupported_call", "deque.index() with start/stop")
        return _list_method(tracer, d, name, args, kwargs)
    result = _MUTATORS[name](tracer, d, args)
    return result if isinstance(result, Value) else ConstV(None)


def binary(tracer, op, a: Value, b: Value) -> Value:
    """``+``, ``*``, ``+=``, ``*=`` with a deque operand."""
    if op is operator.iadd and isinstance(a, DequeV):  # extends in place, any iterable
        _extend(a, ops.consume(tracer, b), left=False)
        return a
    if op in (operator.add, operator.iadd) and isinstance(a, DequeV) and isinstance(b, DequeV):
        return make(tracer, a.items + b.items, a.maxlen)
    if op in (operator.mul, operator.imul, operator.rmul) and isinstance(a, DequeV) \
            and isinstance(b, ConstV) and isinstance(b.value, int):
        items = a.items * max(b.value, 0)
        if op is operator.imul:
            a.items[:] = []
            _extend(a, items, left=False)
            return a
        return make(tracer, items, a.maxlen)
    if is_const(a) and is_const(b):  # eager's own answer (or its TypeError)
        return ops.concrete_op(tracer, op, a, b)
    raise Unsupported("unsupported_call", f"operator {op.__name__} with a deque operand")


def wrap(tracer, value: collections.deque) -> DequeV:
    """A deque computed from constants during capture (``deque_a + deque_b``)."""
    return DequeV([tracer.wrap_python(x) for x in value], maxlen=value.maxlen)


def _rebuild(items: list, maxlen):
    return collections.deque(items, maxlen)


def build_spec(builder, v: DequeV) -> Rebuild:
    """How the commit rebuilds ``v``: ``deque([...], maxlen)``. That record makes a new object
    each time it is used, so a second use (returned twice, returned and stored) is refused
    rather than split into two deques."""
    if id(v) in builder._rebuilt:
        raise Unsupported("unsupported_call", "a deque made in the call is returned or stored "
                          "in more than one place")
    builder._rebuilt.add(id(v))
    return CallOf(_rebuild, (ListOf(tuple(builder.build(i) for i in v.items), id(v)),
                             Constant(v.maxlen)))
