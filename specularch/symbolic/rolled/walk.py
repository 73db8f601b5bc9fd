"""Rolled linked walks: ``while node is not None: ...; node = node.next`` over user objects
from the call, captured once, whatever the walk's length.

Unrolled, every test of ``node is not None`` and every node's attributes are guarded: one
graph per length. Python 3.11 compiles the loop as a ``POP_JUMP_FORWARD_IF_NONE`` test, the
body, and the same test jumping back. At the first test, when ``node`` holds an object from
the call (an argument, an attribute) and the body ends with ``node = node.<link>`` (and
binds ``node`` nowhere else), the loop is rolled as a loop over a list of objects is
(``objects.py``, ``loops.py``):

1. the walk ``[node, node.link, ...]`` up to ``None`` is a graph node (``walked``) from the
   head, an input; its length is the trip count, a run-time value;
2. the guards are checked per node of the walk: every node of the head's class
   (``ObjectListGuard``) and, for each attribute the body reads, the same kind in every
   node (``ItemAttrGuard``: tensors of one dtype/shape/requires_grad, numbers of one type,
   an equal constant). A walk with a node that differs fails a guard before anything runs:
   the call is captured again, with the loop unrolled where the new walk cannot roll, and
   ``explain()`` says why;
3. in an iteration ``node`` is the ``k``-th node of the walk (``RowV``); ``node.link`` is
   only stored back into ``node``, which holds ``None`` after the loop.

A walk reached by a Python write earlier in the call, a body that reads ``node.link`` other
than to step, ``break``/``continue``/``else``, or a body that does not roll keep it unrolled.
"""
from __future__ import annotations

from ...guards.lists import walked
from ..library_files import is_library_file
from ..values import ConstV, ObjV, Value
from . import lists as rolled_lists, objects as rolled_objects
from .loops import _why_not_roll, not_here, run_rolling
from .while_loops import _While

_END = ("LOAD_FAST", "LOAD_ATTR", "STORE_FAST")  # ``node = node.link``, the body's last line
# the test at the top -> the same test at the bottom: ``while node is not None:``, and
# ``while node:`` over nodes whose class has no ``__bool__``/``__len__`` (true unless None)
_TESTS = {"POP_JUMP_FORWARD_IF_NONE": "POP_JUMP_BACKWARD_IF_NOT_NONE",
          "POP_JUMP_FORWARD_IF_FALSE": "POP_JUMP_BACKWARD_IF_TRUE"}


def head_test(frame, ins, value: Value):
    """``POP_JUMP_FORWARD_IF_NONE`` of ``while node is not None:`` (or
    ``POP_JUMP_FORWARD_IF_FALSE`` of ``while node:``): runs and rolls the whole walk; returns
    where the frame goes on (after the loop), or None (as before)."""
    shape = _loop_shape(frame, ins, value)
    if shape is None:
        return None
    body, bottom, exit_, var, link = shape
    tracer = frame.tracer
    site = (id(frame.code), frame.info.instructions[body].offset)
    if not_here(tracer, site):
        return None
    nodes = walked(value.obj, link)
    if len(nodes) < 2 or not rolled_objects.plain_objects(nodes):
        return None  # too short to compare two iterations, a broken walk, nodes of two classes
    run_rolling(tracer, _Walk(frame, site, (body, bottom, exit_), var, link, value, nodes,
                              truthiness=ins.opname == "POP_JUMP_FORWARD_IF_FALSE"))
    return frame.info.instructions[exit_].offset


def _loop_shape(frame, ins, value: Value):
    """(body, bottom test, exit) instruction indices, the variable and the link of a loop
    ``while var is not None: ...; var = var.link`` whose ``var`` holds an object from the call."""
    code, at = frame.info.instructions, frame.ip - 1  # ``at``: the test's jump
    if ins.opname not in _TESTS or at < 1 or code[at - 1].opname != "LOAD_FAST" \
            or not isinstance(value, ObjV) or value.source is None \
            or ins.opname == "POP_JUMP_FORWARD_IF_FALSE" and not _always_true(type(value.obj)) \
            or frame.code.co_name.startswith("<") or is_library_file(frame.code.co_filename):
        return None
    var = code[at - 1].argval
    exit_ = frame.info.index_of[ins.argval]
    if frame.locals.get(var) is not value or exit_ < at + 6:
        return None
    jump, load = code[exit_ - 1], code[exit_ - 2]
    if jump.opname != _TESTS[ins.opname] or jump.argval != code[at + 1].offset \
            or (load.opname, load.argval) != ("LOAD_FAST", var):
        return None  # a ``while ... else``, a test of another form
    bottom = exit_ - 2
    end = code[bottom - 3:bottom]
    if tuple(i.opname for i in end) != _END or end[0].argval != var or end[2].argval != var:
        return None
    if any(i.opname in ("STORE_FAST", "DELETE_FAST") and i.argval == var
           or i.opname in ("STORE_ATTR", "DELETE_ATTR") for i in code[at + 1:bottom - 3]):
        return None  # an attribute write outlives an iteration: never rolled, left to unrolled.py
    return at + 1, bottom, exit_, var, end[1].argval


class _Walk(_While):
    """One walk: the ``k``-th node in iteration ``k``; then as ``_Loop``."""

    def __init__(self, frame, site, where_in_code: tuple, var: str, link: str, head: ObjV,
                 nodes: list, truthiness: bool = False):
        self.frame, self.tracer, self.graph = frame, frame.tracer, frame.tracer.graph
        self.body, self.head, self.exit = where_in_code
        self.var, self.link, self.site = var, link, site
        self.where = f"{frame.code.co_filename}:{frame.lineno}"
        self.start, self.step, self.items, self.first = ConstV(0), 1, None, None
        self.form = f"while {var}{'' if truthiness else ' is not None'}: {var} = {var}.{link}"
        self.nodes = self.tracer.wrap_walk(head.source, link, nodes, self.where)
        self.n = self.nodes.length
        rolled_objects.no_earlier_writes(self.tracer, self.nodes, self)

    def _iterate(self, index: Value) -> None:
        self._run_body(rolled_lists.item(self, index, self.nodes))

    def _after_first(self) -> None:
        if not _successor(self.frame.locals.get(self.var)):
            self.refuse(f"`{self.var}` is not `{self.var}.{self.link}` after its first iteration")
        why = _why_not_roll(self.tracer, self.site, self.n)
        if why is not None:
            self.refuse(why)

    def is_next(self, h: Value, a: Value, index: Value) -> bool:
        """``node = node.link``: the walk stepping, ``None`` after the loop."""
        return _successor(h) and _successor(a)

    def last_index(self, last: Value) -> Value:
        return ConstV(None)  # where the test fails


def _always_true(cls: type) -> bool:
    """Whether ``bool()`` of every instance of ``cls`` is True (no ``__bool__``/``__len__``
    decides it): ``while node:`` then stops where ``while node is not None:`` does (the walk
    ends at ``None``; any other value the link holds fails the walk's guards)."""
    return not hasattr(cls, "__bool__") and not hasattr(cls, "__len__")


def _successor(v) -> bool:
    return isinstance(v, rolled_objects.RowV) and v.successor
