"""Both directions of a branch on a tensor value, kept in one graph.

A branch on a tensor value is first speculated (``Tracer.assume_truth``). Once it has gone
both ways, the frame no longer speculates on it; instead, when the branch is a plain
``if``/``else`` (or ``a if c else b``) whose two sides are free of side effects, both sides
are executed symbolically and every value they leave behind is merged with
``torch.where(predicate, then_value, else_value)``: the graph computes both and selects, so
neither direction makes the call fall back. Two sides that both ``return`` are merged the
same way (their return values). Anything else (one side returning and not the other, a side
that jumps out, writes to the heap, draws random numbers, writes in place, speculates again, or produces
values that cannot be selected between) keeps today's behaviour: the call runs eagerly
with ``data_dependent_branch``.

A select is a new tensor where eager hands out one side's tensor itself (``x = x / 10 if c
else x`` gives back the argument ``x``): ``merge_aliases`` records which tensors each merged
result may be in eager and refuses the capture at its end if the difference can be seen.

Gradients are kept out of it: a value that requires grad refuses the merge, because the
derivative of the side not taken (``sqrt`` of a negative number, say) could turn the
selected gradient into NaN, which eager never computes.
"""
from __future__ import annotations

import dis

import torch

from ...records import Unsupported
from ...fx_lower.randomness import is_random_node
from .._torch_dispatch import storage_key
from ..values.deque import DequeV
from .raising_branch import raising_nodes
from ..values.symint import SymV
from ..values import (CellV, ConstV, DictV, DictViewV, FuncV, IterV, ListV, MethodV, NewObjV, PartialV, SetV,
                     TensorV, TupleV, Value)

SIDE_META = "merged_branch"  # node.meta: (file, line, function) of the merged branch


class _NoMerge(Exception):
    pass


def join_point(frame, ins) -> tuple[int, int] | None:
    """(index of the first instruction of the fall-through side, index of the join) for a
    forward conditional jump; None when a jump in between leaves the region backwards.

    The join is the first index at or after the jump's target that no jump from the region
    before it passes: every path from either side either returns or reaches it. For an
    ``if``/``else`` that is where the then-side's ``JUMP_FORWARD`` lands; for the chains of
    conditional jumps that ``if a and b:`` / ``if a or b:`` compile to, it is the end of
    the whole statement (the inner jumps are merged in turn while a side runs)."""
    info = frame.info
    start = frame.ip  # the instruction after the conditional jump
    join = info.index_of[ins.argval]
    if join <= start:
        return None
    i = start
    while i < join:
        inner = info.instructions[i]
        if inner.opcode in dis.hasjrel or inner.opcode in dis.hasjabs:
            to = info.index_of[inner.argval]
            if to < start:
                return None
            join = max(join, to)
        i += 1
    return start, join


ITEM_TEST = "item_test"  # node meta of a predicate made from a test on a `.item()` value
WHAT_META = "merged_what"  # node meta of a side's node: what its branch tests


def merge(frame, ins, predicate: TensorV, jump_if: bool) -> int:
    """Run both sides of the branch at ``ins`` and merge them; return the index to resume
    at (the join). Raises ``Unsupported`` when the branch cannot be merged."""
    what = "test on a `.item()` value" if predicate.node.meta.get(ITEM_TEST) else \
        "branch on a tensor value"  # (item_args.speculated made the predicate)
    shape = join_point(frame, ins)
    if shape is None:
        raise refuse("it is not a plain if/else", frame.tracer.user_position(), what)
    fall_through, join = shape
    target = frame.info.index_of[ins.argval]
    # the side taken when the jump does NOT happen starts right after it
    taken_when_true = target if jump_if else fall_through
    taken_when_false = fall_through if jump_if else target
    tracer = frame.tracer
    at = tracer.user_position()  # a refusal points at the branch, not into a side
    before = _Mark(tracer)
    tracer.merged_aliases.begin(tracer)
    saved_locals, saved_stack = dict(frame.locals), list(frame.stack)
    tracer.merging += 1  # a tensor branch inside a side is merged too, never speculated
    try:
        # the fall-through side first: if it returns, the other side must return too
        first, second = sorted((taken_when_true, taken_when_false), key=lambda i: i != fall_through)
        sides = {}
        sides[first] = _run_side(frame, first, join, saved_locals, saved_stack)
        returned = sides[first][0]
        sides[second] = _run_side(frame, second, None if returned else join, saved_locals,
                                  saved_stack)
        if sides[second][0] != returned:
            raise _NoMerge("one side returns and the other does not")
        before.check(tracer)
        before.tag_sides(tracer, at, what)
        tracer.merged_aliases.what[at] = what  # (a refusal at the capture's end names it)
        _, true_locals, true_stack, true_result = sides[taken_when_true]
        _, false_locals, false_stack, false_result = sides[taken_when_false]
        cond = tracer.call_op("call_method", "bool", [predicate], {}, name="bool")
        select = lambda a, b: _select(tracer, cond, a, b, at)  # noqa: E731
        if returned:
            frame.locals, frame.stack = saved_locals, saved_stack
            frame.result = select(true_result, false_result)
            return join
        frame.locals = {}
        for name in set(true_locals) | set(false_locals):
            if name not in true_locals or name not in false_locals:
                raise _NoMerge(f"`{name}` is assigned on one side only")
            frame.locals[name] = select(true_locals[name], false_locals[name])
        if len(true_stack) != len(false_stack):
            raise _NoMerge("the two sides leave different stacks")
        frame.stack = [select(a, b) for a, b in zip(true_stack, false_stack)]
    except _NoMerge as e:
        frame.locals, frame.stack, frame.result = saved_locals, saved_stack, None
        raise refuse(str(e), at, what) from None
    except Unsupported as e:
        frame.locals, frame.stack, frame.result = saved_locals, saved_stack, None
        raise refuse(f"a side cannot be captured ({e.explanation})", at, what) from None
    finally:
        tracer.merging -= 1
    return join


