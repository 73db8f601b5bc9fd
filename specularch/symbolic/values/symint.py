"""Symbolic Python numbers: sizes of dynamic dimensions and scalar arguments that vary.

A ``SymV`` carries its value at capture time, the FX node that computes it when the graph
runs, and — when it can be computed from the frame before the graph runs — ``expr``, a
Python expression over the frame roots (``L[0].shape[0] * 2``). Passing a ``SymV`` to a
torch op keeps it symbolic (the node is the argument). Using its value in Python (a branch,
a loop count, an index) *specialises* it: a guard ``expr == value`` when ``expr`` is known,
otherwise an in-graph assertion checked before commit.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch.fx

from ...guards.guard import ExprGuard, same_value
from . import ConstV, Value
from .raised import python_error

_SYMBOL = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//",
           operator.mod: "%", operator.truediv: "/", operator.pow: "**",
           operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=",
           operator.eq: "==", operator.ne: "!="}
ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
              operator.truediv, operator.pow, operator.iadd, operator.isub, operator.imul,
              operator.ifloordiv, operator.imod, operator.itruediv, operator.ipow}
_INPLACE_TO_PLAIN = {operator.iadd: operator.add, operator.isub: operator.sub,
                     operator.imul: operator.mul, operator.ifloordiv: operator.floordiv,
                     operator.imod: operator.mod, operator.itruediv: operator.truediv,
                     operator.ipow: operator.pow}
COMPARISONS = {operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne}


@dataclass(eq=False, repr=False)
class SymV(Value):
    kind_text = "a number that varies between calls (a size, a number argument, a draw)"
    value: Any
    node: torch.fx.Node
    expr: str | None      # code over the frame roots, or None (known only inside the graph)
    tracer: Any
    label: str = ""       # the same expression as the user would write it

    def __post_init__(self):
        # The capture-time value, as every graph node's ``meta["example"]`` (a backend reads a
        # number output's type from it: ``fx_lower/passes.number_outputs``).
        if isinstance(self.node, torch.fx.Node):
            self.node.meta.setdefault("example", self.value)

    def concrete(self):
        """The value, for use in Python: specialises (guards or asserts) on it."""
        specialize(self.tracer, self)
        return self.value

    def python_type(self):
        return type(self.value)

    def __repr__(self):
        return f"SymV({self.value}, {self.expr or self.node.name})"


def specialize(tracer, v: SymV) -> None:
    if v.expr is not None:
        tracer.guards.add(ExprGuard(None, expr=v.expr, expected=v.value, label=v.label,
                                    where=tracer.where()))
    elif not tracer.always_equal(v, ConstV(v.value)):  # a size fixed after all: no check
        check = tracer.graph.call_function(same_value, (v.node, v.value))  # -0.0 is not 0.0
        check.meta["example"] = True
        tracer.assertions.append((check, True, tracer.where(), ("specialize", id(v.node))))


def _operand(x: Value):
    """(runtime arg, capture value, expr, label) of an operand of symbolic arithmetic."""
    if isinstance(x, SymV):
        return x.node, x.value, x.expr, x.label
    text = repr(x.value)
    if type(x.value) is float and not math.isfinite(x.value):
        text = f"float({str(x.value)!r})"  # inf/nan have no literal
    return x.value, x.value, text, repr(x.value)


def arithmetic(tracer, op, a: Value, b: Value) -> Value:
    op = _INPLACE_TO_PLAIN.get(op, op)
    na, va, ea, la = _operand(a)
    nb, vb, eb, lb = _operand(b)
    try:
        value = op(va, vb)
    except ArithmeticError as e:  # 1 / n with n == 0: the user's error, as eager raises it
        for x in (a, b):  # pinned to these values, the error is decided by guards
            if isinstance(x, SymV):
                x.concrete()
        raise python_error(e.with_traceback(None)) from None
    if op is operator.pow:
        _pin_power_type(tracer, a, b, va, vb)
    node = tracer.graph.call_function(op, (na, nb))
    known = ea is not None and eb is not None
    sym = _SYMBOL[op]
    return SymV(value, node, f"({ea} {sym} {eb})" if known else None, tracer,
                f"({la} {sym} {lb})" if known else "")


def _pin_power_type(tracer, a: Value, b: Value, va, vb) -> None:
    """``a ** b``'s Python type depends on the values: ``2 ** n`` is an int for ``n >= 0``
    and a float below, ``f ** 0.5`` a float for ``f >= 0`` and complex below. The side the
    capture's values were on is guarded (or checked in the graph), so the type the graph's
    number has (what ``type()``, ``int()`` and a tensor op's dtype see) is the call's.
    Only an input number to a constant fractional power (``f ** 0.5``) has its sign guarded:
    a base computed by arithmetic (Adam's ``(1 - beta2 ** step) ** 0.5``, per parameter) or a
    varying exponent (``beta1 ** step``) would cost every training step guards (documented
    in semantics.md)."""
    if type(va) is int and type(vb) is int and isinstance(b, SymV):
        compare(tracer, operator.ge, b, ConstV(0))
    elif isinstance(b, ConstV) and type(vb) is float and not vb.is_integer() \
            and isinstance(a, SymV) and type(va) in (int, float) and a.node.op == "placeholder":
        compare(tracer, operator.ge, a, ConstV(0))  # (``beta ** step``: not guarded)
    elif type(vb) is not int and isinstance(b, SymV) and type(va) in (int, float) and va < 0:
        b.concrete()  # a negative base to a varying power: complex unless it is integral


def negate(tracer, v: SymV) -> SymV:
    """``-v``, symbolic: ``operator.neg`` keeps the sign of a zero (``0 - v`` made ``0.0`` of
    ``-0.0``, which ``copysign``, ``1 / x`` and printing tell apart)."""
    node = tracer.graph.call_function(operator.neg, (v.node,))
    known = v.expr is not None
    return SymV(-v.value, node, f"(-{v.expr})" if known else None, tracer,
                f"(-{v.label})" if known else "")


def convert(tracer, fn, v: SymV, *rest) -> SymV:
    """``int(v)``, ``float(v)``, ``round(v[, n])`` of a symbolic number, symbolic too: a loop
    count or size made from a drawn or relaxed number is guarded as the value it gives
    (``int(random.random() * 4) == 1``), not as the number it came from."""
    try:
        value = fn(v.value, *rest)
    except (OverflowError, ValueError) as e:  # int(inf), int(nan): eager's error, pinned
        v.concrete()
        raise python_error(e.with_traceback(None)) from None
    node = tracer.graph.call_function(fn, (v.node, *rest))
    more = "".join(f", {r!r}" for r in rest)
    known = v.expr is not None
    return SymV(value, node, f"{fn.__name__}({v.expr}{more})" if known else None, tracer,
                f"{fn.__name__}({v.label}{more})" if known else "")


def compare(tracer, op, a: Value, b: Value) -> ConstV:
    """Comparisons decide Python control flow: the outcome is guarded (or asserted)."""
    na, va, ea, la = _operand(a)
    nb, vb, eb, lb = _operand(b)
    outcome = op(va, vb)
    if op in (operator.eq, operator.ne) and outcome == (op is operator.eq) \
            and (ea is None or eb is None) and tracer.always_equal(a, b):
        return ConstV(outcome)  # equal for every size of the inputs: nothing to check
    if ea is not None and eb is not None:
        sym = _SYMBOL[op]
        tracer.guards.add(ExprGuard(None, expr=f"({ea} {sym} {eb})", expected=outcome,
                                    label=f"({la} {sym} {lb})", where=tracer.where()))
    else:
        check = tracer.graph.call_function(op, (na, nb))
        check.meta["example"] = outcome
        tracer.assertions.append((check, outcome, tracer.where(), ("compare", id(check))))
    return ConstV(outcome)


def sequence_guard(tracer, xs: list, ys: list) -> bool | None:
    """``tuple(xs) == tuple(ys)`` guarded as one expression where every item is known from
    the frame; None where an item is computed inside the graph."""
    left, right = [_operand(x) for x in xs], [_operand(y) for y in ys]
    if any(o[2] is None for o in left + right):
        return None
    outcome = [o[1] for o in left] == [o[1] for o in right]

    def text(ops, at):
        return "(" + ", ".join(str(o[at]) for o in ops) + ("," if len(ops) == 1 else "") + ")"
    tracer.guards.add(ExprGuard(None, expr=f"({text(left, 2)} == {text(right, 2)})", expected=outcome,
                                label=f"({text(left, 3)} == {text(right, 3)})", where=tracer.where()))
    return outcome


def is_symbolic_operand(x: Value) -> bool:
    return isinstance(x, SymV) or (isinstance(x, ConstV) and type(x.value) in (int, float, bool))
