"""Opcode family: exceptions (CPython 3.11). ``raise`` and the handler machinery the compiler
emits for ``try``/``except``/``finally`` and for ``with`` blocks. There is no SETUP opcode:
the exception table says where an exception goes (see ``exceptions.unwind``); the handler
code then runs with the exception on the stack:

    PUSH_EXC_INFO      exc -> previous handled exception, exc   (exc becomes the handled one)
    CHECK_EXC_MATCH    exc, types -> exc, isinstance(exc, types)
    POP_EXCEPT         previous -> (the previous one is handled again)
    RERAISE n          exc -> raise exc again (n > 0: a lasti below, for the traceback only)
    WITH_EXCEPT_START  exit, lasti, prev, exc -> exit, lasti, prev, exc, exit(type, exc, tb)
"""
from __future__ import annotations

from ...records import Unsupported
from ..library import context_managers  # noqa: F401  (registers contextlib models)
from ..exceptions import PyRaise, exception_types, handled, raise_value, set_handled
from .registry import handles
from ..values import ConstV, ObjV
from ..calls import call


@handles("RAISE_VARARGS")
def _raise(frame, ins):
    tracer = frame.tracer
    if ins.arg == 0:  # bare `raise`: the exception being handled
        current = handled(tracer)
        if current is None:  # eager re-raises the caller's exception, if it is in a handler
            raise Unsupported("exception_handling", "bare `raise` outside an except block")
        raise PyRaise(current.obj, value=current)
    cause = frame.pop() if ins.arg == 2 else None
    raise raise_value(tracer, frame.pop(), cause)


@handles("RERAISE")
def _reraise(frame, ins):
    exc = frame.pop()
    if not isinstance(exc, ObjV) or not isinstance(exc.obj, BaseException):
        raise Unsupported("internal_error", f"RERAISE of {exc!r}")
    error = PyRaise(exc.obj, value=exc)
    # (the compiler's re-raise: no clause matched, or the end of a `finally`): the fallback
    # points at the line that raised it first
    error.filename, error.lineno, error.function = getattr(exc, "raised_at", (None, None, None))
    raise error


@handles("PUSH_EXC_INFO")
def _push_exc_info(frame, ins):
    exc = frame.pop()
    previous = handled(frame.tracer)
    frame.push(previous if previous is not None else ConstV(None))
    frame.push(exc)
    set_handled(frame.tracer, exc)


@handles("POP_EXCEPT")
def _pop_except(frame, ins):
    previous = frame.pop()
    set_handled(frame.tracer, None if isinstance(previous, ConstV) else previous)


@handles("CHECK_EXC_MATCH")
def _check_exc_match(frame, ins):
    types_ = exception_types(frame.pop())
    frame.push(ConstV(isinstance(frame.stack[-1].obj, types_)))


@handles("WITH_EXCEPT_START")
def _with_except_start(frame, ins):
    exc = frame.stack[-1]
    exit_ = frame.stack[-4]
    kind = frame.tracer.wrap(type(exc.obj), None)
    frame.push(call(frame.tracer, exit_, [kind, exc, ConstV(None)], {}))