def refuse(why: str, at: tuple, what: str = "branch on a tensor value") -> Unsupported:
    error = Unsupported("data_dependent_branch", f"both directions of this {what} have been "
                        f"seen, and the two sides cannot be merged into one graph ({why}); it "
                        "is no longer speculated")
    error.filename, error.lineno, error.function = at
    return error


def _run_side(frame, start: int, join: int | None, locals_: dict, stack: list):
    """(returned?, locals, stack, returned value) after running one side from ``start``."""
    frame.locals, frame.stack, frame.result = dict(locals_), list(stack), None
    before = _Snapshot(frame.tracer)
    frame.ip = start
    returned = frame.run_span(join)
    before.check()
    result, frame.result = frame.result, None
    return returned, frame.locals, frame.stack, result


class _Snapshot:
    """What a side may not change in place: the items of every list, tuple, dict and set, the
    attributes of objects made in the call, closure cells, iterator positions and generator
    output reachable from the frames being executed (the heap log covers what outlives
    the call). Both sides start from the same values, so such a change would leak into the
    other side."""

    def __init__(self, tracer):
        self.frames = [(f, len(f.yielded)) for f in tracer.frames]
        self.state: dict = {}
        pending = [v for f in tracer.frames
                   for v in (*f.locals.values(), *f.stack, *f.cells.values())]
        while pending:
            v = pending.pop()
            if id(v) in self.state:
                continue
            state, children = _state_of(v)
            if state is not None:
                self.state[id(v)] = (v, state)
                pending += children

    def check(self) -> None:
        if any(len(f.yielded) != n for f, n in self.frames):
            raise _NoMerge("a side yields")
        for v, state in self.state.values():
            if _state_of(v)[0] != state:
                raise _NoMerge("a side changes a list, dict, object, cell or iterator that "
                               "existed before the branch")


def _state_of(v: Value) -> tuple:
    """(comparable state, values inside) of a value that can change in place; (None, [])
    for anything else."""
    if isinstance(v, (ListV, TupleV)):
        return ("seq", tuple(map(id, v.items))), list(v.items)
    if isinstance(v, DictV):
        return ("dict", tuple(v.items), tuple(map(id, v.items.values()))), list(v.items.values())
    if isinstance(v, NewObjV):
        return ("obj", tuple(v.attrs), tuple(map(id, v.attrs.values()))), list(v.attrs.values())
    if isinstance(v, SetV):
        return ("set", frozenset(v.items)), []
    if isinstance(v, DictViewV):  # reads its dict: a change to the dict must be seen
        return ("view",), [v.mapping]
    if isinstance(v, CellV):
        return ("cell", id(v.contents)), [] if v.contents is None else [v.contents]
    if isinstance(v, IterV):
        return ("iter", v.pos, tuple(map(id, v.items))), list(v.items)
    if isinstance(v, PartialV):
        return ("partial",), [v.func, *v.args, *v.kwargs.values()]
    if isinstance(v, FuncV):
        return ("func",), list(v.closure)
    if isinstance(v, MethodV):
        return ("method",), [v.self_value] + ([] if v.func is None else [v.func])
    return None, []


