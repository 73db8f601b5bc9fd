"""More of ``itertools`` made in the optimized call, run as their Python logic over values.

``islice``, ``count``, ``repeat``, ``zip_longest`` and ``groupby`` are lazy iterators
(``IterV`` with a generator source) that pull from what they iterate exactly when and as far
as CPython's C code does (so a shared iterator, or a function called per item, sees eager's
order); ``combinations``, ``combinations_with_replacement`` and ``permutations`` take their
whole input when made, as CPython does. Arguments that control them (counts, bounds) must
be constants; invalid ones raise in eager, so the call runs eagerly.
"""
from __future__ import annotations

import itertools
import numbers

from ...records import Unsupported
from .. import operators as ops
from .builtins import model
from .stdlib import _no_kwargs
from ..values import ConstV, IterV, TupleV, Value, is_const
from ..calls import call


def _const(v: Value | None, what: str, kinds=(int,), none_ok=True):
    if v is None:
        return None
    if not isinstance(v, ConstV):
        raise Unsupported("unsupported_call", f"{what} that is not a constant")
    if (v.value is None and none_ok) or (isinstance(v.value, kinds) and not isinstance(v.value, bool)):
        return v.value
    raise Unsupported("exception_handling", f"ValueError/TypeError: bad {what} {v.value!r}")


@model(itertools.islice)
def _islice(tracer, fn, args, kwargs):
    _no_kwargs("itertools.islice", kwargs)
    if len(args) not in (2, 3, 4):
        raise Unsupported("exception_handling", "TypeError: islice expected 2 to 4 arguments")
    bounds = [_const(a, "islice bound") for a in args[1:]]
    start, stop, step = (0, bounds[0], 1) if len(bounds) == 1 else (bounds + [None])[:3]
    start, step = start or 0, 1 if step is None else step
    if start < 0 or (stop is not None and stop < 0) or step < 1:
        raise Unsupported("exception_handling", "ValueError: invalid islice() argument")
    return IterV([], source=_sliced(ops.iterate(tracer, args[0]), start, stop, step))


def _sliced(it: IterV, start: int, stop, step: int):
    """CPython's islice_next: skip to the next wanted index, stop at ``stop`` without
    pulling past it."""
    count, wanted = 0, start
    while True:
        while count < wanted:
            if it.next() is None:
                return
            count += 1
        if stop is not None and count >= stop:
            return
        item = it.next()
        if item is None:
            return
        count += 1
        wanted = wanted + step if stop is None else min(wanted + step, stop)
        yield item


@model(itertools.count)
def _count(tracer, fn, args, kwargs):
    start = args[0] if args else kwargs.pop("start", ConstV(0))
    step = args[1] if len(args) > 1 else kwargs.pop("step", ConstV(1))
    _no_kwargs("itertools.count", kwargs)
    first = _const(start, "count start", numbers.Number, none_ok=False)
    delta = _const(step, "count step", numbers.Number, none_ok=False)
    return IterV([], source=(ConstV(x) for x in itertools.count(first, delta)))


@model(itertools.repeat)
def _repeat(tracer, fn, args, kwargs):
    obj = args[0] if args else kwargs.pop("object", None)
    times = _const(args[1] if len(args) > 1 else kwargs.pop("times", None), "repeat times")
    _no_kwargs("itertools.repeat", kwargs)
    if obj is None:
        raise Unsupported("exception_handling", "TypeError: repeat() missing argument 'object'")
    return IterV([], source=(obj for _ in (itertools.repeat(None) if times is None
                                           else range(times))))


@model(itertools.zip_longest)
def _zip_longest(tracer, fn, args, kwargs):
    fill = kwargs.pop("fillvalue", ConstV(None))
    _no_kwargs("itertools.zip_longest", kwargs)
    return IterV([], source=_longest_rows([ops.iterate(tracer, a) for a in args], fill))


def _longest_rows(columns: list, fill: Value):
    """zip_longest's rows: an exhausted column gives ``fill`` and is not pulled again; the
    row in which the last column runs out is dropped (CPython's zip_longest_next)."""
    active = len(columns)
    while active:
        row = []
        for i, it in enumerate(columns):
            item = None if it is None else it.next()
            if item is None:
                if it is not None:
                    active -= 1
                    columns[i] = None
                    if not active:
                        return
                item = fill
            row.append(item)
        yield TupleV(row)


def _pool_and_r(tracer, fn, args, kwargs):
    r = args[1] if len(args) > 1 else kwargs.pop("r", None)
    _no_kwargs(f"itertools.{fn.__name__}", kwargs)
    pool = ops.consume(tracer, args[0])  # the whole input, taken when made
    if fn is itertools.permutations and (r is None or (isinstance(r, ConstV) and r.value is None)):
        return pool, len(pool)
    r = None if r is None else _const(r, f"{fn.__name__} r", none_ok=False)
    if r is None or r < 0:
        raise Unsupported("exception_handling", f"TypeError/ValueError: {fn.__name__}() needs r >= 0")
    return pool, r


def _index_tuples(tracer, fn, args, kwargs):
    """The tuples CPython yields, computed over item positions (items need not be constants)."""
    pool, r = _pool_and_r(tracer, fn, list(args), dict(kwargs))
    return IterV([TupleV([pool[i] for i in row]) for row in fn(range(len(pool)), r)])


for _maker in (itertools.combinations, itertools.combinations_with_replacement, itertools.permutations):
    model(_maker)(_index_tuples)


# ---- groupby ---------------------------------------------------------------------------------
@model(itertools.groupby)
def _groupby(tracer, fn, args, kwargs):
    key = args[1] if len(args) > 1 else kwargs.pop("key", ConstV(None))
    _no_kwargs("itertools.groupby", kwargs)
    state = _GroupBy(tracer, ops.iterate(tracer, args[0]), None if is_const(key) and key.concrete() is None else key)
    return IterV([], source=state.groups())


class _GroupBy:
    """CPython's groupby object: one shared position (``current``) that the outer iterator
    and the newest group both advance; an older group is dead once the outer one moved on."""

    _NONE = object()

    def __init__(self, tracer, it: IterV, key: Value | None):
        self.tracer, self.it, self.key = tracer, it, key
        self.current_key = self.current_value = self.target = self._NONE
        self.generation = 0

    def _step(self) -> bool:
        value = self.it.next()
        if value is None:
            return False
        if self.key is None:
            key = value
        else:
            key = call(self.tracer, self.key, [value], {})
        self.current_value, self.current_key = value, key
        return True

    def _same(self, a: Value, b: Value) -> bool:
        if ops.identical(a, b):
            return True
        if not (is_const(a) and is_const(b)):
            raise Unsupported("data_dependent_branch", "groupby() comparing keys that are not constants")
        return a.concrete() == b.concrete()

    def groups(self):
        while True:
            self.generation += 1  # the previous group is dead from here on
            while self.current_key is self._NONE or (
                    self.target is not self._NONE and self._same(self.target, self.current_key)):
                if not self._step():
                    return
            self.target = self.current_key
            yield TupleV([self.current_key, IterV([], source=self._group(self.generation, self.target))])

    def _group(self, generation: int, target: Value):
        while generation == self.generation:
            if self.current_value is self._NONE and not self._step():
                return
            if not self._same(target, self.current_key):
                return
            value, self.current_value = self.current_value, self._NONE
            yield value
