"""``collections.deque`` made in the optimized call: a list value with a ``maxlen`` (its
methods and construction: ``library/deque.py``)."""
from __future__ import annotations

import collections
from dataclasses import dataclass

from . import ListV


@dataclass(eq=False, repr=False)
class DequeV(ListV):
    maxlen: int | None = None

    def concrete(self):
        return collections.deque([i.concrete() for i in self.items], self.maxlen)

    def python_type(self):
        return collections.deque

    def trim(self, from_left: bool) -> None:
        """A bounded deque drops items from the other end when it grows past ``maxlen``."""
        while self.maxlen is not None and len(self.items) > self.maxlen:
            self.items.pop(0 if from_left else -1)
