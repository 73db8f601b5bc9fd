"""``.item()`` values passed to a torch op: ``advantage = R - value.item()``.

Eager hands the op a Python number, the very ``float``/``int``/``bool`` that ``.item()``
returned. The graph does the same: a ``t.item()`` node, placed where ``.item()`` was called
(so it reads the tensor as it was then), feeds the op, and the op receives the same Python
number, converted and promoted by torch exactly as in eager (bit-identical by construction,
no type-promotion reasoning needed). A recipe over such values (``R - 0.5 * v.item()``,
``deferred.py``) becomes the same Python operators on those numbers inside the graph,
applied in the order eager applies them.

Only ops in which the number is a *value* (arithmetic, comparisons, ``where``, ``clamp``,
``fill``...) take it: there the number cannot change a result's shape, dtype or anything
capture decided from it. Elsewhere (a size, a dim, an index, ``range``, a branch) it falls
back as before (``data_dependent_value``). A graph that reads ``.item()`` runs only as the
FX graph's own Python code (compiling backends refuse it, see ``fx_lower/backends.py``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ...records import Unsupported
from ..values import ConstV, Value
from ..values.scalar import ScalarV
from ..values.symint import SymV
from . import branch_merge, exit_tests, raising_branch
from .deferred import ClockV, NumV
from ...guards import ValueGuard
from ..values import ListV, ObjV, SetV, TupleV

# Operators and torch functions/methods (by name) whose number arguments are plain values.
_OPERATORS = frozenset((operator.add, operator.sub, operator.mul, operator.truediv,
                        operator.floordiv, operator.mod, operator.pow, operator.iadd,
                        operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                        operator.imod, operator.ipow, operator.eq, operator.ne, operator.lt,
                        operator.le, operator.gt, operator.ge))
_ELEMENTWISE = frozenset((
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "floor_divide",
    "remainder", "fmod", "pow", "float_power", "rsub", "eq", "ne", "lt", "le", "gt", "ge",
    "where", "clamp", "clip", "clamp_min", "clamp_max", "lerp", "masked_fill", "full_like",
    "fill", "add_", "sub_", "mul_", "div_", "pow_", "clamp_", "clamp_min_", "clamp_max_",
    "fill_", "masked_fill_", "lerp_",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__pow__", "__rpow__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__"))
# ``torch.tensor(data)``: numbers nested in lists and tuples (their structure decides the shape,
# their Python types the dtype: both fixed for ``.item()`` values of guarded dtypes).
_DATA = frozenset(("tensor", "as_tensor", "scalar_tensor"))
# ``torch.full(size, v)``: the fill value only (the size decides the shape); ``F.batch_norm``'s
# momentum (BatchNorm's ``1.0 / float(num_batches_tracked)``), which only weighs the update.
_FILL_POSITION = {"full": (1, "fill_value"), "new_full": (2, "fill_value"),
                  "batch_norm": (6, "momentum")}


@dataclass(eq=False, repr=False)
class ItemNumV(Value):
    """A Python number the graph computes from ``.item()`` values: the op's argument is
    ``node``; ``value`` is its value at capture (what the op ran with)."""

    node: torch.fx.Node
    value: Any

    def concrete(self):
        return self.value

    def __repr__(self):
        return f"ItemNumV({self.value!r})"


def substitute(tracer, target, label: str, args: list, kwargs: dict) -> tuple[list, dict]:
    """``args``/``kwargs`` with each ``.item()`` value (or recipe) the op takes as a value
    replaced by its graph number; anything else is left for ``_concrete`` to refuse."""
    if label in _DATA and args:  # ``torch.tensor([v])``: the numbers in the data
        return [_data(tracer, args[0]), *args[1:]], kwargs
    if not any(isinstance(a, ScalarV) for a in [*args, *kwargs.values()]):
        return args, kwargs
    allowed = _allowed_positions(target, label, len(args))
    args = [_number(tracer, a) if i in allowed and isinstance(a, ScalarV) else a
            for i, a in enumerate(args)]
    kwargs = {k: _number(tracer, v) if k in allowed and isinstance(v, ScalarV) else v
              for k, v in kwargs.items()}
    return args, kwargs


def _allowed_positions(target, label: str, count: int) -> set:
    if target in _OPERATORS or label in _ELEMENTWISE:
        return set(range(count)) | {"other", "alpha", "value", "min", "max", "exponent",
                                    "weight", "input", "self", "scalar"}
    if label in _FILL_POSITION:
        return set(_FILL_POSITION[label])
    return set()


def _data(tracer, v: Value) -> Value:
    if isinstance(v, ScalarV):
        return _number(tracer, v)
    if type(v) is ListV or type(v) is TupleV and v.cls is tuple:
        items = [_data(tracer, i) for i in v.items]
        if any(new is not old for new, old in zip(items, v.items)):
            return type(v)(items)  # a copy for this op only: the list itself is unchanged
    return v


def _number(tracer, v) -> Value:
    """The graph number for a ``.item()`` value or a recipe over them; ``v`` itself (refused
    later, with its own reason) when it cannot be computed in the graph."""
    cached = getattr(v, "_in_graph", None)
    if cached is not None:
        return cached
    if isinstance(v, ClockV) or isinstance(v, NumV) and v.type is None:
        return v  # a clock is read outside the graph; an unstable type would change the op
    if isinstance(v, NumV):
        parts = [_number(tracer, a) if isinstance(a, ScalarV) else a for a in v.args]
        if not all(isinstance(p, (ItemNumV, SymV, ConstV)) for p in parts):
            return v
        node = tracer.graph.call_function(v.fn, tuple(_node(p) for p in parts))
    else:
        node = _read(tracer, v)
    node.meta.update(example=v.value, where=tracer.where(), mutates=False, writes=frozenset())
    v._in_graph = ItemNumV(node, v.value)
    return v._in_graph


def _node(v: Value):
    return v.value if isinstance(v, ConstV) else v.node


def _read(tracer, v) -> torch.fx.Node:
    """``t.item()`` as a graph node right where ``.item()`` was called: later in-place writes
    into ``t`` (graph nodes after that point) do not change what it reads."""
    at = v.read_after
    while at.next.op == "placeholder":  # inputs found later are placed after placeholders
        at = at.next
    with tracer.graph.inserting_after(at):
        return tracer.graph.call_method("item", (v.node,))


def _plain(value) -> bool:
    """A number, or a tuple/frozenset of numbers (``t.item() in (1, 2)``)."""
    if type(value) in (tuple, frozenset):
        return all(type(v) in (int, float, bool) for v in value)
    return type(value) in (int, float, bool)


def not_contains(container, item) -> bool:
    """``item not in container`` (a graph node's target: ``t.item() not in (1, 2)``)."""
    return item not in container


def members(tracer, container: Value) -> ConstV | None:
    """A container of plain numbers (a constant tuple or frozenset; a list or tuple of the
    program's whose items capture holds as constants, guarded as any read of them is; a set
    built in the call; a set or frozenset of the program's, guarded equal to what it is now)
    as a constant tuple, which an ``in`` test of a ``.item()`` value is speculated against
    (for numbers, membership in each is the same test: identity, then ``==``; equal sets
    answer it alike); None otherwise."""
    obj = getattr(container, "obj", None)
    if isinstance(container, ObjV) and type(obj) in (set, frozenset) and container.source is not None:
        if not obj or not _plain(tuple(obj)) or any(v != v for v in obj):
            return None  # (a NaN member: the set never equals itself, its guard would always fail)
        tracer.add_guard(ValueGuard, container.source, type(obj)(obj))
        return ConstV(tuple(obj))
    if isinstance(container, ConstV):
        return container if _plain(container.value) else None
    if isinstance(container, (ListV, TupleV)) and type(container) in (ListV, TupleV):
        if all(isinstance(i, ConstV) for i in container.items):
            values = tuple(i.value for i in container.items)
            return ConstV(values) if _plain(values) else None
    if isinstance(container, SetV) and _plain(tuple(container.items)):
        return ConstV(tuple(container.items))
    return None


def speculated(tracer, op, operands: list, mergeable: bool = False, at_jump: bool = False):
    """``t.item() == EOS``, ``loss.item() > limit``, ``if t.item():``, ``flag.item() is True``,
    ``t.item() in (1, 2)`` (``op`` a comparison, ``operator.truth``, ``operator.is_`` or
    ``operator.contains``, the container first): the outcome it has now, assumed like a branch on a tensor value.
    The graph computes the same Python operator on the same ``.item()`` numbers (exact by
    construction) and the entry checks it before committing anything: a call where it goes
    the other way runs the original, and the site is no longer speculated (later captures
    fall back there, ``data_dependent_value``, as before). None where it is not speculated
    (the caller raises its usual fallback): operands that are not numbers, inside a
    recursion template, or inside a merged branch's side unless it decides a branch there
    (merged too, as a tensor branch there is). In a rolled loop's body it is checked in every
    iteration, like a tensor branch there (``rolled/loops.py``). ``mergeable`` (a
    comparison, or ``at_jump``: the truth test a jump makes itself): once the site has gone
    both ways, a test deciding the forward jump right after it (or being it) is a 0-d bool
    tensor of its in-graph outcome instead, and that jump a tensor
    branch seen both ways: both sides are captured and selected with ``torch.where`` where
    they allow it (``branch_merge.py``), refused with its reason where not."""
    if not any(isinstance(v, ScalarV) for v in operands) or tracer.template is not None:
        return None
    frame = tracer.frames[-1]
    jump = frame.ip - 1 if at_jump else frame.ip  # (``at_jump``: the test is the jump's own)
    if tracer.merging and not (mergeable and _forward_jump(frame, jump)):
        return None  # (in a merged side: a test deciding a branch there is merged too)
    parts = [_number(tracer, v) if isinstance(v, ScalarV) else v for v in operands]
    if not all(isinstance(p, (ItemNumV, SymV)) or isinstance(p, ConstV) and _plain(p.value)
               for p in parts):
        return None
    site = (id(frame.code), frame.ip, "item")
    exit_ = exit_tests.is_exit(tracer, frame, jump)  # a rolled loop's ``if ...: break``
    both_ways = not exit_ and (tracer.merging or site in tracer.unstable_sites
                               and not raising_branch.validates(frame))
    if both_ways and not (mergeable and _forward_jump(frame, jump)):
        raise Unsupported("data_dependent_value", "this test of a `.item()` value has gone both "
                          "ways (its assumption failed); it is no longer speculated",
                          "Expected for tests that really flip (an early `break` on a predicted "
                          "token): that path runs eagerly. Keep the test in tensors "
                          "(`torch.where`) to stay in one graph.")
    try:
        outcome = op(*[p.value for p in parts])
    except Exception:  # (``c.item() < 1`` of a complex number: eager's TypeError, not assumed)
        return None
    if exit_:
        outcome = exit_tests.no_break(frame, jump)
    node = tracer.graph.call_function(op, tuple(_node(p) for p in parts))
    node.meta.update(example=outcome, where=tracer.where(), mutates=False, writes=frozenset())
    if both_ways:  # the jump after it: a tensor branch seen both ways (branch_merge.py)
        tracer.unstable_sites.add((id(frame.code), jump + 1))
        predicate = tracer.call_op("call_function", torch.tensor, [ItemNumV(node, outcome)],
                                   {"dtype": ConstV(torch.bool)})
        predicate.node.meta[branch_merge.ITEM_TEST] = True
        return predicate
    tracer.assertions.append((node, outcome, tracer.where(), site))
    if exit_:
        exit_tests.record(tracer, jump, tracer.assertions[-1])
    return outcome


def _forward_jump(frame, index: int) -> bool:
    """Whether instruction ``index`` is a forward conditional jump (on the test's outcome)."""
    ins = raising_branch.conditional_jump(frame.info, index)
    return ins is not None and ins.opname.startswith("POP_JUMP_FORWARD")
