"""``print(...)`` as a deferred effect, and strings formatted from values the graph computes.

A string made from a ``.item()`` value or a symbolic number (``f"step {i} loss
{loss.item():.4f}"``, ``str(v)``, ``"%.3f" % v``, ``"{}".format(v)``, ``a + b``) is a
``StrV``: how to format it, not its text. The commit renders it with Python's own
``format``/``str``/``repr``/``%``/``str.format`` on the values the graph produced, so the text
is byte-identical to eager's. ``print`` is logged in the shadow heap and committed in program
order with the other writes, only after the graph ran and every check passed; a call that
falls back prints nothing here and the eager run prints once.

A ``StrV`` is a ``ConstV`` whose ``value`` is computed on first use: anything that needs the
text during capture (a comparison, a dict key, ``len``, a method) forces it, which guards a
symbolic number on its value or, for a ``.item()`` value, falls back (``data_dependent_value``).
"""
from __future__ import annotations

import operator
import sys

from ...guards.sources import AttrSource
from ...records import Unsupported
from ...shadow_heap.rebuild import CallOf, Concat, Formatted, Rebuild
from ..values.symint import SymV
from ..values.scalar import ScalarV
from ..values import ConstV, DictV, ListV, ObjV, TensorV, TupleV, Value, leaves
from ..models import provides
from ..operators import truth
from ..values import is_const

_CONVERSIONS = {0: None, 1: str, 2: repr, 3: ascii}
# Constants whose text is fixed by their (guarded) value; sets are not (their order is not).
_PRINTABLE_CONSTS = (str, int, float, bool, type(None), complex)
_FIXED_TEXT = _PRINTABLE_CONSTS + (tuple,)


def format_value(value, conversion: int, spec: str) -> str:
    """What ``FORMAT_VALUE`` computes: ``f"{value!r:spec}"`` and the like."""
    conv = _CONVERSIONS[conversion]
    return format(value if conv is None else conv(value), spec)


def _concat(*parts: str) -> str:
    return "".join(parts)


class StrV(ConstV):
    """A ``str`` the commit computes: ``kind`` is ``format`` (``args``: value, conversion,
    spec), ``concat`` (``args``: the parts) or ``call`` (``fn(*args, **kwargs)``, ``fn`` one of
    ``str``, ``repr``, ``ascii``, ``format``, ``%``, ``str.format``)."""

    source = None

    def __init__(self, kind: str, fn, args: list, kwargs: dict | None = None):
        self.kind, self.fn, self.args, self.kwargs = kind, fn, list(args), dict(kwargs or {})
        self._forced = None
        try:  # the text at capture, without guarding anything: eager's errors are raised here
            self.preview = fn(*[_preview(a) for a in self.args],
                              **{k: _preview(v) for k, v in self.kwargs.items()})
        except Exception as e:
            raise Unsupported("exception_handling", f"formatting raised {type(e).__name__}: {e}") from None

    @property
    def value(self) -> str:
        """The text for use in Python during capture: guards symbolic numbers on their value;
        a ``.item()`` value raises ``data_dependent_value``."""
        if self._forced is None:
            self._forced = self.fn(*[a.concrete() for a in self.args],
                                   **{k: v.concrete() for k, v in self.kwargs.items()})
        return self._forced

    def python_type(self):
        return str

    def spec(self, build) -> Rebuild:
        """The rebuild record (``symbolic.capture.SpecBuilder``); ``build`` makes one of a value."""
        if self.kind == "format":
            return Formatted(build(self.args[0]), self.args[1].value, self.args[2].value)
        if self.kind == "concat":
            return Concat(tuple(build(a) for a in self.args))
        return CallOf(self.fn, tuple(build(a) for a in self.args),
                      tuple((k, build(v)) for k, v in self.kwargs.items()))

    def __repr__(self):
        return f"StrV({self.preview!r})"


def _preview(v: Value):
    if isinstance(v, StrV):
        return v.preview
    if isinstance(v, (ScalarV, SymV)):
        return v.value
    if isinstance(v, TupleV):
        return v.build([_preview(i) for i in v.items])
    if isinstance(v, ListV):
        return [_preview(i) for i in v.items]
    if isinstance(v, DictV):
        return {k: _preview(i) for k, i in v.items.items()}
    return v.concrete()


def is_lazy(v: Value) -> bool:
    """A value whose text only the commit knows (it stays symbolic when formatted)."""
    return isinstance(v, (StrV, ScalarV)) or (isinstance(v, SymV) and type(v.value) in (int, float))


def refusal_kind(v: Value) -> str:
    """``data_dependent_value`` when formatting ``v`` needs tensor data, else ``unsupported_call``."""
    if any(isinstance(leaf, (TensorV, ScalarV, StrV)) for leaf in leaves(v)):
        return "data_dependent_value"
    return "unsupported_call"


def snapshot(v: Value) -> Value:
    """``v`` as it is now, for formatting or printing at commit: numbers, strings, ``None``,
    ``.item()`` values, symbolic numbers and lazy strings, in tuples, lists and dicts (lists and
    dicts copied: a later change in the call must not show). Anything else is refused."""
    if is_lazy(v):
        return v
    if type(v) is ConstV and _fixed_text(v.value):
        return v
    if isinstance(v, TupleV):
        return TupleV([snapshot(i) for i in v.items], v.cls)
    if isinstance(v, ListV) and type(v) is ListV:
        return ListV([snapshot(i) for i in v.items])
    if isinstance(v, DictV) and v.cls is dict and all(type(k) in _PRINTABLE_CONSTS for k in v.items):
        return DictV({k: snapshot(i) for k, i in v.items.items()})
    if isinstance(v, SymV):  # a symbolic bool: its text is its value
        return ConstV(v.concrete())
    if refusal_kind(v) == "data_dependent_value":
        raise Unsupported("data_dependent_value", "printing or formatting a tensor reads its values "
                          "(and its grad_fn) into Python; print `t.item()` or `t.tolist()` outside "
                          "the optimized function")
    what = f"a {type(v.obj).__name__}" if isinstance(v, ObjV) else type(v).__name__
    raise Unsupported("unsupported_call", f"printing or formatting {what}: its text comes from "
                      "its own __str__/__repr__, which is not captured")


