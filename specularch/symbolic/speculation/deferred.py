"""Numbers the commit computes: arithmetic on ``.item()`` values, and clock reads.

``running = 0.05 * r.item() + 0.95 * running``, ``self.total += loss.item()``,
``round(v, 4)``, ``max(best, v)``, ``int(v)``, ``math.sqrt(v)``: a ``NumV`` is a *recipe*, a
small expression tree over ``.item()`` values (``ScalarV``), clock reads, symbolic numbers
(graph outputs) and Python number constants. The commit evaluates it after the graph ran with
Python's own operators in the order eager applies them, so the result is bit-identical to
eager's. It can be stored (attribute, global, list, dict), returned, printed and formatted;
anything that steers Python during capture (a branch, a comparison, an index, ``range(n)``,
passing it to a torch op as a size) still needs its value and falls back as before; a torch
op that takes it as a value computes it in the graph (item_args.py).

Exceptions: a recipe that raises at capture (``1 / 0.0``) falls back right away. One that
raises only with the values of a later call (``total / n`` with ``n`` from ``.item()``, an
overflowing ``**``) raises when the commit evaluates it. The entry evaluates every recipe
right after the graph and *before* any write (``entry_function.build_entry_function``), so nothing has been
written; the dispatcher then runs the call eagerly (as for a graph that raised), which
raises the same error with eager's own effects.

Clocks (``time.time``, ``perf_counter``, ``monotonic`` and their ``_ns`` forms) are read by
the entry, not at capture, at the place the read has relative to the graph in program order:
a read made before any tensor op of the call is read just before the graph runs, a read made
after the last one right after it. So ``t0 = time.perf_counter(); <step>; dt =
time.perf_counter() - t0`` measures the graph's run, as eager measures the step's compute
(Python work of the capture itself is not in it, which is what the graph saves). A read with
tensor ops on both sides has no honest place (the graph runs them together) and falls back
(``unsupported_call``). Two reads on the same side are read in program order.
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any

from ...records import Unsupported
from ...shadow_heap.rebuild import ClockRead, Number, Rebuild
from ..values.symint import SymV
from ..values.scalar import ScalarV
from ..values import ConstV, Value
from ..models import provides

_PLAIN = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
          operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
          operator.imod: operator.mod, operator.ipow: operator.pow}
ARITHMETIC = frozenset(_PLAIN) | frozenset(_PLAIN.values())
UNARY = frozenset((operator.neg, operator.pos, operator.abs))
_MATH = frozenset((math.sqrt, math.exp, math.log, math.log2, math.log10, math.floor, math.ceil,
                   math.trunc, math.fabs, math.isnan, math.isinf, math.isfinite))
_NUMBER = (int, float, bool)
CLOCKS = (time.time, time.perf_counter, time.monotonic,
          time.time_ns, time.perf_counter_ns, time.monotonic_ns)


@dataclass(eq=False, repr=False)
class NumV(ScalarV):
    """``fn(*args)`` computed by the commit; ``value`` is its value at capture (a preview:
    the text a string formatted from it would show, its type). ``node`` is None."""

    fn: Any = None
    args: list = None
    type: type | None = None  # None: the result's type depends on the values (``max(0, v)``)

    def concrete(self):
        raise Unsupported(*_refusal(self))

    def python_type(self):
        if self.type is None:
            raise Unsupported(*_refusal(self, "its type depends on the values"))
        return self.type

    def __repr__(self):
        return f"NumV({getattr(self.fn, '__name__', self.fn)}, {self.value!r})"


@dataclass(eq=False, repr=False)
class ClockV(ScalarV):
    """``time.time()`` & co.: read by the entry before or after the graph (``phase``, set
    by ``settle``); ``value`` is the reading at capture, ``ops`` the graph's op count then."""

    fn: Any = None
    seq: int = 0
    ops: int = 0
    phase: str = ""
    at: tuple = ()  # (filename, line, function) of the read, for a fallback record

    def concrete(self):
        raise Unsupported(*_refusal(self))

    def __repr__(self):
        return f"ClockV({self.fn.__name__}#{self.seq})"


def _leaves(v: Value):
    if isinstance(v, NumV):
        for a in v.args:
            yield from _leaves(a)
    else:
        yield v


def _refusal(v: Value, why: str = "") -> tuple[str, str]:
    """(kind, explanation) for a use of ``v`` that needs its value during capture."""
    use = why or "it steers Python during capture (a branch, a comparison, an index, a torch op)"
    if any(isinstance(leaf, ScalarV) and not isinstance(leaf, ClockV) for leaf in _leaves(v)):
        return ("data_dependent_value", f"a number computed from `.item()` is needed while "
                f"capturing: {use}; storing, returning, printing and arithmetic on it are "
                "captured (computed after the graph)")
    return ("unsupported_call", f"a clock read (time.time() & co.) is needed while capturing: "
            f"{use}; clocks are read when the graph runs: storing, returning, printing and "
            "arithmetic on them are captured")


