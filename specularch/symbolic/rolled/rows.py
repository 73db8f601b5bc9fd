"""Rolled ``for row in x`` / ``for x_t in x.unbind(d)`` loops over a dimension of a tensor that
varies between calls: captured once, whatever its size.

Python iterates a tensor by its first dimension (``x[0]``, ``x[1]``, ...), ``unbind(d)`` by
dimension ``d``. Unrolled, the loop guards that size: one graph per length, then
``cache_limit``, on the commonest way to write a recurrence over a sequence (``for x_t in
inputs: h = cell(x_t, h)``). Where the size is a symbolic number (the dimension was made
dynamic) and ``FOR_ITER`` comes right after, the loop rolls as ``for t in range(x.size(d)):
row = parts[t]`` with ``parts = x.unbind(d)`` does (``loops.py``): the iterator is a
``RowsIterV``; ``_Loop`` unbinds the tensor once before the loop, as eager's iterator does
(autograd's rules for ``unbind``'s views, ``UnbindBackward``), and hands out its item
``index``. Only the user's own ``unbind`` call rolls this way, not the one a builtin
iterating the tensor makes (``zip(x, y)``, ``reversed(x)``: ``Tracer.call_op(by_user=)``).

A loop over a dimension of static size is unrolled as before (one graph: the size cannot
vary), and so is an ``unbind`` whose parts are used other than by the loop.
"""
from __future__ import annotations

from .exits import exit_jump
from .lists import consumed_by_a_loop, consumed_by_enumerate, loop_site
from .loops import LoopReport, _why_not_roll, rows_form
from ..values.rolled import RowsIterV
from ..values.symint import SymV
from ..values import ConstV, TensorV, Value


def get_iter(frame, iterated: Value):
    """``GET_ITER`` of a tensor consumed right away by ``FOR_ITER`` or a list comprehension:
    the iterator that rolls the loop over its first dimension, or None (unrolled as before)."""
    return _rows(frame, iterated, ConstV(0), frame.ip)


def unbound(tracer, label: str, args: list, kwargs: dict):
    """``x.unbind(d)`` / ``torch.unbind(x, d)``, or ``x.split(1, d)`` / ``torch.split(x, 1, d)``
    (slices of one row: the time-sequence example's ``for input_t in input.split(1, dim=1)``),
    consumed right away by a ``for`` loop: the iterator that rolls it, or None (the parts are
    made as before)."""
    if not tracer.frames:
        return None
    if label == "split":  # (split_size 1 only: then the count of parts is the size)
        if len(args) + len(kwargs) > 3 or set(kwargs) - {"split_size", "split_size_or_sections",
                                                         "dim"}:
            return None
        size = args[1] if len(args) > 1 else kwargs.get("split_size",
                                                         kwargs.get("split_size_or_sections"))
        if not (isinstance(size, ConstV) and type(size.value) is int and size.value == 1):
            return None
        args = [args[0], *args[2:]] if args else args
    elif label != "unbind" or len(args) + len(kwargs) > 2 or set(kwargs) - {"dim"}:
        return None
    frame, skip = consumed_by_a_loop(tracer), 0
    if frame is None:  # ``enumerate(x.unbind(1)[, start])``: its FOR_ITER after enumerate's call
        frame, skip = consumed_by_enumerate(tracer)
        if frame is None:
            return None
    at = frame.ip + skip + 1  # (``_rows`` checks it is the loop's FOR_ITER)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", ConstV(0))
    return _rows(frame, args[0] if args else None, dim, at, split=label == "split")


def enumerate_rows(tracer, args: list, kwargs: dict):
    """``enumerate(x)`` or ``enumerate(x, start)`` (a constant ``start``) of a tensor consumed
    right away by a ``for`` loop: the iterator that rolls it, handing out ``(start + k,
    x[k])``, or None (unrolled as before)."""
    start = kwargs.get("start", args[1] if len(args) == 2 else ConstV(0))
    if not tracer.frames or not 1 <= len(args) <= 2 or set(kwargs) - {"start"} \
            or len(args) + len(kwargs) > 2 or not isinstance(start, ConstV) \
            or type(start.value) is not int:
        return None
    frame = consumed_by_a_loop(tracer)
    if frame is None or frame.info.instructions[frame.ip + 1].opname != "FOR_ITER":
        return None
    if isinstance(args[0], RowsIterV) and not args[0].enumerated:  # of ``x.unbind(d)``
        args[0].enumerated, args[0].count_from = True, start.value
        return args[0]
    return _rows(frame, args[0], ConstV(0), frame.ip + 1, start.value)


def _rows(frame, x, dim: Value, at: int, enumerated_from: int | None = None,
          split: bool = False):
    """The iterator over ``x.unbind(dim)`` for the loop that the instruction at ``at``
    starts (its ``FOR_ITER``, or the call of a list comprehension), or None."""
    code, tracer = frame.info.instructions, frame.tracer
    if not isinstance(x, TensorV) or not isinstance(dim, ConstV) or type(dim.value) is not int \
            or not -x.example.dim() <= dim.value < x.example.dim() or at >= len(code):
        return None
    if code[at].opname == "FOR_ITER":
        site = (id(frame.code), code[at].offset)
        exits = exit_jump(code, at, frame.info.index_of[code[at].argval]) is not None
    else:  # ``[f(row) for row in x]``
        site, exits = loop_site(frame), False
        if site is None:
            return None
    d = dim.value % x.example.dim()
    n = tracer.sym_size(x, d)
    if not isinstance(n, SymV):
        return None  # one size for every call: nothing to roll
    form = rows_form(x, d, enumerated_from is not None, enumerated_from or 0, split)
    why = _why_not_roll(tracer, site, n, exits)
    if why is not None:
        if site not in tracer.assumptions.unrolled_loops:
            tracer.loops.append(LoopReport(f"{frame.code.co_filename}:{frame.lineno}", False, why,
                                           site=site, form=form))
        return None
    return RowsIterV([], n=n, start=ConstV(0), step=1, bounds=(n,), rows_of=x, dim=d,
                     enumerated=enumerated_from is not None, count_from=enumerated_from or 0,
                     split=split)
