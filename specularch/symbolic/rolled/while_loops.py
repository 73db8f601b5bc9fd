"""Rolled ``while i < n:`` loops: an integer counter stepped by a constant, a symbolic bound;
captured once, whatever the trip count.

Unrolled, every test of the condition is guarded: one graph per trip count. Python 3.11
compiles ``while i < n: body`` as a test, the body, and the same test again jumping back to
the body. At the first test, when ``i`` holds an int ``i0`` and ``n`` is symbolic (a size, a
number that changed between calls), the loop is rolled as ``for t in range(...)`` is
(``loops.py``):

1. iteration 0 runs as unrolled; ``i`` then holds ``i0 + c``: the step ``c`` (a constant);
2. the trip count is ``len(range(i0, n, c))`` (``n + 1`` / ``n - 1`` for ``<=`` / ``>=``), a
   run-time value; the graph is guarded on it being at least 1 (the first test's outcome);
3. the body is captured once with ``i`` the symbolic ``i0 + t * c``; what it leaves in ``i``
   must be ``i + c`` (the counter stepping, nothing else) and ``i`` is ``i0 + trips * c``
   after the loop, where the test fails.

A test of another form, a counter that does not step by a constant in the right direction,
``break``/``continue``/``else``, or a body that does not roll, leaves the loop unrolled, and
``explain()`` says why.
"""
from __future__ import annotations

import operator

from ..values.rolled import RollRefused
from ..values.symint import SymV, arithmetic
from ..values import ConstV, Value
from .loops import _NOT_IN_BODY, _Loop, _trip_count, _why_not_roll, not_here, run_rolling

_SYMBOL = {"<": 1, "<=": 1, ">": -1, ">=": -1}  # the direction the counter must step in


def compare(frame, ins, a: Value, b: Value):
    """``COMPARE_OP`` of ``i < n`` at the head of a rollable ``while`` loop: runs and rolls the
    whole loop; returns where the frame goes on (after the loop), or None (as before)."""
    shape = _loop_shape(frame, ins, a, b)
    if shape is None:
        return None
    body, bottom, exit_, var = shape
    tracer = frame.tracer
    site = (id(frame.code), frame.info.instructions[body].offset)
    if not_here(tracer, site):
        return None
    if not _holds(ins.argval, a.value, b.value):
        return None  # no iteration: the test is guarded as before
    run_rolling(tracer, _While(frame, site, body, bottom, exit_, var, a, b, ins.argval))
    return frame.info.instructions[exit_].offset


def _holds(op: str, x, y) -> bool:
    return {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}[op](x, y)


def _loop_shape(frame, ins, a: Value, b: Value):
    """(body, bottom test, exit) instruction indices and the counter's name of a loop whose
    head test is ``i < bound`` with an int ``i`` and a symbolic bound read the same way in
    every iteration (a local, ``len(xs)``, ``x.size(0)``, ``x.shape[0]``, arithmetic)."""
    code, at = frame.info.instructions, frame.ip  # ``at``: the jump after the test
    if ins.argval not in _SYMBOL or not isinstance(a, ConstV) or type(a.value) is not int \
            or not isinstance(b, SymV) or type(b.value) is not int or at < 3 \
            or at >= len(code) or code[at].opname != "POP_JUMP_FORWARD_IF_FALSE" \
            or frame.code.co_name.startswith("<"):
        return None
    start = next((k for k in range(at - 2, max(at - 14, 0), -1) if code[k].opname == "LOAD_FAST"
                  and frame.locals.get(code[k].argval) is a), None)
    exit_ = frame.info.index_of[code[at].argval]
    jump = code[exit_ - 1]
    if start is None or jump.opname != "POP_JUMP_BACKWARD_IF_TRUE" \
            or jump.argval != code[at + 1].offset:
        return None  # a ``while ... else``, a test of another form
    test, bottom = code[start:at], exit_ - 1 - (at - start)
    if [(i.opname, i.argval) for i in code[bottom:exit_ - 1]] != [(i.opname, i.argval) for i in test]:
        return None
    if not _same_in_every_test(code[start + 1:at - 1], code[at + 1:bottom], test[0].argval):
        return None
    return at + 1, bottom, exit_, test[0].argval


