"""The values a rolled loop (``symbolic/rolled/loops.py``) puts on the symbolic stack: the
iterator of ``range(n)`` over a symbolic ``n``, the loop index while the body is captured, and
the list a loop appended to once per iteration, whose length is then only known at run time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx

from ...records import Unsupported
from .symint import SymV
from . import ConstV, IterV, Value


INDEX_AS_PYTHON = "the body uses the loop index as a Python value (a branch, a list index, ...)"


class RollRefused(Unsupported):
    """A loop cannot be rolled (its body is not the same for every iteration, or what
    follows needs it unrolled). Capture starts again with this loop unrolled, as before.

    ``site`` is ``(id(code), offset of FOR_ITER)``; ``where`` the user's ``file:line``.
    """

    def __init__(self, site: tuple, where: str, why: str, form: str = "range(n)"):
        super().__init__("unsupported_call", f"loop at {where} not rolled: {why}")
        self.site, self.where, self.why, self.form = site, where, why, form


@dataclass(eq=False, repr=False)
class SymRangeIterV(IterV):
    """``iter(range(...))`` with a symbolic bound, about to be consumed by ``FOR_ITER``, which
    rolls the loop: ``n`` iterations (a ``SymV``), the index ``start + k * step`` in the
    ``k``-th. Anything else that pulls from it unrolls: the bounds are specialised."""

    n: Any = None
    rolling_refused: bool = False
    start: Any = None          # a Value: ConstV(0) for ``range(n)``
    step: int = 1
    bounds: tuple = ()         # the Values given to range()

    def next(self) -> Value | None:
        if self.source is None and not self.items and self.pos == 0:
            bounds = [b.concrete() for b in self.bounds] if self.bounds else [self.n.concrete()]
            self.items = [ConstV(i) for i in range(*bounds)]
        return super().next()


@dataclass(eq=False, repr=False)
class LoopIndexV(SymV):
    """The loop index while a rolled body is captured: torch ops take it as a graph input;
    using it as a Python value would bake one iteration's index into the body."""

    site: tuple = ()
    where: str = ""
    form: str = "range(n)"

    def concrete(self):
        raise RollRefused(self.site, self.where, INDEX_AS_PYTHON, self.form)


class RolledListV(Value):
    """A list a rolled loop appended one tensor to per iteration: ``head`` (the items it had
    before the rolled iterations) followed, at run time, by ``node``'s list. It supports what
    needs no per-item Python value: ``torch.stack`` / ``torch.cat`` of it, ``len`` of it.
    Anything else is ``Unsupported`` (capture then unrolls the loop)."""

    holds_tensors = True  # values.contains_tensor: a list of tensors

    def __init__(self, node: torch.fx.Node, examples: list, length: SymV, where: str):
        self.node, self.examples, self.length, self.where = node, examples, length, where
        self.source = None

    @property
    def items(self):
        raise Unsupported("unsupported_call", f"the list filled by the rolled loop at {self.where} "
                          "is used item by item (only torch.stack/cat and len are supported)")

    def concrete(self):
        return list(self.examples)

    def python_type(self):
        return list

    def __repr__(self):
        return f"RolledListV({self.node.name}, {self.length!r})"


def become_rolled(lst: Value, rolled: RolledListV) -> None:
    """Turn the ListV ``lst`` into ``rolled`` in place: every path that reaches the list (two
    locals, a tuple, another frame) must see what the loop left in it, not its first items."""
    lst.__dict__.clear()
    lst.__class__ = RolledListV
    lst.__dict__.update(rolled.__dict__)


class TensorListV(RolledListV):
    """A list of tensors from the call passed into the graph whole
    (``symbolic/rolled/lists.py``): one placeholder, items that share item 0's metadata, a
    length known only at run time. A ``for x in`` loop over it rolls (the body indexes the
    list with the loop counter)."""

    def __init__(self, node: torch.fx.Node, examples: list, length: SymV, where: str, source):
        super().__init__(node, examples, length, where)
        self.source = source

    @property
    def items(self):
        raise Unsupported("unsupported_call", f"the list {self.source} passed whole into the "
                          "graph for the loop at " f"{self.where} is used item by item or changed "
                          "(only iterating it in that loop, len(), torch.stack/cat are supported)")

    def __repr__(self):
        return f"TensorListV({self.source}, {self.length!r})"


@dataclass(eq=False, repr=False)
class ListIterV(SymRangeIterV):
    """``iter(xs)`` of a ``TensorListV``, about to be consumed by ``FOR_ITER``: rolls the loop
    as ``range(len(xs))`` does, handing out ``xs[k]`` instead of ``k``."""

    of: Any = None             # the TensorListV
    enumerated: bool = False   # ``enumerate(xs)``: hands out ``(k, xs[k])``
    count_from: int = 0        # ``enumerate(xs, start)``: ``k`` is ``start + index``
    zipped: tuple = ()         # ``zip(xs, ys, ...)``: every TensorListV; hands out a tuple

    def next(self) -> Value | None:
        raise Unsupported("unsupported_call", f"the iterator of {self.of.source} is used other "
                          "than by its for loop")


@dataclass(eq=False, repr=False)
class RowsIterV(SymRangeIterV):
    """``iter(x)`` of a tensor whose first size is symbolic, about to be consumed by
    ``FOR_ITER``: rolls the loop as ``range(x.size(dim))`` does, handing out
    item ``k`` of ``x.unbind(dim)`` (``rolled/rows.py``)."""

    rows_of: Any = None        # the TensorV
    dim: int = 0               # ``x.unbind(dim)``
    split: bool = False        # ``x.split(1, dim)``: slices of one row, not rows
    enumerated: bool = False   # ``enumerate(x)``: hands out ``(k, x[k])``
    count_from: int = 0        # ``enumerate(x, start)``: ``k`` is ``start + index``

    def next(self) -> Value | None:
        raise Unsupported("unsupported_call", "the iterator of a tensor's rows is used other than "
                          "by its for loop")


@dataclass(eq=False, repr=False)
class ItemNumberV(SymV):
    """A number of the item of a rolled loop over a list passed whole (``xs[k][j]`` of a list
    of tuples, ``objs[k].name`` of a list of objects): a run-time value, ``part`` = (the
    list, ``j`` or ``name``); a variable that holds it after the loop holds the last item's."""

    part: tuple = ()
