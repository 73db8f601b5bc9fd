"""``with`` blocks on context managers written in Python, captured like the code around them.

BEFORE_WITH looks up ``__enter__``/``__exit__``, calls ``__enter__`` and leaves the bound
``__exit__`` on the stack; the compiler calls it with ``(None, None, None)`` on the normal way
out and WITH_EXCEPT_START calls it with the exception (see ``ops_exceptions``). So:

* a user class: both methods are inlined (attribute writes go to the shadow heap);
* ``contextlib.contextmanager`` functions: the generator runs symbolically up to its
  ``yield`` on entry, and on exit resumes after it, or has the exception thrown in at the
  ``yield`` (so its own ``try``/``finally``/``except`` run);
* ``contextlib.suppress(...)`` and ``contextlib.nullcontext(...)``: modelled directly;
* torch's grad-mode managers keep their own model (``grad_mode.py``);
* ``contextlib.ExitStack`` made in the call: ``exit_stack.py``.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

from ...records import Unsupported
from .builtins import model
from ..exceptions import PyRaise, leaving_generator, python_error, unwind
from ..values import ConstV, CtxExitV, FuncV, GradModeV, MethodV, ObjV, Value
from ..attrs import load_attr
from ..calls import call, inline, inline_function


def before_with(tracer, ctx: Value) -> tuple[Value, Value]:
    """``(bound __exit__, what __enter__ returned)`` for ``with ctx:``."""
    if isinstance(ctx, GradModeV):
        from .methods import enter_context
        return CtxExitV(ctx), enter_context(tracer, ctx)
    if isinstance(ctx, _Modelled):
        return MethodV(ctx, ObjV(_modelled_exit), "__exit__"), ctx.enter(tracer)
    try:
        enter = load_attr(tracer, None, ctx, "__enter__")
        exit_ = load_attr(tracer, None, ctx, "__exit__")
    except PyRaise:  # eager: TypeError, the object does not support the protocol
        raise Unsupported("unsupported_call", f"`with` on {ctx!r}, which is not a context "
                          "manager this executor can see into") from None
    return exit_, call(tracer, enter, [], {})


class _Modelled(Value):
    def concrete(self):
        raise Unsupported("unsupported_call", f"{type(self).__name__} used as a value outside `with`")

    def enter(self, tracer) -> Value:
        raise NotImplementedError

    def exit(self, tracer, exc: Value) -> Value:
        raise NotImplementedError


def _modelled_exit(ctx, kind, exc, tb):  # stands for a modelled manager's bound __exit__
    raise AssertionError("never called: modelled by _exit_model")


@model(_modelled_exit)
def _exit_model(tracer, fn, args, kwargs):
    ctx, _, exc, _ = args
    return ctx.exit(tracer, exc)


# ---- contextlib.suppress / nullcontext -----------------------------------------------------
@dataclass(eq=False, repr=False)
class SuppressV(_Modelled):
    types_: tuple

    def enter(self, tracer):
        return ConstV(None)

    def exit(self, tracer, exc):
        return ConstV(isinstance(exc, ObjV) and isinstance(exc.obj, self.types_))


@dataclass(eq=False, repr=False)
class NullContextV(_Modelled):
    result: Value

    def enter(self, tracer):
        return self.result

    def exit(self, tracer, exc):
        return ConstV(None)


@model(contextlib.suppress)
def _suppress(tracer, fn, args, kwargs):
    if kwargs:
        raise python_error(TypeError("suppress() takes no keyword arguments"))
    types_ = tuple(a.concrete() for a in args)
    if not all(isinstance(t, type) and issubclass(t, BaseException) for t in types_):
        raise Unsupported("unsupported_call", "contextlib.suppress() of non-exception classes")
    return SuppressV(types_)


@model(contextlib.nullcontext)
def _nullcontext(tracer, fn, args, kwargs):
    result = kwargs.get("enter_result", args[0] if args else ConstV(None))
    return NullContextV(result)


# ---- @contextlib.contextmanager -------------------------------------------------------------
@dataclass(eq=False, repr=False)
class GeneratorContextV(_Modelled):
    """``_GeneratorContextManager(func, args, kwds)``: the generator is made on entry."""

    func: Value
    args: list
    kwargs: dict
    frame: object = field(default=None)

    def enter(self, tracer):
        self.frame = _generator_frame(tracer, self.func, self.args, self.kwargs)
        if not _advance(tracer, self.frame):
            raise python_error(RuntimeError("generator didn't yield"))
        return self.frame.yielded[-1]

    def exit(self, tracer, exc):
        if isinstance(exc, ConstV) and exc.value is None:
            if _advance(tracer, self.frame):
                raise python_error(RuntimeError("generator didn't stop"))
            return ConstV(False)
        try:
            yielded = _advance(tracer, self.frame, throw=exc)
        except PyRaise as error:  # the exception came back out: not suppressed
            if error.exc is exc.obj or (isinstance(exc.obj, StopIteration)
                                        and error.exc.__cause__ is exc.obj):  # (PEP 479)
                return ConstV(False)
            raise
        if yielded:
            raise python_error(RuntimeError("generator didn't stop after throw()"))
        return ConstV(True)  # the generator caught it and returned: suppressed


@model(contextlib._GeneratorContextManager)
def _generator_context(tracer, fn, args, kwargs):
    func, args_v, kwargs_v = args
    return GeneratorContextV(func, list(args_v.items), dict(kwargs_v.items))


def _generator_frame(tracer, func: Value, args, kwargs):
    if isinstance(func, FuncV):
        code = func.code
        frame = lambda: inline(tracer, code, func.globals, args, kwargs,  # noqa: E731
                               defaults=func.defaults, kwdefaults=func.kwdefaults,
                               closure=func.closure, name=func.name, frame_only=True)
    elif isinstance(func, ObjV) and isinstance(func.obj, types.FunctionType):
        code = func.obj.__code__
        frame = lambda: inline_function(tracer, func, args, kwargs, frame_only=True)  # noqa: E731
    else:
        raise Unsupported("unsupported_call", f"@contextmanager on {func!r}")
    if code.co_flags & 0x20 == 0:  # CO_GENERATOR
        raise Unsupported("unsupported_call", f"@contextmanager on {code.co_qualname}, which "
                          "is not a generator function")
    return frame()


def _advance(tracer, frame, throw: Value | None = None) -> bool:
    """Resume the generator ``frame`` (with ``throw`` raised at its ``yield``) until it
    yields again (True) or returns (False), as ``next``/``throw`` do."""
    def resume() -> bool:
        if frame.result is not None:
            return False
        yielded = len(frame.yielded)
        if throw is not None:
            at_yield = frame.info.instructions[frame.ip - 1]
            frame.jump(unwind(frame, at_yield, PyRaise(throw.obj, value=throw)))
        while frame.result is None and len(frame.yielded) == yielded:
            frame._step()
        return len(frame.yielded) > yielded
    return frame.on_stack(resume, leaving=leaving_generator)


from . import exit_stack  # noqa: E402,F401  (registers contextlib.ExitStack)