def _fixed_text(x) -> bool:
    if type(x) is tuple:
        return all(_fixed_text(i) for i in x)
    return type(x) in _FIXED_TEXT or x is Ellipsis or type(x).__module__ == "torch" and type(x).__name__ in (
        "Size", "dtype", "device")


def _lazy_operands(*values: Value) -> bool:
    return any(is_lazy(leaf) for v in values for leaf in leaves(v))


# ---- the formatting operations ----------------------------------------------------------
def format_value_v(value: Value, conversion: int, spec: str) -> Value:
    """``FORMAT_VALUE``: lazy when ``value``'s text is known only after the graph ran."""
    if is_lazy(value):
        return StrV("format", format_value, [value, ConstV(conversion), ConstV(spec)])
    if not is_const(value):
        raise Unsupported(refusal_kind(value), "an f-string formats "
                          + ("a tensor (its values)" if refusal_kind(value) == "data_dependent_value"
                             else "a non-constant value (an object)"))
    return ConstV(format_value(value.concrete(), conversion, spec))


def build_string(parts: list[Value]) -> Value:
    """``BUILD_STRING``: the f-string's parts joined (at commit when one is lazy)."""
    if any(isinstance(p, StrV) for p in parts):
        return StrV("concat", _concat, parts)
    return ConstV("".join(p.concrete() for p in parts))


@provides("format_binary")
def binary(op, a: Value, b: Value) -> Value | None:
    """``"%.3f" % v`` and ``s + t`` with a lazy operand, else None (not a string operation)."""
    if not (isinstance(a, ConstV) and a.python_type() is str):
        return None
    if op in (operator.mod, operator.imod) and _lazy_operands(a, b):
        return StrV("call", operator.mod, [a, snapshot(b)])
    if op in (operator.add, operator.iadd) and isinstance(b, ConstV) and b.python_type() is str \
            and (isinstance(a, StrV) or isinstance(b, StrV)):
        return StrV("concat", _concat, [a, b])
    return None


def builtin(fn, args: list[Value], kwargs: dict) -> Value | None:
    """``str(v)`` / ``repr(v)`` / ``ascii(v)`` / ``format(v, spec)`` of a lazy value, else None."""
    if fn in (str, repr, ascii) and len(args) == 1 and not kwargs and _lazy_operands(args[0]):
        if fn is str and isinstance(args[0], StrV):
            return args[0]
        return StrV("call", fn, [snapshot(args[0])])
    if fn is format and 1 <= len(args) <= 2 and not kwargs and _lazy_operands(args[0]) \
            and all(type(a) is ConstV for a in args[1:]):
        return StrV("call", fn, [snapshot(args[0]), *args[1:]])
    return None


def str_method(receiver: Value, name: str, args: list[Value], kwargs: dict) -> Value | None:
    """``"{} {:.3f}".format(a, b)`` with a lazy argument, else None."""
    if name != "format" or not (isinstance(receiver, ConstV) and receiver.python_type() is str):
        return None
    if not _lazy_operands(receiver, *args, *kwargs.values()):
        return None
    return StrV("call", str.format, [receiver, *map(snapshot, args)],
                {k: snapshot(v) for k, v in kwargs.items()})


# ---- print ------------------------------------------------------------------------------
_PRINT_KEYWORDS = ("sep", "end", "file", "flush")


def deferred_print(tracer, args: list[Value], kwargs: dict) -> Value:
    """``print(*args, sep=, end=, file=, flush=)``: logged in the shadow heap, printed by the
    commit. ``file`` must be ``sys.stdout`` or ``sys.stderr`` (read from ``sys`` by the entry)."""
    for name in kwargs:
        if name not in _PRINT_KEYWORDS:
            raise Unsupported("exception_handling",
                              f"TypeError: print() got an unexpected keyword argument {name!r}")
    values = [snapshot(a) for a in args]
    sep, end = _separator(kwargs.get("sep"), "sep"), _separator(kwargs.get("end"), "end")
    stream = _stream(tracer, kwargs.get("file"))
    flush = False
    if "flush" in kwargs:
        flush = truth(tracer, kwargs["flush"])
    tracer.heap.write_print(values, sep, end, stream, flush, tracer.where())
    return ConstV(None)


def _separator(v: Value | None, name: str) -> Value | None:
    if v is None or (type(v) is ConstV and v.value is None):
        return None
    if isinstance(v, ConstV) and v.python_type() is str:
        return v
    raise Unsupported("exception_handling", f"TypeError: {name} must be None or a string, "
                      f"not {v.python_type().__name__}")


def _stream(tracer, v: Value | None) -> Value | None:
    if v is None or (type(v) is ConstV and v.value is None):
        return None
    source = getattr(v, "source", None)
    if isinstance(v, ObjV) and isinstance(source, AttrSource) and source.attr in ("stdout", "stderr"):
        base = tracer._by_source.get(source.base)
        if isinstance(base, ObjV) and base.obj is sys and v.obj is getattr(sys, source.attr):
            return v
    raise Unsupported("unsupported_call", "print(file=...) is captured only for sys.stdout and "
                      "sys.stderr; writing to another file is an effect outside the graph")
