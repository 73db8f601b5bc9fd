"""``contextlib.ExitStack`` made in the call, modelled over values.

The stack is a list of exit callbacks: ``enter_context`` enters a manager the way ``with``
does (``context_managers.before_with``: Python managers inlined, grad mode modelled) and keeps
its bound ``__exit__``; ``callback``/``push`` keep the function given. Leaving the ``with``
(or ``close()``) calls them last-in first-out, as CPython's ``ExitStack.__exit__`` does: exit
functions get the pending exception, one that returns true suppresses it (the rest then see
none), plain callbacks get no arguments. An exit callback that raises makes CPython chain the
exceptions; that path is not modelled, so the call runs eagerly. ``pop_all()`` moves the
callbacks to a new stack.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ...records import Unsupported
from ..attrs import load_attr
from ..calls import call
from ..exceptions import PyRaise
from ..models import MODELS
from ..operators import truth
from ..values import ConstV, ObjV, Value
from .builtins import model
from .context_managers import _Modelled, before_with


@dataclass(eq=False, repr=False)
class ExitStackV(_Modelled):
    """An ``ExitStack`` made in the call: ``callbacks`` holds ``(is_exit, fn, args, kwargs)``."""

    callbacks: list = field(default_factory=list)

    def python_type(self):
        return contextlib.ExitStack

    def enter(self, tracer) -> Value:
        return self

    def exit(self, tracer, exc: Value) -> Value:
        received = not (isinstance(exc, ConstV) and exc.value is None)
        pending = exc if received else None
        while self.callbacks:
            is_exit, fn, args, kwargs = self.callbacks.pop()
            if is_exit:
                args = _exc_details(tracer, pending)
            try:
                result = _call(tracer, fn, args, kwargs)
            except PyRaise:
                raise Unsupported("exception_handling", "an ExitStack callback raised (CPython "
                                  "chains it to the pending exception; not modelled)") from None
            if is_exit and pending is not None:
                if truth(tracer, result):
                    pending = None
        return ConstV(received and pending is None)

    def method(self, tracer, name: str, args: list, kwargs: dict) -> Value:
        if name == "enter_context" and len(args) == 1 and not kwargs:
            exit_, entered = before_with(tracer, args[0])
            self.callbacks.append((True, exit_, [], {}))
            return entered
        if name == "callback" and args:
            self.callbacks.append((False, args[0], list(args[1:]), dict(kwargs)))
            return args[0]
        if name == "push" and len(args) == 1 and not kwargs:
            self.callbacks.append((True, _exit_of(tracer, args[0]), [], {}))
            return args[0]
        if name == "pop_all" and not args and not kwargs:
            moved = ExitStackV(self.callbacks)
            self.callbacks = []
            return moved
        if name == "close" and not args and not kwargs:
            self.exit(tracer, ConstV(None))
            return ConstV(None)
        raise Unsupported("unsupported_call", f"ExitStack.{name}() is not modelled")


MODELS.register("ExitStackV", ExitStackV)  # attrs.py: its attributes are methods


def _call(tracer, fn: Value, args: list, kwargs: dict) -> Value:
    return call(tracer, fn, args, kwargs)


def _exc_details(tracer, exc: Value | None) -> list:
    if exc is None:
        return [ConstV(None)] * 3
    return [tracer.wrap(type(exc.obj), None), exc, ConstV(None)]


def _exit_of(tracer, v: Value) -> Value:
    """``push(x)``: ``x.__exit__`` when ``x``'s type has one (a manager), else ``x`` itself."""
    if isinstance(v, ObjV) and hasattr(type(v.obj), "__exit__"):
        return load_attr(tracer, None, v, "__exit__")
    return v


@model(contextlib.ExitStack)
def _exit_stack(tracer, fn, args, kwargs):
    if args or kwargs:
        raise Unsupported("exception_handling", "TypeError: ExitStack() takes no arguments")
    return ExitStackV()
