"""An exception the captured code raises as eager would (``PyRaise``), made where a modelled
operation raises: at the bottom of ``symbolic/`` so that values and speculation can raise it
without importing the core (``exceptions.py`` unwinds it to a handler)."""
from __future__ import annotations

from ...records import Unsupported
from . import ObjV, Value


class PyRaise(Unsupported):
    """The captured code raises ``exc`` here (a real exception object, made from constants)."""

    def __init__(self, exc: BaseException, explanation: str | None = None,
                 value: Value | None = None):
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        super().__init__("exception_handling", explanation or text)
        self.exc = exc
        self.value = value if value is not None else ObjV(exc)


def python_error(exc: BaseException, explanation: str | None = None) -> PyRaise:
    """``raise python_error(KeyError(k))`` at a modelled operation that eager raises at."""
    return PyRaise(exc, explanation)
