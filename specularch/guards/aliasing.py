"""Aliasing guards: which inputs are the same object, and that what a call writes shares no
memory (tensors) or identity (other objects) with what it reads through other sources."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .guard import Guard, const_name
from .sources import Source


@dataclass(frozen=True, eq=False)
class AliasGuard(Guard):
    """Two sources gave the same tensor at capture; the graph reads it once."""

    other: Source = None

    def key(self):
        return ("Alias", str(self.source), str(self.other))

    def conditions(self, v, consts, name_of=lambda s: s.expr()):
        """``name_of(source)``: as in ``DistinctGuard.conditions``."""
        return [f"{v} is {name_of(self.other)}"]

    def describe(self):
        return f"{self.source} is {self.other}"

    def reason_from_roots(self, roots: dict) -> str | None:
        try:
            same = eval(self.source.expr(), {}, roots) is eval(self.other.expr(), {}, roots)
        except Exception as e:
            return f"{self} could not be checked ({type(e).__name__}: {e})"
        return None if same else f"{self.source} is no longer the same object as {self.other}{self._at()}"


_DATA_PTR = torch.Tensor.data_ptr
_OFFSET = torch.Tensor.storage_offset


def storages_distinct(written: tuple, others: tuple) -> bool:
    """No two of ``written`` share memory, and none shares memory with any of ``others``.

    It runs on every call of a graph that writes tensors, over every parameter and optimizer
    state: the common answer (all storages distinct) comes from ``map`` over unbound methods,
    without a Python-level loop. A tensor's ``data_ptr()`` is its storage's address when its
    storage offset is 0 (parameters, gradients, optimizer state), and unlike
    ``untyped_storage()`` it makes no Python object; any view at an offset, or any
    coincidence (possibly of empty tensors, which share no memory), is decided exactly."""
    keys = set(map(_DATA_PTR, written))
    if len(keys) == len(written) and keys.isdisjoint(map(_DATA_PTR, others)) \
            and not any(map(_OFFSET, written)) and not any(map(_OFFSET, others)):
        return True
    return _storages_distinct_exact(written, others)


def _storages_distinct_exact(written: tuple, others: tuple) -> bool:
    keys = set()
    for t in written:
        if t.numel():
            key = t.untyped_storage().data_ptr()
            if key in keys:
                return False
            keys.add(key)
    for t in others:
        if t.numel() and t.untyped_storage().data_ptr() in keys:
            return False
    return True


def objects_distinct(written: tuple, others: tuple) -> bool:
    """No object of ``written`` is one of ``others`` (or appears twice in ``written``)."""
    ids = {id(o) for o in written}
    return len(ids) == len(written) and not any(id(o) in ids for o in others)


@dataclass(frozen=True, eq=False)
class DistinctGuard(Guard):
    """What the call writes (tensors: by memory; lists, dicts, objects: by identity) is not
    reachable through another source that was distinct at capture: the graph and its deferred
    writes assumed a read through ``others`` does not see the write."""

    written: tuple = ()
    others: tuple = ()
    memory: bool = True  # tensors compared by storage, other objects by identity

    def key(self):
        return ("Distinct", self.memory, tuple(map(str, self.written)), tuple(map(str, self.others)))

    def conditions(self, v, consts, name_of=lambda s: s.expr()):
        """``name_of(source)``: the expression of a source (the check function passes the
        variable it already holds the source's value in)."""
        check = const_name(consts, storages_distinct if self.memory else objects_distinct)
        written = "".join(f"{name_of(s)}, " for s in self.written)
        others = "".join(f"{name_of(s)}, " for s in self.others)
        return [f"{check}(({written}), ({others}))"]

    def describe(self):
        what = "share no memory with" if self.memory else "are not the same object as"
        others = ", ".join(map(str, self.others[:4])) + (", ..." if len(self.others) > 4 else "")
        return f"written {', '.join(map(str, self.written))} {what} each other or {others}"

    def reason_from_roots(self, roots: dict) -> str | None:
        try:
            ok = eval(self.conditions("None", consts := {})[0], {**consts}, roots)
        except Exception:
            ok = False
        return None if ok else f"aliasing changed: expected {self.describe()}{self._at()}"
