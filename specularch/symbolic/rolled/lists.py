"""Rolled ``for x in xs`` loops over a list of tensors from the call: captured once, whatever
the list's length.

Unrolled, such a loop guards the list's length and every item, one graph per length. Rolled:

1. at ``GET_ITER`` of a list read from the call (an argument, an attribute) whose length
   changed between calls (``Assumptions.varied_lists``: profiling or a failed length guard,
   as ``range(n)`` rolls over a number that varied) and whose items are tensors (or tuples
   of tensors) sharing item 0's metadata, followed by ``FOR_ITER``, capture raises ``RollList``; ``capture.py`` starts again with the list's source in
   ``Assumptions.rolled_lists``;
2. read again, the list becomes one graph input (``inputs.wrap_tensor_list``), a
   ``TensorListV`` guarded by ``TensorListGuard`` (every item like item 0; the length not
   guarded), its length a ``SymV`` (``len(xs)``);
3. its iterator (``ListIterV``) rolls the loop as ``range(len(xs))`` does
   (``loops.py``): ``x`` is ``xs[0]`` in iteration 0 and ``xs[k]`` (the body indexes the
   list with the loop counter) in the body.

Anything else done with the list (an item read, a write, ``xs.append``) or a body that does
not roll makes capture start again with the loop unrolled, and ``explain()`` says why.
"""
from __future__ import annotations

import dis
import operator

import torch

from ...guards.lists import NUMBERS, uniform
from ...guards.sources import ItemSource
from ...records import Unsupported
from . import objects as rolled_objects
from ..values.rolled import ItemNumberV, ListIterV, RollRefused, TensorListV
from ..values.symint import SymV
from ..values import ConstV, FuncV, ListV, ObjV, TensorV, TupleV, Value


class RollList(Unsupported):
    """Capture starts again with the list at ``source`` passed whole (``capture.py``)."""

    def __init__(self, source, site: tuple, where: str):
        super().__init__("unsupported_call", f"the loop at {where} over {source} is rolled")
        self.source, self.site, self.where = source, site, where


def form(source, enumerated: bool = False, count_from: int = 0, zipped: tuple = ()) -> str:
    """How ``explain()`` names the loop (the target's names are the usual ones, not the user's)."""
    if zipped:
        names = ", ".join(_NAMES[k] if k < len(_NAMES) else f"x{k}" for k in range(len(zipped)))
        lists = f"zip({', '.join(str(lst.source) for lst in zipped)})"
        if enumerated:
            return f"for k, ({names}) in enumerate({lists}{f', {count_from}' if count_from else ''})"
        return f"for {names} in {lists}"
    if enumerated:
        return f"for k, x in enumerate({source}{f', {count_from}' if count_from else ''})"
    return f"for x in {source}"


_NAMES = ("x", "y", "z")


def get_iter(frame, iterated: Value):
    """``GET_ITER``: the iterator that rolls a ``for x in xs`` loop, or None (as before)."""
    if isinstance(iterated, TensorListV):
        if loop_site(frame) is None:
            raise Unsupported("unsupported_call", f"{iterated.source} passed whole is iterated "
                              "other than by a for loop or a list comprehension")
        return ListIterV([], n=iterated.length, start=ConstV(0), step=1, of=iterated)
    if type(iterated) is ListV and iterated.source is not None and _rollable(frame, iterated):
        raise RollList(iterated.source, loop_site(frame), f"{frame.code.co_filename}:{frame.lineno}")
    return None


def loop_site(frame):
    """(id(code), offset of FOR_ITER) of the loop that consumes the iterator ``GET_ITER``
    makes: the next instruction, or the first ``FOR_ITER`` of the list comprehension called
    with it (``[f(x) for x in xs]``: ``GET_ITER; PRECALL 0; CALL 0``); None for anything else."""
    code = frame.info.instructions
    if frame.ip >= len(code):
        return None
    if code[frame.ip].opname == "FOR_ITER":
        return (id(frame.code), code[frame.ip].offset)
    comprehension = frame.stack[-1] if frame.stack else None
    if frame.ip + 1 >= len(code) or (code[frame.ip].opname, code[frame.ip].arg) != ("PRECALL", 0) \
            or code[frame.ip + 1].opname != "CALL" or not isinstance(comprehension, FuncV) \
            or comprehension.code.co_name != "<listcomp>":
        return None
    head = next((i for i in dis.get_instructions(comprehension.code) if i.opname == "FOR_ITER"), None)
    return None if head is None else (id(comprehension.code), head.offset)