def _operand(v: Value) -> bool:
    if isinstance(v, ScalarV):
        return True
    if isinstance(v, SymV):
        return type(v.value) in (int, float)
    return isinstance(v, ConstV) and type(v.value) in _NUMBER


def _preview(v: Value):
    return v.value  # ScalarV, SymV (its capture value, not specialised) and ConstV alike


def _make(fn, args: list, stable: bool = True) -> NumV:
    try:
        value = fn(*[_preview(a) for a in args])
    except Exception as e:  # eager raises here too: it runs the call and raises it
        raise Unsupported("exception_handling", f"{getattr(fn, '__name__', fn)} of a number from "
                          f"`.item()` or a clock raised {type(e).__name__}: {e}") from None
    stable = stable and not any(isinstance(a, NumV) and a.type is None for a in args)
    return NumV(None, value, fn, list(args), type(value) if stable else None)


def _deferred(*values: Value) -> bool:
    """Whether this is ours: numbers only, one of them known only after the graph."""
    return all(_operand(v) for v in values) and any(isinstance(v, ScalarV) for v in values)


@provides("deferred_binary")
def binary(op, a: Value, b: Value) -> Value | None:
    """``a <op> b`` as a recipe, or None when it is not arithmetic on deferred numbers."""
    if op not in ARITHMETIC or not _deferred(a, b):
        return None
    op = _PLAIN.get(op, op)  # numbers have no in-place operators: ``x += v`` is ``x = x + v``
    return _make(op, [a, b], stable=op is not operator.pow or _fixed_power(a, b))


def _fixed_power(a: Value, b: Value) -> bool:
    """``a ** b``'s type is known from the operands' types only for a constant exponent
    (``2 ** -1`` is a float, ``(-8.0) ** 0.5`` a complex)."""
    return isinstance(b, ConstV) and (type(b.value) in (int, bool) or b.value.is_integer())


@provides("deferred_unary")
def unary(op, v: Value) -> Value | None:
    if op not in UNARY or not _deferred(v):
        return None
    return _make(op, [v])


def builtin(fn, args: list, kwargs: dict) -> Value | None:
    """``int``/``float``/``round``/``min``/``max``/``math.*`` of deferred numbers, else None."""
    if kwargs or not args or not _deferred(*args):
        return None
    if fn in (int, float) and len(args) == 1 or fn in _MATH and len(args) == 1:
        return _make(fn, args)
    if fn is round and (len(args) == 1 or len(args) == 2 and isinstance(args[1], ConstV)
                        and (args[1].value is None or type(args[1].value) is int)):
        return _make(fn, args)
    if fn in (min, max) and len(args) >= 2:  # Python's first-wins rule, applied at commit
        types = {type(_preview(a)) for a in args}
        return _make(fn, args, stable=len(types) == 1)
    return None


def math_call(fn, args: list, kwargs: dict) -> Value | None:
    return builtin(fn, args, kwargs) if fn in _MATH else None


# ---- clocks -------------------------------------------------------------------------------
def _op_count(tracer) -> int:
    return sum(1 for n in tracer.graph.nodes if n.op not in ("placeholder", "output"))


def clock(tracer, fn, args, kwargs):
    """``time.time()`` & co. (``CLOCKS``, registered as builtin models by ``library/builtins.py``)."""
    if args or kwargs:
        raise Unsupported("exception_handling", f"TypeError: {fn.__name__}() takes no arguments")
    reads = tracer.clock_reads
    read = ClockV(None, fn(), fn, len(reads), _op_count(tracer), at=tracer.user_position())
    reads.append(read)
    return read


def settle(tracer) -> None:
    """At the end of capture: each clock read is read before the graph (no tensor op came
    before it) or after it (none came after it); a read in between falls back."""
    total = _op_count(tracer)
    for read in tracer.clock_reads:
        if read.ops == 0:
            read.phase = "before"
        elif read.ops == total:
            read.phase = "after"
        else:
            e = Unsupported("unsupported_call", f"time.{read.fn.__name__}() is read between "
                            "tensor operations: the graph runs them all at once, so the "
                            "reading has no place in it (a clock read before the first or "
                            "after the last tensor operation of the call is captured)")
            e.filename, e.lineno, e.function = read.at
            raise e


def spec(v: ScalarV, build) -> Rebuild:
    """The rebuild record (``capture.SpecBuilder``) of a recipe or a clock read."""
    if isinstance(v, ClockV):
        return ClockRead(v.fn, v.seq, v.phase)
    return Number(v.fn, tuple(build(a) for a in v.args), id(v))