# what a bound may be computed with: reads, ``len()``, a tensor's sizes, arithmetic
_BOUND_OPS = {"LOAD_FAST", "LOAD_CONST", "LOAD_DEREF", "LOAD_ATTR", "BINARY_SUBSCR", "BINARY_OP",
              "PRECALL", "CALL", "LOAD_GLOBAL", "LOAD_METHOD"}
_BOUND_CALLS = {"len", "size", "numel", "dim"}


def _same_in_every_test(bound: list, body: list, counter: str) -> bool:
    """Whether the bound's code reads nothing the body rebinds and calls only ``len()`` or a
    tensor's size methods: the rolled loop computes it once, eager before every iteration."""
    names = {i.argval for i in bound if i.opname in ("LOAD_FAST", "LOAD_DEREF")}
    if counter in names or any(i.opname not in _BOUND_OPS for i in bound) or any(
            i.opname in ("LOAD_GLOBAL", "LOAD_METHOD") and i.argval not in _BOUND_CALLS
            for i in bound):
        return False
    return not any(i.opname in ("STORE_FAST", "DELETE_FAST", "STORE_DEREF") and i.argval in names
                   for i in body)


class _While(_Loop):
    """One ``while`` loop: iteration 0 gives its step and trip count; then as ``_Loop``."""

    def __init__(self, frame, site, body, bottom, exit_, var, start: ConstV, bound: SymV, op):
        self.frame, self.tracer, self.graph = frame, frame.tracer, frame.tracer.graph
        self.head, self.body, self.exit, self.var = bottom, body, exit_, var
        self.site = site
        self.where = f"{frame.code.co_filename}:{frame.lineno}"
        self.start, self.step, self.n, self.bound, self.op = start, None, None, bound, op
        self.items, self.first = None, None
        self.form = f"while {var} {op} {bound.label or 'n'}"

    def refuse(self, why: str):
        raise RollRefused(self.site, self.where, why, self.form)

    def _check_bytecode(self) -> None:
        for ins in self.frame.info.instructions[self.body:self.head]:
            if ins.opname in _NOT_IN_BODY:
                self.refuse(f"its body has {ins.opname}")

    def _iterate(self, index: Value) -> None:
        self.first = self.first or index
        self._run_body(index)

    def _run_body(self, value: Value) -> None:
        """One iteration: ``value`` in the loop's variable, the body run to the loop's head."""
        frame = self.frame
        frame.locals[self.var] = value
        frame.ip = self.body
        while frame.ip != self.head:
            if frame.result is not None or not self.body <= frame.ip < self.head:
                self.refuse("an iteration leaves the loop (break, continue, return or an "
                            "exception)")
            frame._step()

    def _after_first(self) -> None:
        after = self.frame.locals.get(self.var)
        if not isinstance(after, ConstV) or type(after.value) is not int \
                or (after.value - self.start.value) * _SYMBOL[self.op] <= 0:
            self.refuse(f"`{self.var}` does not step by a constant towards the bound in its "
                        f"first iteration (it holds {after!r})")
        self.step = after.value - self.start.value
        stop = self.bound  # len(range(i0, stop, c)) iterations: ``<=``/``>=`` reach the bound
        if self.op in ("<=", ">="):
            stop = arithmetic(self.tracer, operator.add, stop, ConstV(_SYMBOL[self.op]))
        self.n = _trip_count(self.tracer, self.start, stop, self.step)
        why = _why_not_roll(self.tracer, self.site, self.n)
        if why is not None:
            self.refuse(why)

    def _index(self, counter):
        index = super()._index(counter)
        index.label = self.var
        return index

    def is_next(self, h: Value, a: Value, index: Value) -> bool:
        stepped = {(operator.add, (index.node, self.step)), (operator.add, (self.step, index.node)),
                   (operator.sub, (index.node, -self.step))}  # ``i += c``, ``i = c + i``, ``i -= c``
        if not isinstance(a, SymV) or (a.node.target, a.node.args) not in stepped:
            return False
        if not (isinstance(h, ConstV) and h.value == self.start.value + self.step):
            self.refuse(f"`{self.var}` is the counter only from the second iteration on")
        return True

    def last_index(self, last: Value) -> Value:
        """The counter after the loop, where the test fails: ``i0 + trips * c``."""
        trips = arithmetic(self.tracer, operator.add, last, ConstV(1))
        scaled = arithmetic(self.tracer, operator.mul, trips, ConstV(self.step))
        return arithmetic(self.tracer, operator.add, self.start, scaled)

