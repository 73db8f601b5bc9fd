"""Draws from Python's ``random`` module inside an optimized call.

``random.random()`` in an optimized function (teacher forcing, an epsilon-greedy choice)
is a new number every call, so a graph cannot hold it: it is a *pseudo-input*, the call's
i-th draw (``DrawSource(i)``). Guards branch on it (``(draw(0) < 0.5) == True``: one graph
per outcome) and a graph that computes with it reads it as a number input, like an argument.

The numbers must be eager's, and the generator must end where eager leaves it. So each
dispatched call of an object whose code draws has one ``Call``: the first draw saves the
generator's state, draws are made lazily (when a guard, a graph input or a capture first
asks for draw ``i``) and kept, so every cache entry tried reads the same numbers. Then

* a graph entry that ran calls ``settle(n)``: the generator is left ``n`` draws (the number
  its path makes) after the saved state, whatever the guards of other entries drew;
* anything else (a miss that runs the original, a fallback, the eager tier) ``rewind``s: the
  generator gets its saved state back and the original draws the same numbers itself.

One ``Call`` per dispatched call and thread (a thread-local stack: an optimized function
called by another's eager run gets its own). Only Python's module-level generator
(``random.random``, ``random.uniform``) is modelled; other ``random`` functions and
``random.Random`` instances run eagerly with a reason.
"""
from __future__ import annotations

import contextlib
import random
import threading
from dataclasses import dataclass

from .sources import Source, pin

GENERATOR = random._inst  # what random.random, random.uniform, random.seed use
_local = threading.local()


class Call:
    """The draws of one dispatched call (see the module docstring)."""

    __slots__ = ("start", "values", "open")

    def __init__(self) -> None:
        self.start = None   # the generator's state before the first draw
        self.values: list[float] = []
        self.open = True

    def draw(self, i: int) -> float:
        if not self.open:
            raise LookupError("the call's draws were given back to the generator")
        values = self.values
        if self.start is None:
            self.start = GENERATOR.getstate()
        while len(values) <= i:
            values.append(GENERATOR.random())
        return values[i]

    def settle(self, n: int) -> None:
        """A graph whose path makes ``n`` draws ran: leave the generator ``n`` draws on."""
        drawn = len(self.values)
        if drawn > n:  # another entry's guards read further: from the saved state again
            GENERATOR.setstate(self.start)
            for _ in range(n):
                GENERATOR.random()
        elif drawn < n:  # draws the graph's path makes but nothing before it read
            self.draw(n - 1)
        self.open = False

    def rewind(self) -> None:
        """The original runs: it draws the same numbers itself, from the saved state."""
        if self.open and self.start is not None:
            GENERATOR.setstate(self.start)
        self.open = False


def current() -> Call:
    """The innermost open call of this thread (a capture or guard outside one fails)."""
    call = getattr(_local, "call", None)
    if call is None or not call.open:
        raise LookupError("no optimized call is drawing from Python's random module here")
    return call


def draw(i: int) -> float:
    """The current call's ``i``-th draw (what ``DrawSource(i)`` reads)."""
    return current().draw(i)


@contextlib.contextmanager
def call(reuse: bool = False):
    """One dispatched call's draws; on leaving, a call no graph settled is rewound. With
    ``reuse``, an open call of this thread is used instead (the miss path, inside one)."""
    previous = getattr(_local, "call", None)
    if reuse and previous is not None and previous.open:
        yield previous
        return
    fresh = _local.call = Call()
    try:
        yield fresh
    finally:
        fresh.rewind()
        _local.call = previous


def rewind() -> None:
    """Before the original runs in place (a profiled call, a fallback run by the dispatcher):
    the current call's draws go back to the generator, if any call is open."""
    call_ = getattr(_local, "call", None)
    if call_ is not None:
        call_.rewind()


def settle(n: int) -> None:
    """A graph entry whose path makes ``n`` draws ran (no-op outside a call)."""
    call_ = getattr(_local, "call", None)
    if call_ is not None and call_.open:
        call_.settle(n)


_DRAW = pin(draw)


@dataclass(frozen=True)
class DrawSource(Source):
    """The call's ``index``-th ``random.random()``, drawn when first read."""

    index: int

    def render(self, base: str) -> str:
        return f"O[{_DRAW}]({self.index})"

    def __str__(self) -> str:
        return f"random.random()#{self.index + 1}"
