"""Accesses to lists and dicts that a relaxation stopped tracking as a whole.

A list that keeps growing (``self.history.append(h)``) becomes an ``AppendOnlyListV``; a dict
whose key set keeps changing (``self.cache[key] = y``, ``MEMO[key] = n``) becomes a
``KeyedDictV``. Neither guards its length or key set, so one graph serves every call. What
they allow is exactly what does not depend on the untracked part:

* append-only list: ``append``/``extend`` (committed as appends) and reading back, by
  negative index, an item appended in this same call (``log[-1]``);
* keyed dict: ``d[k] = v`` (committed as that one item write), ``d[k]``, ``k in d``,
  ``d.get(k[, default])`` and ``d.setdefault(k[, default])`` with constant ``str``/``int``
  keys (an int that became a graph input is specialised: one graph per key, as for a
  string); a read guards that one entry (and that ``k`` is present or absent).

Anything else (``len``, iteration, ``pop``, ``del``, old items of the list, ...) raises
``RelaxationRefused``: the dispatcher then tracks the container whole again and recaptures.
"""
from __future__ import annotations

from ...guards import ContainsGuard, ItemSource
from ..values.raised import python_error
from ..values.symint import SymV
from ..values import AppendOnlyListV, ConstV, KeyedDictV, RelaxationRefused, Value


def getitem(tracer, c, key: Value) -> Value:
    if isinstance(c, AppendOnlyListV):
        index = key.value if isinstance(key, ConstV) else None
        if type(index) is int and -len(c.appended) <= index < 0:
            return c.appended[index]
        raise RelaxationRefused(c.source)
    k = _key(c, key)
    if k in c.written:
        return c.written[k]
    if not _present(tracer, c, k):
        raise python_error(KeyError(k), f"KeyError: {k!r} (reading {c.source})")
    return tracer.wrap(c.real[k], ItemSource(c.source, k))


def setitem(tracer, c, key: Value, value: Value) -> None:
    if not isinstance(c, KeyedDictV):
        raise RelaxationRefused(c.source)
    k = _key(c, key)
    c.written[k] = value
    tracer.heap.write_item(c, ConstV(k), value, tracer.where())


def contains(tracer, key: Value, c) -> bool:
    if not isinstance(c, KeyedDictV):
        raise RelaxationRefused(c.source)
    k = _key(c, key)
    return k in c.written or _present(tracer, c, k)


def call_method(tracer, c, name: str, args: list, kwargs: dict, consume) -> Value:
    """``consume(tracer, v)``: the items ``v`` yields (``operators.consume``, handed in by
    the caller: speculation sits below the core)."""
    if kwargs:
        raise RelaxationRefused(c.source)
    if isinstance(c, AppendOnlyListV):
        if name == "append" and len(args) == 1:
            _append(tracer, c, args[0])
            return ConstV(None)
        if name == "extend" and len(args) == 1:
            for item in consume(tracer, args[0]):
                _append(tracer, c, item)
            return ConstV(None)
        raise RelaxationRefused(c.source)
    if name in ("get", "setdefault") and len(args) in (1, 2):
        default = args[1] if len(args) == 2 else ConstV(None)
        if contains(tracer, args[0], c):
            return getitem(tracer, c, args[0])
        if name == "setdefault":
            setitem(tracer, c, args[0], default)
        return default
    if name == "__contains__" and len(args) == 1:
        return ConstV(contains(tracer, args[0], c))
    raise RelaxationRefused(c.source)


def _append(tracer, c: AppendOnlyListV, value: Value) -> None:
    c.appended.append(value)
    tracer.heap.write_append(c, value, tracer.where())


def _key(c: KeyedDictV, key: Value):
    if isinstance(key, ConstV) and type(key.value) in (str, int):
        return key.value
    if isinstance(key, SymV) and type(key.value) is int:
        return key.concrete()  # an int that is a graph input: this graph is for this key
    raise RelaxationRefused(c.source)  # keys that are not plain constants: track it whole


def _present(tracer, c: KeyedDictV, k) -> bool:
    present = k in c.real
    tracer.add_guard(ContainsGuard, c.source, key_value=k, expected=present)
    return present
