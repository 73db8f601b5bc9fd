"""Draws from Python's ``random`` module in a captured call (``guards/draws.py``).

``random.random()`` is the call's next draw: a symbolic number (``SymV``) read from
``DrawSource(i)``. Branching on it guards the outcome (``random.random()#1 < 0.5``: one graph
per side); computing with it makes it a number input of the graph. ``random.uniform(a, b)``
is inlined as CPython's own ``a + (b - a) * self.random()`` (``methods.call_method`` sends
``self.random()`` here), so its value is eager's bit for bit.

Refused (the call runs eagerly, with the reason): a draw on a side of a merged tensor branch
(both sides are captured, one runs), in a recursion template (one path for every node), and
every other ``random`` function (``refuse_inlining``: Python-level ones such as ``gauss``
keep state on the generator) or ``random.Random`` instance. A rolled loop whose body draws is
unrolled instead (``rolled/loops.py``: one body for every iteration cannot draw).
"""
from __future__ import annotations

import random

from ...guards import draws
from ...records import Unsupported
from ..inputs import placeholder
from ..values.symint import SymV
from ..models import provides
from .builtins import model


def draw(tracer) -> SymV:
    """The call's next ``random.random()``."""
    where = ("on one side of a branch on a tensor value (both sides are captured, one "
             "runs)" if tracer.merging else "in a recursive call captured as a template (one "
             "path runs for every node)" if tracer.template is not None else None)
    if where is not None:
        raise Unsupported("unsupported_call", f"a draw from Python's random module {where}: "
                          "the graph cannot make the draws eager makes",
                          "Draw it before the branch or the recursion and pass it in.")
    index = len(tracer.draws)
    try:
        value = draws.draw(index)
    except LookupError as e:  # a capture outside a dispatched call (nothing saved the state)
        raise Unsupported("unsupported_call", f"random.random() outside a dispatched call ({e})")
    source = draws.DrawSource(index)
    node = placeholder(tracer, f"random_draw_{index}")
    node.meta["example"] = value
    tracer.input_sources.append(source)
    number = SymV(value, node, source.expr(), tracer, str(source))
    tracer.draws.append(number)
    return number


def no_arguments(args, kwargs, name: str) -> None:
    if args or kwargs:
        given = len(args) + len(kwargs)
        raise Unsupported("exception_handling", f"TypeError: Random.{name}() takes no arguments "
                          f"({given} given)")


@model(random.random)
def _random(tracer, fn, args, kwargs):
    no_arguments(args, kwargs, "random")
    return draw(tracer)


def is_draw(obj, name: str) -> bool:
    """``obj.name()`` is the module generator's ``random()`` (``self.random()`` inside
    ``random.uniform``, which is inlined as CPython's own code)."""
    return obj is draws.GENERATOR and name == "random"


def not_modelled(name: str) -> Unsupported:
    """The fallback for a ``random`` function or ``random.Random`` method not modelled here."""
    return Unsupported(
        "unsupported_call", f"a draw from Python's random module ({name}) inside the "
        "optimized function: of its draws, only random.random() and random.uniform() of the "
        "module's own generator are captured (a random.Random instance's are not)",
        "Use random.random() (`random.random() < p` in place of a choice between two: one "
        "graph per outcome), or draw outside and pass what it decides in as an argument.")


_INLINED = frozenset({random.Random.uniform})  # only arithmetic on self.random()


@provides("refuse_inlining")
def refuse_inlining(func) -> None:
    """The Python-level methods of ``random.Random`` (``gauss``, ``choice``, ``shuffle``,
    ``triangular``, ...) are not inlined: they keep state on the generator (``gauss_next``)
    that a draw record's rewind would lose, or call C methods not modelled; ``uniform`` is."""
    if getattr(func, "__module__", None) == "random" and func not in _INLINED:
        raise not_modelled(f"random.{func.__name__}")
