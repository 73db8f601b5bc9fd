"""Python-level exceptions during capture: raised, unwound to a handler, or let out.

A ``PyRaise`` is an exception the captured code raises *as eager would*, decided only by
values the guards pin down (a ``raise`` statement, a missing key of a guarded dict, an index
out of range of a list of guarded length, a division by a constant zero, ...). Inside a
``try`` (or a ``with`` block) it is unwound as CPython 3.11 does: the exception table entry
that covers the raising instruction gives the handler and the stack depth; the handler then
runs symbolically like any other code. One that leaves the optimized function is still a
fallback (kind ``exception_handling``): the eager run raises the real exception.

Errors raised by torch ops on tensor values during capture are *not* ``PyRaise`` (the guards
do not decide them): they still make the call fall back. What a graph raises at run time
inside a ``try`` is handled by the eager rerun (``raised_in_try`` tells the dispatcher so).
"""
from __future__ import annotations

import inspect
import types


from ..guards import HasAttrGuard
from ..records import Unsupported
from .speculation.raising_branch import raising_nodes
from .values import ConstV, MethodV, ObjV, Value
from .values.raised import PyRaise, python_error  # noqa: F401  (re-exported)

IN_TRY = "in_try"  # node meta: the op ran where a try/with handler covers it


# ---- the exception being handled (``sys.exc_info()``, bare ``raise``) ---------------------
def handled(tracer) -> Value | None:
    return tracer.handled_exception


def set_handled(tracer, value: Value | None) -> None:
    tracer.handled_exception = value


# ---- unwinding ---------------------------------------------------------------------------
def step_in_try(frame, handler, ins):
    """Run one instruction that a handler covers, marking the graph ops it adds (a graph that
    raises there at run time is the code's own handled error, see ``raised_in_try``)."""
    graph = frame.tracer.graph
    before = len(graph.nodes)
    try:
        return handler(frame, ins)
    finally:
        added = len(graph.nodes) - before
        for node in reversed(graph.nodes):
            if added <= 0:
                break
            node.meta[IN_TRY] = True
            added -= 1


def unwind(frame, ins, error: PyRaise) -> int:
    """Continue at the handler covering ``ins`` (the jump target), or re-raise ``error``.

    As CPython: pop the value stack to the entry's depth, push the raising instruction's
    offset when the entry says ``lasti``, then the exception."""
    entry = frame.info.handler_at(ins.offset)
    if entry is None or frame.tracer.merging:  # (a merged branch side runs both ways: no)
        raise error
    if error.filename is None:  # where it was raised, kept if a handler raises it again
        error.filename, error.lineno, error.function = frame.tracer.user_position()
    current = handled(frame.tracer)  # (`[][0]` inside an except block: its implicit context,
    if current is not None and error.exc is not None and error.exc.__context__ is None \
            and current.obj is not error.exc:  # as a `raise` statement's, raise_value)
        error.exc.__context__ = current.obj
    error.value.raised_at = (error.filename, error.lineno, error.function)
    del frame.stack[entry.depth:]
    frame.kw_names = ()
    if entry.lasti:
        frame.push(ConstV(ins.offset))
    frame.push(error.value)
    return entry.target


def leaving_generator(error: PyRaise) -> PyRaise:
    """What leaves a generator's frame: a StopIteration becomes RuntimeError (PEP 479)."""
    if not isinstance(error.exc, StopIteration):
        return error
    exc = RuntimeError("generator raised StopIteration")
    exc.__cause__ = exc.__context__ = error.exc
    return python_error(exc)