class _Mark:
    """What may not change while the two sides run: the heap log, the assumptions; and what
    the new graph nodes may not do (write in place, draw random numbers)."""

    def __init__(self, tracer):
        self.heap = len(tracer.heap)
        self.assertions = len(tracer.assertions)
        self.last_node = list(tracer.graph.nodes)[-1] if len(tracer.graph.nodes) else None

    def new_nodes(self, tracer) -> list:
        nodes = list(tracer.graph.nodes)
        return nodes[nodes.index(self.last_node) + 1:] if self.last_node is not None else nodes

    def tag_sides(self, tracer, at: tuple, what: str) -> None:
        """Mark the nodes both sides added: the graph runs them whichever side is taken,
        so one of them raising says nothing about a bug (see ``side_not_taken``). An inner
        merged branch keeps its own (more precise) mark."""
        for node in self.new_nodes(tracer):
            if SIDE_META not in node.meta:
                node.meta[SIDE_META], node.meta[WHAT_META] = at, what

    def check(self, tracer) -> None:
        if len(tracer.heap) != self.heap:
            raise _NoMerge("a side writes state that outlives the call")
        if len(tracer.assertions) != self.assertions:
            raise _NoMerge("a side speculates on another tensor value")
        for node in self.new_nodes(tracer):
            if node.meta.get("mutates"):
                raise _NoMerge("a side writes into a tensor in place")
            if is_random_node(node):
                raise _NoMerge("a side draws random numbers")


def _outlives(tracer, t: TensorV) -> bool:
    return t.source is not None or t.updated or (
        t.example.numel() > 0 and storage_key(t.example) in tracer._external)


def _select(tracer, cond: TensorV, a: Value, b: Value, at: tuple) -> Value:
    if a is b:
        return a
    if isinstance(a, TensorV) and isinstance(b, TensorV):
        ea, eb = a.example, b.example
        if (ea.shape, ea.dtype, ea.device) != (eb.shape, eb.dtype, eb.device):
            raise _NoMerge("a value has a different shape, dtype or device on each side")
        if ea.requires_grad or eb.requires_grad:
            raise _NoMerge("a value requires grad (the side not taken could poison gradients)")
        if a.dynamic or b.dynamic:
            raise _NoMerge("a value has a dynamic size")
        result = tracer.call_op("call_function", torch.where, [cond, a, b], {}, name="where")
        er = result.example
        if any(_layout(e) != _layout(er) for e in (ea, eb)):
            raise _NoMerge("a value's layout (strides, offset, tensor type) differs from the "
                           "select's, which code reading it would see")
        tracer.merged_aliases.record(tracer, result, (a, b), _outlives, at)
        return result
    if isinstance(a, ConstV) and isinstance(b, ConstV) and type(a.value) is type(b.value) \
            and a.value == b.value:
        return a
    if type(a) is type(b) and isinstance(a, (TupleV, ListV)) and len(a.items) == len(b.items) \
            and not isinstance(a, DequeV) and a.source is None and b.source is None:
        items = [_select(tracer, cond, x, y, at) for x, y in zip(a.items, b.items)]
        return TupleV(items, a.cls) if isinstance(a, TupleV) else ListV(items)
    if isinstance(a, DictV) and isinstance(b, DictV) and a.source is None and b.source is None \
            and list(a.items) == list(b.items) and a.cls is b.cls and a.factory is b.factory:
        return a.like({k: _select(tracer, cond, a.items[k], b.items[k], at) for k in a.items})
    if isinstance(a, SymV) or isinstance(b, SymV):
        raise _NoMerge("a Python number computed from sizes differs between the sides")
    raise _NoMerge(f"{a!r} and {b!r} cannot be selected between")


def _layout(t: torch.Tensor) -> tuple:
    return type(t), t.stride(), t.storage_offset(), t.is_inference()


def side_not_taken(error: BaseException, graphs: list) -> tuple | None:
    """When a graph raised ``error`` and eager did not: ``(branch position, where the op
    is, what the branch tests)`` if the op that raised belongs to a merged branch's side (the graph computes both
    sides, eager only the one taken: an index out of range or an integer division by zero on
    the other side is no bug of ours), else None."""
    for node in raising_nodes(error, graphs):
        if SIDE_META in node.meta:
            return node.meta[SIDE_META], node.meta.get("where", ""), \
                node.meta.get(WHAT_META, "branch on a tensor value")
    return None
