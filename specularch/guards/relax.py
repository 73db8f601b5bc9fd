"""Profiling and relaxation: deciding what a graph must *not* specialise on.

JANUS profiles the first calls and specialises the first graph on what stayed fixed; what
varied is generalised at once. Later, when a guard fails because an argument's size or a
Python number changed, the assumption is relaxed (the dimension becomes dynamic, the number
becomes a graph input) instead of capturing one graph per value. Argument slots are
generalised, and on a guard failure the sizes of tensors held in tuple/list arguments
(``batch[0]``); everything else stays specialised and guarded.
"""
from __future__ import annotations

from typing import Any

import torch

from . import DictKeysGuard, LenGuard, TensorGuard, ValueGuard
from .sources import ItemSource, LocalSource
from .. import log


def argument_fact(value: Any) -> tuple:
    """What profiling records about one argument."""
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value), value.dtype, value.device, tuple(value.shape))
    if type(value) in (int, float):
        return ("number", type(value), value)
    if type(value) is list:
        return ("list", list, len(value))
    return ("other", type(value))


NESTED_SIZES = 4  # distinct shapes of a tensor inside an argument before its sizes are dynamic


class Generalisation:
    """Per code object: which argument dims are dynamic and which numbers are inputs."""

    def __init__(self) -> None:
        self.dynamic_dims: dict[int, set[int]] = {}
        self.dynamic_sources: dict = {}     # tensors inside arguments (`batch[0]`) -> dims
        self.nested_shapes: dict = {}       # such a tensor's source -> shapes its guards failed on
        self.symbolic_scalars: set[int] = set()
        self.symbolic_sources: set = set()  # other sources (e.g. `self.count`) read as inputs
        self.append_only: set = set()       # lists that only grow (`self.history.append(x)`)
        self.keyed_dicts: set = set()       # dicts used through single keys (`self.cache[k] = v`)
        self.tracked: set = set()           # containers the code turned out to use as a whole
        self.varied_lists: set = set()      # lists whose length changed: a loop over one rolls
        self.relaxations: list[str] = []
        self.static_sizes = False  # sizes proved to steer Python: no more dynamic dims
        self.size_hints: dict[int, tuple] = {}  # slot -> shape, all of one earlier call

    def refuse(self, source) -> None:
        """The code uses a relaxed list/dict as a whole after all: track it again."""
        what = "length" if source in self.append_only else "keys"
        self.append_only.discard(source)
        self.keyed_dicts.discard(source)
        self.tracked.add(source)
        self.note(f"{source}: the code uses it as a whole (iterates it, takes its length, "
                  f"reads old items ...), so it is tracked (and its {what} guarded) again")

    def sizes_steer_python(self, where: str) -> None:
        """A size of an intermediate tensor, which the dynamic argument sizes do not express,
        decided Python control flow and changed: sizes are specialised (and guarded) again,
        one graph per shape, instead of failing that assumption on every new size."""
        if self.dynamic_dims:
            self.dynamic_dims.clear()
            self.static_sizes = True
            self.note(f"dynamic sizes made static again: a size computed inside the function "
                      f"steers Python control flow at {where}")

    def hint_sizes(self, shapes: dict[int, tuple]) -> None:
        """The tensor arguments' shapes of one earlier call: what a compile of the dynamic
        dims is traced at (``Assumptions.size_hints``)."""
        self.size_hints = {slot: tuple(shape) for slot, shape in shapes.items()}

    def from_profile(self, argnames: tuple, observations: list[tuple]) -> None:
        """Generalise what varied over the profiled calls (plus the current one)."""
        shapes = [tuple(c[4] if c[0] == "tensor" else None for c in row) for row in observations]
        if shapes:  # the commonest call's shapes (a full batch, not the short one)
            common = max(shapes, key=shapes.count)
            self.hint_sizes({i: s for i, s in enumerate(common) if s is not None})
        for slot, column in enumerate(zip(*observations)):
            name = argnames[slot] if slot < len(argnames) else f"#{slot}"
            kinds = {c[:2] if c[0] != "tensor" else c[:4] for c in column}
            if len(kinds) != 1:
                continue
            first = column[0]
            if first[0] == "tensor" and len({len(c[4]) for c in column}) == 1 \
                    and not self.static_sizes:
                varied = {d for d in range(len(first[4])) if len({c[4][d] for c in column}) > 1}
                if varied:
                    self._dims(slot, name, varied, "varied while profiling",
                               sorted({c[4] for c in column}))
            elif first[0] == "number" and len({c[2] for c in column}) > 1:
                self._scalar(slot, name, "varied while profiling", [c[2] for c in column])
            elif first[0] == "list" and len({c[2] for c in column}) > 1:
                self._list(LocalSource(slot, name), "varied while profiling",
                           sorted({c[2] for c in column}))

    def from_guard_failure(self, guard, value) -> bool:
        """Relax the assumption a failed guard encoded, if it is one we generalise."""
        if isinstance(guard, LenGuard) and guard.expected_type is list and type(value) is list \
                and len(value) != guard.expected and guard.source not in self.varied_lists:
            self._list(guard.source, "changed between calls", [guard.expected, len(value)])
        if isinstance(guard, ValueGuard) and not isinstance(guard.source, LocalSource) \
                and type(guard.expected) in (int, float) and type(value) is type(guard.expected) \
                and guard.source not in self.symbolic_sources:
            self.symbolic_sources.add(guard.source)
            self.note(f"{guard.source}: Python number made a graph input "
                      f"(changed between calls: {guard.expected!r}, {value!r})")
            return True
        if isinstance(guard, LenGuard) and guard.expected_type is list and type(value) is list \
                and len(value) > guard.expected and guard.source not in self.append_only \
                and guard.source not in self.tracked:
            self.append_only.add(guard.source)
            self.note(f"{guard.source}: list treated as append-only; its length is "
                      f"no longer guarded (grew from {guard.expected} to {len(value)})")
            return True
        if isinstance(guard, DictKeysGuard) and guard.relaxable and type(value) is guard.expected_type \
                and guard.source not in self.keyed_dicts and guard.source not in self.tracked:
            self.keyed_dicts.add(guard.source)
            self.note(f"{guard.source}: dict used through single keys; its key set is no longer "
                      f"guarded (keys changed from {_keys(guard.keys)} to {_keys(value)})")
            return True
        if isinstance(guard, TensorGuard) and _inside_argument(guard.source):
            return self._nested_dims(guard, value)
        if not isinstance(guard.source, LocalSource):
            return False
        slot, name = guard.source.index, guard.source.name
        if isinstance(guard, TensorGuard) and isinstance(value, torch.Tensor):
            if (type(value), value.dtype, value.device, value.dim()) != (
                    guard.tensor_type, guard.dtype, guard.device, len(guard.shape)):
                return False
            changed = {d for d, (a, b) in enumerate(zip(guard.shape, value.shape))
                       if a != b and d not in guard.dynamic}
            if changed and value.is_contiguous() == guard.contiguous and not self.static_sizes:
                self._dims(slot, name, changed, "changed between calls",
                           [guard.shape, tuple(value.shape)])
                return True
            return False
        if isinstance(guard, ValueGuard) and type(guard.expected) in (int, float) \
                and type(value) is type(guard.expected) and slot not in self.symbolic_scalars:
            self._scalar(slot, name, "changed between calls", [guard.expected, value])
            return True
        return False

    def _nested_dims(self, guard, value) -> bool:
        """A tensor inside a tuple/list argument whose sizes keep changing (``batch[0]``).
        A few sizes (an epoch's full and short last batch, a few bucketed lengths) are each
        worth a static graph, which every backend and pass optimises; the
        ``NESTED_SIZES``-th distinct size makes the dims dynamic (a rolled loop then takes
        every length)."""
        if not isinstance(value, torch.Tensor) or (type(value), value.dtype, value.device,
                                                    value.dim()) != (
                guard.tensor_type, guard.dtype, guard.device, len(guard.shape)):
            return False
        changed = {d for d, (a, b) in enumerate(zip(guard.shape, value.shape))
                   if a != b and d not in guard.dynamic}
        if not changed or value.is_contiguous() != guard.contiguous or self.static_sizes:
            return False
        seen = self.nested_shapes.setdefault(guard.source, {tuple(guard.shape)})
        seen.add(tuple(value.shape))
        if len(seen) < NESTED_SIZES:
            return False
        self.dynamic_sources.setdefault(guard.source, set()).update(changed)
        self.note(f"{guard.source}: dimension(s) {sorted(changed)} made dynamic (changed between "
                  f"calls: {', '.join(str(s) for s in sorted(seen))})")
        return True

    def _list(self, source, why: str, seen: list) -> None:
        """A list whose length varies: a ``for x in`` loop over it may roll
        (symbolic/rolled/lists.py), as ``range(n)`` does over a number that varies."""
        self.varied_lists.add(source)
        self.note(f"{source}: list length {why} ({', '.join(map(str, seen))}): a loop over it "
                  "may be captured once for every length")

    def note(self, text: str) -> None:
        self.relaxations.append(text)
        log.emit("relaxations", text)

    def _dims(self, slot: int, name: str, dims: set[int], why: str, seen: list) -> None:
        self.dynamic_dims.setdefault(slot, set()).update(dims)
        shown = ", ".join(str(s) for s in seen)
        self.note(
            f"L[{name!r}]: dimension(s) {sorted(dims)} made dynamic ({why}: {shown})")

    def _scalar(self, slot: int, name: str, why: str, seen: list) -> None:
        self.symbolic_scalars.add(slot)
        shown = ", ".join(repr(s) for s in seen[:6])
        self.note(f"L[{name!r}]: Python number made a graph input ({why}: {shown})")


def _inside_argument(source) -> bool:
    """An item (at any depth) of a tuple/list argument."""
    if not isinstance(source, ItemSource):
        return False
    while isinstance(source, ItemSource):
        source = source.base
    return isinstance(source, LocalSource)


def _keys(keys) -> str:
    shown = [repr(k) for k in list(keys)[:6]]
    return "[" + ", ".join(shown) + (", ..." if len(keys) > 6 else "") + "]"