def raise_value(tracer, exc_v: Value, cause: Value | None = None) -> PyRaise:
    """The ``PyRaise`` for ``raise exc_v [from cause]``; ``Unsupported`` for an exception
    this executor cannot model (made from tensor values, an object from outside the call)."""
    from .calls import call
    exc = exc_v.obj if isinstance(exc_v, ObjV) else None
    if isinstance(exc, type) and issubclass(exc, BaseException):
        exc_v = call(tracer, exc_v, [], {})  # `raise ValueError`: the class is instantiated
        exc = exc_v.obj if isinstance(exc_v, ObjV) else None
    if not isinstance(exc, BaseException) or exc_v.source is not None:
        raise Unsupported("exception_handling", f"the function raises {exc_v!r} here; the call "
                          "runs eagerly so the real exception is raised")
    if cause is not None:
        exc.__cause__ = _cause(tracer, cause)  # (also sets __suppress_context__)
    current = handled(tracer)
    if current is not None and current.obj is not exc:
        exc.__context__ = current.obj
    return PyRaise(exc, value=exc_v)


def _cause(tracer, cause: Value) -> BaseException | None:
    if isinstance(cause, ConstV) and cause.value is None:
        return None
    if isinstance(cause, ObjV) and isinstance(cause.obj, type) and issubclass(cause.obj, BaseException):
        from .calls import call
        cause = call(tracer, cause, [], {})
    if isinstance(cause, ObjV) and isinstance(cause.obj, BaseException):
        return cause.obj
    raise Unsupported("exception_handling", f"`raise ... from {cause!r}`")


def exception_attr(tracer, exc_v: ObjV, name: str) -> Value:
    """``e.name`` of an exception raised in the call: its data (``args``, ``__cause__``, what
    its class's ``__init__`` stored), or a method of its class."""
    exc = exc_v.obj
    static = inspect.getattr_static(type(exc), name, None)
    if isinstance(static, types.FunctionType):
        return MethodV(exc_v, tracer.wrap(static, None), name)
    try:
        attr = getattr(exc, name)
    except AttributeError as e:
        raise python_error(e.with_traceback(None)) from None
    if callable(attr) and not isinstance(attr, (type, BaseException)):
        raise Unsupported("unsupported_call", f"method {name!r} of an exception")
    if isinstance(attr, BaseException):
        return ObjV(attr)
    return tracer.wrap_python(attr)


def missing_attribute(tracer, v: ObjV, name: str) -> Unsupported:
    """``v.name`` where the object from outside has no such attribute: eager's AttributeError,
    catchable when the absence is guarded (the object has a source)."""
    text = f"{type(v.obj).__name__!r} object has no attribute {name!r}"
    if v.source is None or hasattr(v.obj, name):
        return Unsupported("exception_handling", text)
    tracer.add_guard(HasAttrGuard, v.source, name=name, expected=False)
    return python_error(AttributeError(text))


def exception_types(match: Value) -> tuple:
    """The classes an ``except`` clause names (a class or a tuple of them)."""
    types_ = match.concrete()
    flat = types_ if isinstance(types_, tuple) else (types_,)
    if not all(isinstance(t, type) and issubclass(t, BaseException) for t in flat):
        raise python_error(TypeError("catching classes that do not inherit from BaseException "
                                     "is not allowed"))
    return types_


# ---- a graph that raised at run time ------------------------------------------------------
def eager_did_not_raise(error: BaseException, graphs: list, what: str) -> Unsupported:
    """The record for a graph that raised ``error`` where the eager rerun returned (and no
    merged branch explains it): the code's own handled error when the op ran under a
    try/with handler, else a bug of ours (``backend_error``)."""
    where = raised_in_try(error, graphs)
    if where is None:
        return Unsupported("backend_error", f"{what}, but the original code does not")
    return Unsupported("exception_handling",
                       f"{what} at {where}, inside a try block whose handler the original code "
                       "takes (the call ran eagerly and returned its result)",
                       "Expected when the handled error really happens; to keep such calls in "
                       "the graph, check the values before the op instead of catching its error.")


def raised_in_try(error: BaseException, graphs: list) -> str | None:
    """When a graph raised ``error`` and eager did not: where the op that raised is, if it
    ran under a try/with handler during capture (the code handled its own error: the eager
    rerun took the handler); None if it is not such an op."""
    for node in raising_nodes(error, graphs):
        if node.meta.get(IN_TRY):
            return node.meta.get("where", "") or "an op in a try block"
    return None
