"""Opcode family: operators — arithmetic, unary, comparison, identity, membership,
subscripts, slices and string formatting."""
from __future__ import annotations

import operator

from ...records import Unsupported
from ..rolled import while_loops as rolled_while
from ..speculation import branch_merge, item_args
from .. import operators as ops
from ..library import printing
from .registry import handles
from ..values import ConstV, SliceV, TensorV, is_const
from ..values.symint import SymV
from ..values.scalar import ScalarV


@handles("BINARY_OP")
def _binary_op(frame, ins):
    b, a = frame.pop(), frame.pop()
    frame.push(ops.binary(frame.tracer, ops.BINARY_OPS[ins.arg], a, b))


@handles("UNARY_NEGATIVE")
def _neg(frame, ins):
    frame.push(ops.unary(frame.tracer, operator.neg, frame.pop()))


@handles("UNARY_POSITIVE")
def _pos(frame, ins):
    frame.push(ops.unary(frame.tracer, operator.pos, frame.pop()))


@handles("UNARY_INVERT")
def _invert(frame, ins):
    frame.push(ops.unary(frame.tracer, operator.invert, frame.pop()))


@handles("UNARY_NOT")
def _not(frame, ins):
    frame.push(ConstV(not ops.truth(frame.tracer, frame.pop())))


@handles("COMPARE_OP")
def _compare(frame, ins):
    b, a = frame.pop(), frame.pop()
    after_loop = rolled_while.compare(frame, ins, a, b)  # ``while i < n:``, captured once
    if after_loop is not None:
        return after_loop
    frame.push(ops.compare(frame.tracer, ins.argval, a, b))


@handles("IS_OP")
def _is(frame, ins):
    b, a = frame.pop(), frame.pop()
    branch = frame.tracer.merged_aliases.identity(a, b)
    if branch is not None:  # eager may give one tensor where the merged graph has two
        raise branch_merge.refuse("`is` compares the identity of a merged tensor", branch)
    if a is not b and (isinstance(a, ScalarV) or isinstance(b, ScalarV)) \
            and not any(isinstance(v, ConstV) and v.value is None for v in (a, b)):
        # ``flag.item() is True``: the in-graph number's identity, as eager's (small ints
        # and bools are shared objects); ``is None`` of a number is False without a check
        same = item_args.speculated(frame.tracer, operator.is_, [a, b])
        if same is None:
            (a if isinstance(a, ScalarV) else b).concrete()  # (raises data_dependent_value)
    else:
        same = ops.identical(a, b)
    frame.push(ConstV(same != bool(ins.arg)))


@handles("CONTAINS_OP")
def _contains(frame, ins):
    container, item = frame.pop(), frame.pop()
    if isinstance(container, TensorV):
        raise Unsupported("data_dependent_branch", "`in` on a tensor compares tensor values")
    numbers = item_args.members(frame.tracer, container) if isinstance(item, ScalarV) else None
    if numbers is not None:  # ``t.item() in (1, 2)``, ``tok.item() in self.stop_ids``
        op = item_args.not_contains if ins.arg else operator.contains
        found = item_args.speculated(frame.tracer, op, [numbers, item], mergeable=True)
        if isinstance(found, TensorV):  # (gone both ways: a merged branch's predicate)
            frame.push(found)
            return None
        if found is not None:
            frame.push(ConstV(found))
            return None
    frame.push(ConstV(ops.contains(frame.tracer, item, container) != bool(ins.arg)))


@handles("BINARY_SUBSCR")
def _subscr(frame, ins):
    key, container = frame.pop(), frame.pop()
    frame.push(ops.getitem(frame.tracer, container, key))


@handles("STORE_SUBSCR")
def _store_subscr(frame, ins):
    key, container, value = frame.pop(), frame.pop(), frame.pop()
    ops.setitem(frame.tracer, container, key, value)


@handles("DELETE_SUBSCR")
def _delete_subscr(frame, ins):
    key, container = frame.pop(), frame.pop()
    ops.delitem(frame.tracer, container, key)


@handles("BUILD_SLICE")
def _build_slice(frame, ins):
    parts = frame.popn(ins.arg)
    if any(isinstance(p, SymV) for p in parts) and all(isinstance(p, (SymV, ConstV)) for p in parts):
        frame.push(SliceV(parts))  # ``x[:n]``, ``x[t:t + 1]``: symbolic bounds (values.SliceV)
        return
    if not all(is_const(p) for p in parts):
        raise Unsupported("data_dependent_value", "a slice bound computed from a tensor value")
    frame.push(ConstV(slice(*[p.concrete() for p in parts])))


@handles("FORMAT_VALUE")
def _format_value(frame, ins):
    spec = frame.pop().concrete() if (ins.arg & 0x04) else ""
    value = frame.pop()
    frame.push(printing.format_value_v(value, ins.arg & 0x03, spec))


@handles("BUILD_STRING")
def _build_string(frame, ins):
    frame.push(printing.build_string(frame.popn(ins.arg)))
