"""Opcode family: control flow. Branches are decided by concrete Python values (a branch
on a tensor's value is ``data_dependent_branch``); loops are unrolled by iterating values
known at capture time. Exceptions (raise, try/except, with) are in ``ops_exceptions``."""
from __future__ import annotations

import operator

from ...records import Unsupported
from ..operators import iterate, truth
from ..rolled import (lists as rolled_lists, loops as rolled_loops, objects as rolled_objects,
                      rows as rolled_rows,
                      unrolled as loop_notes, walk as rolled_walk)
from ..speculation import branch_merge, exit_tests, item_args, raising_branch
from .registry import handles
from ..values.rolled import SymRangeIterV
from ..values import ConstV, TensorV
from ..values.scalar import ScalarV


@handles("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT")
def _jump(frame, ins):
    return ins.argval


@handles("POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE")
def _pop_jump_if_true(frame, ins):
    return _branch(frame, ins, jump_if=True)


@handles("POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE")
def _pop_jump_if_false(frame, ins):
    tested = frame.pop()
    after_loop = rolled_walk.head_test(frame, ins, tested)  # ``while node:``
    if after_loop is not None:
        return after_loop
    frame.push(tested)
    return _branch(frame, ins, jump_if=False)


def _branch(frame, ins, jump_if: bool):
    v = frame.pop()
    if isinstance(v, ScalarV):  # ``if flag.item():`` speculated, or merged once it flipped
        tested = item_args.speculated(frame.tracer, operator.truth, [v], mergeable=True,
                                      at_jump=True)
        if isinstance(tested, bool):
            return ins.argval if tested is jump_if else None
        if tested is not None:  # (the predicate of a merged branch)
            v = tested
    if isinstance(v, TensorV) and exit_tests.is_exit(frame.tracer, frame, frame.ip - 1):
        return ins.argval if truth(frame.tracer, v) is jump_if else None  # (rolled/exits.py)
    if isinstance(v, TensorV) and frame.tracer.speculation_stopped(frame):
        raising_branch.keep_speculating(frame, ins)  # validation: an assumption, not a merge
    if isinstance(v, TensorV) and (frame.tracer.speculation_stopped(frame) or frame.tracer.merging) \
            and v.example.numel() == 1 and ins.opname.startswith("POP_JUMP_FORWARD"):
        join = branch_merge.merge(frame, ins, v, jump_if)  # both sides, selected in-graph
        return frame.info.instructions[join].offset
    if truth(frame.tracer, v) is jump_if:
        return ins.argval


def _is_none(v) -> bool:
    if isinstance(v, rolled_objects.RowV):
        v.concrete()  # ``node.next is None`` of a rolled walk: one iteration's answer
    return isinstance(v, ConstV) and v.value is None


@handles("POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NONE")
def _pop_jump_if_none(frame, ins):
    value = frame.pop()
    after_loop = rolled_walk.head_test(frame, ins, value)  # ``while node is not None:``
    if after_loop is not None:
        return after_loop
    if _is_none(value):
        return ins.argval


@handles("POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE")
def _pop_jump_if_not_none(frame, ins):
    if not _is_none(frame.pop()):
        return ins.argval


@handles("JUMP_IF_TRUE_OR_POP")
def _jump_if_true_or_pop(frame, ins):
    if truth(frame.tracer, frame.stack[-1]):
        return ins.argval
    frame.pop()


@handles("JUMP_IF_FALSE_OR_POP")
def _jump_if_false_or_pop(frame, ins):
    if not truth(frame.tracer, frame.stack[-1]):
        return ins.argval
    frame.pop()


@handles("GET_ITER")
def _get_iter(frame, ins):
    iterated = frame.pop()
    it = rolled_lists.get_iter(frame, iterated) or rolled_rows.get_iter(frame, iterated) \
        or iterate(frame.tracer, iterated)
    loop_notes.mark_list_iterator(it, iterated)
    frame.push(it)


@handles("FOR_ITER")
def _for_iter(frame, ins):
    if isinstance(frame.stack[-1], SymRangeIterV) and frame.stack[-1].pos == 0:
        return rolled_loops.for_iter(frame, ins, frame.stack[-1])  # the body captured once
    item = frame.stack[-1].next()
    if item is None:
        frame.pop()
        return ins.argval
    frame.push(item)


# ---- generator expressions (run to completion, collecting what they yield) ----------------
@handles("RETURN_GENERATOR")
def _return_generator(frame, ins):
    if not frame.generator:
        raise Unsupported("generator", "generator functions run eagerly")
    frame.push(ConstV(None))  # popped right away: the value of the first send(None)


@handles("YIELD_VALUE")
def _yield_value(frame, ins):
    if not frame.generator:
        raise Unsupported("generator", "yield inside the optimized function")
    frame.yielded.append(frame.pop())
    frame.push(ConstV(None))  # the value `send` would deliver


@handles("GET_YIELD_FROM_ITER", "SEND", "ASYNC_GEN_WRAP", "GET_AWAITABLE", "GET_AITER",
         "GET_ANEXT", "BEFORE_ASYNC_WITH", "END_ASYNC_FOR", falls_back=True)
def _async_or_delegating(frame, ins):
    raise Unsupported("generator", f"{ins.opname}: generators/coroutines run eagerly")


# ---- exceptions (the rest: ops/exceptions.py) --------------------------------------------
@handles("CHECK_EG_MATCH", "PREP_RERAISE_STAR", falls_back=True)
def _exception_groups(frame, ins):
    raise Unsupported("exception_handling", f"{ins.opname}: `except*` is not captured")
