"""Opcode family: calls, function creation and ``with`` blocks (3.11 call protocol:
``[NULL or callable, callable or self, args...]`` then PRECALL/CALL, KW_NAMES before)."""
from __future__ import annotations

from ...records import Unsupported
from ..calls import call
from ..operators import consume
from .registry import handles
from ..values import ConstV, DictV, FuncV, NullV
from ..library.context_managers import before_with


@handles("KW_NAMES")
def _kw_names(frame, ins):
    frame.kw_names = frame.code.co_consts[ins.arg]  # dis leaves argval unresolved here


@handles("CALL")
def _call(frame, ins):
    n = ins.arg
    args = frame.popn(n)
    kw_names, frame.kw_names = frame.kw_names, ()
    first, second = frame.pop(), frame.pop()
    if isinstance(second, NullV):
        fn = first
    else:  # [method, self]: second is the callable, first is self
        fn, args = second, [first, *args]
    kwargs = {}
    if kw_names:
        kwargs = dict(zip(kw_names, args[-len(kw_names):]))
        args = args[:-len(kw_names)]
    frame.push(call(frame.tracer, fn, list(args), kwargs))


@handles("CALL_FUNCTION_EX")
def _call_function_ex(frame, ins):
    kwargs_v = frame.pop() if ins.arg & 1 else DictV({})
    args_v = frame.pop()
    fn = frame.pop()
    if frame.stack and isinstance(frame.stack[-1], NullV):
        frame.pop()
    args = consume(frame.tracer, args_v)
    if not isinstance(kwargs_v, DictV):
        raise Unsupported("unsupported_call", f"**kwargs from {kwargs_v!r}")
    frame.push(call(frame.tracer, fn, list(args), dict(kwargs_v.items)))


@handles("MAKE_FUNCTION")
def _make_function(frame, ins):
    code = frame.pop().value
    flags = ins.arg
    closure = tuple(frame.pop().items) if flags & 0x08 else ()
    if flags & 0x04:
        frame.pop()  # annotations
    kwdefaults = dict(frame.pop().items) if flags & 0x02 else {}
    defaults_v = frame.pop() if flags & 0x01 else ConstV(())
    if isinstance(defaults_v, ConstV):
        defaults = tuple(frame.tracer.wrap_python(d) for d in defaults_v.value)
    else:
        defaults = tuple(defaults_v.items)
    frame.push(FuncV(code, frame.globals, code.co_qualname, defaults, kwdefaults, closure))


@handles("BEFORE_WITH")
def _before_with(frame, ins):
    exit_, entered = before_with(frame.tracer, frame.pop())
    frame.push(exit_)
    frame.push(entered)


