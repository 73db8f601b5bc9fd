"""``warnings.warn(...)`` as a deferred effect, replayed by the commit like ``print``.

Eager ``warnings.warn`` finds the frame ``stacklevel`` levels up, takes its file, line,
module name and ``__warningregistry__``, and hands them to ``warn_explicit``, which consults
the registry ("once per location" under the default filter), the filters and
``showwarning``. The location is fixed by the captured code, so capture computes it from the
symbolic frames and logs an effect; the commit calls ``warn_explicit`` with it after the graph
ran and every check passed, so the registry, the filters (as they are at that call) and
``showwarning`` act exactly as in eager, and a call that falls back warns only in its eager run.

The one action the commit cannot replay is ``error``: eager raises at the ``warn`` call,
before the rest of the function ran. Capture falls back when the filters turn the warning
into an error, and the graph is guarded on the filters staying equal to what capture saw
(so a later ``simplefilter("error")`` recaptures, and that capture falls back).
"""
from __future__ import annotations

import functools
import warnings

from ...guards import ValueGuard
from ...guards.sources import AttrSource, ObjectSource, pin
from ...records import Unsupported
from ..values import ConstV, Value
from .builtins import model
from .printing import StrV

_PARAMS = ("message", "category", "stacklevel", "source")


def replay_warning(category: type, filename: str, lineno: int, globals_: dict, source,
                   message) -> None:
    """What ``warnings.warn`` does once it found the frame (CPython's ``setup_context``):
    the registry and module come from the frame's globals, read at commit as eager reads them."""
    registry = globals_.get("__warningregistry__")
    if registry is None:
        registry = globals_["__warningregistry__"] = {}
    module = globals_.get("__name__")
    warnings.warn_explicit(message, category, filename, lineno,
                           module if isinstance(module, str) else "<string>", registry, None, source)


@model(warnings.warn)
def _warn(tracer, fn, args, kwargs):
    bound = _bind(args, kwargs)
    message = bound["message"]
    if not (isinstance(message, ConstV) and message.python_type() is str):
        raise Unsupported("unsupported_call", "warnings.warn is captured for a str message; "
                          "a Warning object made or passed in the call is not modelled")
    category = _category(bound.get("category"))
    stacklevel = _constant(bound.get("stacklevel"), 1, "stacklevel")
    source = _constant(bound.get("source"), None, "source")
    if type(stacklevel) is not int:
        raise Unsupported("exception_handling", "TypeError: warn() stacklevel must be an int")
    frame = _frame(tracer, stacklevel)
    filename, lineno, globals_ = frame.code.co_filename, frame.lineno, frame.globals
    _refuse_error_action(tracer, message, category, _module_name(globals_), lineno)
    replay = functools.partial(replay_warning, category, filename, lineno, globals_, source)
    tracer.heap.write_effect(replay, [message], tracer.where())
    return ConstV(None)


def _bind(args: list, kwargs: dict) -> dict:
    if len(args) > len(_PARAMS) or any(k not in _PARAMS for k in kwargs):
        raise Unsupported("exception_handling", "TypeError: warn() got unexpected arguments")
    bound = dict(zip(_PARAMS, args))
    for name, value in kwargs.items():
        if name in bound:
            raise Unsupported("exception_handling",
                              f"TypeError: warn() got multiple values for argument {name!r}")
        bound[name] = value
    if "message" not in bound:
        raise Unsupported("exception_handling", "TypeError: warn() missing argument 'message'")
    return bound


def _constant(v: Value | None, default, name: str):
    if v is None:
        return default
    if not isinstance(v, ConstV) or isinstance(v, StrV):
        raise Unsupported("unsupported_call", f"warnings.warn({name}=...) with a value computed "
                          "in the call")
    return v.value


def _category(v: Value | None) -> type:
    """``category`` as eager validates it (``None``: ``UserWarning``)."""
    cls = None if v is None else v.concrete()
    if cls is None:
        return UserWarning
    if not (isinstance(cls, type) and issubclass(cls, Warning)):
        raise Unsupported("exception_handling", "TypeError: warnings.warn() category must be a "
                          f"Warning subclass, not '{type(cls).__name__}'")
    return cls


def _frame(tracer, stacklevel: int):
    """The symbolic frame eager's ``warn`` would pick; a frame outside the captured call
    (the optimized function's caller) differs from call to call, so capture falls back."""
    depth = max(stacklevel, 1)
    if depth > len(tracer.frames):
        raise Unsupported("unsupported_call", f"warnings.warn(stacklevel={stacklevel}) names a "
                          "frame outside the optimized call (its caller's line)")
    return tracer.frames[-depth]


def _module_name(globals_: dict) -> str:
    module = globals_.get("__name__", "<string>")
    if module is None:  # CPython then matches filters against None (a TypeError in a filter)
        raise Unsupported("unsupported_call", "warnings.warn from a module whose __name__ is None")
    return module if isinstance(module, str) else "<string>"


def _refuse_error_action(tracer, message: ConstV, category: type, module, lineno: int) -> None:
    """Guard the filters, and fall back when they make this warning raise."""
    filters = list(warnings.filters) if type(warnings.filters) is list else None
    if filters is None:
        raise Unsupported("unsupported_call", "warnings.filters is not a list")
    base = ObjectSource(pin(warnings), "warnings")
    tracer.add_guard(ValueGuard, AttrSource(base, "filters"), expected=filters)
    tracer.add_guard(ValueGuard, AttrSource(base, "defaultaction"), expected=warnings.defaultaction)
    if any(f[1] is not None for f in filters) and isinstance(message, StrV):
        text = message.value  # a filter matches on the text: know it (guards what it needs)
    else:
        text = message.value if not isinstance(message, StrV) else ""
    if _action(filters, text, category, module, lineno) == "error":
        raise Unsupported("exception_handling", f"a warnings filter turns this {category.__name__} "
                          "into an exception, raised in the middle of the call")


def _action(filters: list, text: str, category: type, module, lineno: int) -> str:
    """The first matching filter's action, as CPython's ``get_filter`` finds it (a plain
    string filter field must match exactly, a compiled pattern with ``match``)."""
    for action, msg, cat, mod, ln in filters:
        if _matches(msg, text) and issubclass(category, cat) and _matches(mod, module) \
                and (ln == 0 or ln == lineno):
            return action
    return warnings.defaultaction


def _matches(pattern, text: str) -> bool:
    if pattern is None:
        return True
    if type(pattern) is str:
        return pattern == text
    return bool(pattern.match(text))