def enumerate_list(tracer, args: list, kwargs: dict):
    """``enumerate(xs)`` or ``enumerate(xs, start)`` consumed right away by a ``for`` loop:
    rolled as ``for x in xs`` is, handing out ``(start + k, xs[k])``; None where the loop is
    unrolled as before."""
    frame = consumed_by_a_loop(tracer)
    start = kwargs.get("start", args[1] if len(args) == 2 else ConstV(0))
    if frame is None or not 1 <= len(args) <= 2 or set(kwargs) - {"start"} \
            or len(args) + len(kwargs) > 2 or not isinstance(start, ConstV) \
            or type(start.value) is not int:
        return None  # a start that varies would be a Python value the body depends on
    if isinstance(args[0], ListIterV) and args[0].zipped and not args[0].enumerated:
        it = args[0]  # ``enumerate(zip(xs, ys))``: zip_lists rolled it for this loop
    else:
        it = _whole(frame, args[0])
    if it is not None:
        it.enumerated, it.count_from = True, start.value
    return it


def zip_lists(tracer, args: list, kwargs: dict):
    """``zip(xs, ys, ...)`` of lists from the call, consumed right away by a ``for`` loop:
    every list passed whole (one ``RollList`` restart each), the loop rolled as ``for x in
    xs`` is, handing out ``(xs[k], ys[k], ...)`` for ``min(len(xs), len(ys), ...)``
    iterations, as eager's zip stops at the shortest list; None where it is unrolled."""
    frame, skip = consumed_by_a_loop(tracer), 0
    if frame is None:
        frame, skip = consumed_by_enumerate(tracer)
    if frame is None or len(args) < 2 or kwargs:
        return None  # zip(strict=True) raises on lists of other lengths: unrolled
    frame.ip += 1 + skip  # as at the GET_ITER
    try:
        if not all(isinstance(a, TensorListV) or type(a) is ListV and a.source is not None
                   and _rollable(frame, a) for a in args):
            return None
        its = [get_iter(frame, a) for a in args]  # the first list not yet whole: RollList
    finally:
        frame.ip -= 1 + skip
    it = its[0]
    it.n, it.zipped = _shortest(tracer, [lst.of for lst in its]), tuple(lst.of for lst in its)
    return it


def _shortest(tracer, lists: list) -> SymV:
    """``min(len(xs), len(ys), ...)``: the trip count, guarded (as a length is) only where a
    branch reads it."""
    lengths = [lst.length for lst in lists]
    node = tracer.graph.call_function(min, tuple(n.node for n in lengths))
    known = all(n.expr is not None for n in lengths)
    return SymV(min(n.value for n in lengths), node,
                f"min({', '.join(n.expr for n in lengths)})" if known else None, tracer,
                f"min({', '.join(n.label for n in lengths)})")


def consumed_by_a_loop(tracer):
    """The frame calling a builtin whose result goes straight to ``GET_ITER`` and
    ``FOR_ITER``, or None."""
    frame = tracer.frames[-1] if tracer.frames else None
    if frame is None or frame.ip + 1 >= len(frame.info.instructions) \
            or frame.info.instructions[frame.ip].opname != "GET_ITER":
        return None
    return frame


def consumed_by_enumerate(tracer) -> tuple:
    """(the frame, how many instructions to its ``GET_ITER``) where a builtin's result goes
    straight to ``enumerate(...)`` or ``enumerate(..., start)`` (a constant), then to
    ``GET_ITER`` and ``FOR_ITER``; (None, 0) otherwise."""
    frame = tracer.frames[-1] if tracer.frames else None
    if frame is None or not frame.stack or _builtin(frame.stack[-1]) is not enumerate:
        return None, 0
    code, at = frame.info.instructions, frame.ip
    ops = [(i.opname, i.arg) for i in code[at:at + 5]]
    if ops[:3] == [("PRECALL", 1), ("CALL", 1), ("GET_ITER", None)] and len(ops) > 3 \
            and ops[3][0] == "FOR_ITER":
        return frame, 2
    if len(ops) == 5 and ops[0][0] == "LOAD_CONST" and type(code[at].argval) is int \
            and ops[1:4] == [("PRECALL", 2), ("CALL", 2), ("GET_ITER", None)] \
            and ops[4][0] == "FOR_ITER":
        return frame, 3
    return None, 0


def _builtin(v: Value):
    return getattr(v, "obj", getattr(v, "value", None))


def _whole(frame, lst: Value):
    """The rolling iterator of ``lst`` as ``GET_ITER`` would make it, from the call before."""
    frame.ip += 1  # as at the GET_ITER: what follows must be the loop's FOR_ITER
    try:
        return get_iter(frame, lst)
    finally:
        frame.ip -= 1


def _rollable(frame, lst: ListV) -> bool:
    tracer = frame.tracer
    site = loop_site(frame)
    if site is None or frame.code.co_name.startswith("<") \
            or tracer.merging or tracer.template is not None:
        return False
    if lst.source not in tracer.assumptions.varied_lists:
        return False  # one length so far: unrolled, as a ``range()`` over a fixed number is
    if site in tracer.assumptions.unrolled_loops or ("rolled_loop", *site) in tracer.unstable_sites \
            or any(s == lst.source for s, _, _ in tracer.assumptions.rolled_lists):
        return False
    items = lst.items
    if len(items) < 2 or not all(_fresh(v, ItemSource(lst.source, k)) for k, v in enumerate(items)):
        return False  # too short to compare two iterations, or an item read another way too
    return uniform([v.concrete() for v in items]) or rolled_objects.plain_objects(
        [v.concrete() for v in items])


def _fresh(v: Value, source, part: bool = False) -> bool:
    """A tensor read only as this item of the list (or a tuple of such tensors)."""
    if isinstance(v, TupleV) and v.cls is tuple and v.items:
        return all(_fresh(t, ItemSource(source, j), True) for j, t in enumerate(v.items))
    if part and isinstance(v, (ConstV, SymV)) and type(v.value) in NUMBERS:
        return True  # a number of a tuple: guarded by its type over the whole list
    if isinstance(v, ObjV):
        return v.source == source  # an object, read only as this item (its reads are guarded later)
    return isinstance(v, TensorV) and not v.dynamic and v.real is not None and v.source == source


def item(loop, index: Value, lst=None) -> Value:
    """``xs[index]`` of the list a rolled loop iterates (or of ``lst``, one it zips): its value
    in that iteration (a tensor, or a tuple of tensors)."""
    lst = lst if lst is not None else loop.items
    at = index.node if isinstance(index, SymV) else index.value
    node = loop.graph.call_function(operator.getitem, (lst.node, at))
    if isinstance(lst, rolled_objects.ObjectListV):
        return rolled_objects.RowV(lst, node, index.value, loop)
    example = lst.examples[index.value]
    if type(example) is not tuple:
        node.meta["example"] = example
        return TensorV(node, example)
    parts = []
    for j, t in enumerate(example):
        part = loop.graph.call_function(operator.getitem, (node, j))
        part.meta["example"] = t
        # a number differs per item: a run-time value (a branch on it refuses the roll)
        parts.append(TensorV(part, t) if isinstance(t, torch.Tensor) else
                     ItemNumberV(t, part, None, loop.tracer, f"{lst.source}[k][{j}]", part=(lst, j)))
    return TupleV(parts)


def part_of(loop, index: Value, part: tuple) -> Value:
    """``xs[index][j]`` or ``xs[index].name`` (``part``: the list and ``j`` or ``name``)."""
    lst, key = part
    value = item(loop, index, lst)
    return value.items[key] if isinstance(key, int) else rolled_objects.attr(loop.tracer, value, key)


def row(loop, index: Value) -> Value:
    """What ``for`` hands out in the iteration of ``index``: ``xs[index]``, or the tuple of
    every zipped list's item."""
    if not loop.zipped:
        return item(loop, index)
    return TupleV([item(loop, index, lst) for lst in loop.zipped])


def refused(error: Exception, rolled: frozenset) -> dict:
    """(source, site, where) of the lists passed whole -> why to pass them item by item again
    after ``error`` (every one: what failed may be any use of them)."""
    if isinstance(error, RollRefused):  # the loop over it, or another loop (kept as it is)
        return {entry: error.why for entry in rolled if entry[1] == error.site}
    why = getattr(error, "explanation", None) or f"{type(error).__name__}: {error}"
    return {entry: f"capture failed with {entry[0]} passed whole ({why})" for entry in rolled}
