"""What a rolled loop's iteration 1 found in the frame and what it left there, compared.

``loops.py`` takes a ``Snapshot`` at the loop's head and after iteration 1; ``Match``
pairs the two: tensors that changed are loop-carried values, slots that hold the index
are rebound after the loop, lists grown by one tensor are per-iteration outputs. Anything
else that differs refuses the roll (``loop.refuse``), since a later iteration would then
record other nodes than iteration 1 did.
"""
from __future__ import annotations

import collections

from .objects import RowV
from ..values.rolled import ItemNumberV, LoopIndexV, RolledListV
from ..values import kind
from ..values.scalar import ScalarV
from ..values.symint import SymV
from ..values import (CellV, ConstV, DictV, FuncV, IterV, ListV, MethodV, NewObjV, NullV, ObjV, TensorV,
                     TupleV)

CONTAINERS = (TupleV, ListV, DictV, NewObjV, CellV)
_PLAIN_LEAVES = (ObjV, FuncV, MethodV, ConstV, SymV, NullV, TensorV, RolledListV, ScalarV)

class append_only:
    """While iteration 1 runs, the lists that grew by one in iteration 0 can only be appended
    to: reading one (its length, its last item) would bake one iteration's value in the body."""

    def __init__(self, lists: dict, loop):
        self.lists, self.loop = lists, loop

    def __enter__(self):
        for lst in self.lists.values():
            lst.items = _AppendOnlyItems(lst.items, self.loop)

    def __exit__(self, *exc):
        for lst in self.lists.values():
            lst.items = list(lst.items.unlocked())


class _AppendOnlyItems(list):
    def __init__(self, items, loop):
        super().__init__(items)
        self.loop = loop

    def unlocked(self):
        return [list.__getitem__(self, i) for i in range(list.__len__(self))]

    def _read(self, *args, **kwargs):
        self.loop.refuse("its body reads a list it appends to")

    def extend(self, items) -> None:  # ``outputs += [y]`` appends (the match checks one per iteration)
        for item in list(items):
            self.append(item)

    __getitem__ = __len__ = __iter__ = __contains__ = __setitem__ = __delitem__ = _read
    pop = insert = remove = index = count = __reversed__ = _read


# ---- what the frame holds at the loop's head -----------------------------------------------
class Snapshot:
    """The contents of every container reachable from the frames and the shadow heap's
    overlays, copied (containers are mutated in place, so a later look sees other items)."""

    def __init__(self, frame, tracer):
        self.frame = frame
        self.locals = dict(frame.locals)
        self.stack = list(frame.stack)
        self.cells = dict(frame.cells)
        self.contents: dict[int, tuple] = {}
        # what the iterators of enclosing loops have handed out so far
        self.iterators = {id(v): (v.pos, len(v.items), v.source) for v in self.stack
                          if isinstance(v, IterV)}
        roots = [*self.locals.values(), *self.stack, *self.cells.values(),
                 *tracer.heap.overlay_values(), *tracer._by_container_id.values()]
        for other in tracer.frames:
            roots += [*other.locals.values(), *other.stack, *other.cells.values()]
        for v in roots:
            self._walk(v)

    def _walk(self, v) -> None:
        pending = [v]
        while pending:
            v = pending.pop()
            if not isinstance(v, CONTAINERS) or id(v) in self.contents:
                continue
            items = _items(v)
            self.contents[id(v)] = (v, items)
            pending += list(items.values()) if isinstance(items, dict) else list(items)

    def grown_lists(self, before: "Snapshot") -> dict:
        """Lists that an iteration appended exactly one item to."""
        grown = {}
        for key, (v, items) in self.contents.items():
            old = before.contents.get(key)
            if isinstance(v, ListV) and old is not None and old[0] is v \
                    and len(items) == len(old[1]) + 1 and all(a is b for a, b in zip(items, old[1])):
                grown[key] = v
        return grown

    def hidden_unchanged(self, head: "Snapshot", visited: set, loop) -> None:
        """Containers the loop's variables do not reach must not change in an iteration."""
        for key, (v, items) in head.contents.items():
            if key in visited:
                continue
            now = self.contents.get(key)
            if now is None or not _same_items(items, now[1]):
                loop.refuse(f"its body changes a {type(v).__name__} the loop's variables do not "
                            "hold")


def _items(v):
    if isinstance(getattr(v, "items", None), _AppendOnlyItems):
        return v.items.unlocked()  # an enclosing loop's list: looking is not reading it
    if isinstance(v, (TupleV, ListV)):
        return list(v.items)
    if isinstance(v, DictV):
        return dict(v.items)
    if isinstance(v, NewObjV):
        return dict(v.attrs)
    return {"contents": v.contents}


def _same_items(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def set_slot(holder, key, value) -> None:
    if isinstance(holder, (TupleV, ListV, DictV)):
        holder.items[key] = value
    elif isinstance(holder, NewObjV):
        holder.attrs[key] = value
    elif isinstance(holder, CellV):
        holder.contents = value
    else:  # the frame's locals (a dict) or stack (a list)
        holder[key] = value


class Match:
    """Pairs what iteration 1 found (``head``) with what it left (``after``): the carried
    tensors, the slots holding the index, the lists it appended to. Refuses anything else
    that differs."""

    def __init__(self, head: Snapshot, after: Snapshot, index: LoopIndexV, growing: dict,
                 loop):
        self.head, self.after, self.index, self.growing, self.loop = head, after, index, growing, loop
        self.carried: dict = {}          # (id(h), id(a)) -> [h, a, slots]
        self.index_slots: list = []
        self.row_slots: list = []        # (slot, (list, None / j / name)): the item's
        self.appends: list = []          # (list, items before iteration 1, appended tensor)
        self.visited: set = set()        # ids of containers compared
        self._pairs: set = set()

    def frame_state(self, frame) -> None:
        h, a = self.head, self.after
        if h.locals.keys() != a.locals.keys() or len(h.stack) != len(a.stack) \
                or h.cells.keys() != a.cells.keys():
            self.loop.refuse("an iteration binds other variables than the one before")
        for name in h.locals:
            self.value(h.locals[name], a.locals[name], (frame.locals, name), name)
        for i, (x, y) in enumerate(zip(h.stack[:-1], a.stack[:-1])):
            self.value(x, y, (frame.stack, i), f"stack[{i}]")
        for name in h.cells:
            self.value(h.cells[name], a.cells[name], (frame.cells, name), name)
        self._check_aliasing()

    def value(self, h, a, slot: tuple, path: str) -> None:
        if isinstance(h, CONTAINERS) and type(h) is type(a):
            return self._container(h, a, path)
        if self.loop.is_next(h, a, self.index):
            self.index_slots.append(slot)  # a while loop's counter: rebound after the loop
        elif a is self.index:
            if not self.loop.is_first(h):
                self.loop.refuse(f"`{path}` holds the index only from the second iteration on")
            self.index_slots.append(slot)
        elif isinstance(h, RowV) and isinstance(a, RowV) and h.of is a.of \
                and (h.at, a.at) == (0, 1):
            self.row_slots.append((slot, (a.of, None)))  # an item of a list of objects
        elif isinstance(h, ItemNumberV) and isinstance(a, ItemNumberV) and h.part == a.part:
            self.row_slots.append((slot, a.part))  # a number of the item: the last one's after
        elif isinstance(h, TensorV) and isinstance(a, TensorV):
            if h is not a:
                self._tensor(h, a, slot, path)
        elif isinstance(h, ConstV) and isinstance(a, ConstV):
            if type(h.value) is not type(a.value) or not _equal(h.value, a.value):
                self.loop.refuse(f"`{path}` is a Python value that changes per iteration")
        elif h is a and isinstance(a, IterV) and self.head.iterators.get(id(a)) == \
                self.after.iterators.get(id(a)):
            return  # an enclosing loop's iterator, which the iteration did not pull from
        elif isinstance(h, SymV) and isinstance(a, SymV) and h.expr is not None \
                and h.expr == a.expr:
            set_slot(*slot, h)  # the same number in every iteration (an inner loop's last index)
        elif h is not a or not isinstance(a, _PLAIN_LEAVES):
            self.loop.refuse(f"`{path}` changes per iteration ({kind(h)} -> {kind(a)}) in a "
                             "way the rolled loop cannot carry")

    def _container(self, h, a, path: str) -> None:
        if (id(h), id(a)) in self._pairs:
            return
        self._pairs.add((id(h), id(a)))
        self.visited.add(id(h))
        self.visited.add(id(a))
        hi, ai = self.head.contents[id(h)][1], self.after.contents[id(a)][1]
        if h is a and id(a) in self.growing:
            if len(ai) != len(hi) + 1 or not all(x is y for x, y in zip(hi, ai)):
                self.loop.refuse(f"`{path}` does not grow by one item per iteration")
            if not isinstance(ai[-1], TensorV):
                self.loop.refuse(f"`{path}` is appended {kind(ai[-1])}, not a tensor")
            self.appends.append((a, hi, ai[-1]))
            return
        if getattr(h, "cls", None) is not getattr(a, "cls", None) or (
                isinstance(hi, dict) and hi.keys() != ai.keys()) or len(hi) != len(ai):
            self.loop.refuse(f"`{path}` changes its structure per iteration")
        keys = hi.keys() if isinstance(hi, dict) else range(len(hi))
        for k in keys:
            self.value(hi[k], ai[k], (a, k), f"{path}[{k!r}]")

    def _tensor(self, h: TensorV, a: TensorV, slot: tuple, path: str) -> None:
        eh, ea = h.example, a.example
        if (eh.shape, eh.dtype, eh.device, eh.layout, eh.requires_grad) != \
                (ea.shape, ea.dtype, ea.device, ea.layout, ea.requires_grad):
            self.loop.refuse(f"`{path}` changes shape, dtype or requires_grad per iteration")
        entry = self.carried.setdefault((id(h), id(a)), [h, a, []])
        entry[2].append(slot)

    def _check_aliasing(self) -> None:
        heads = collections.Counter(id(h) for h, _, _ in self.carried.values())
        afters = collections.Counter(id(a) for _, a, _ in self.carried.values())
        if any(c > 1 for c in heads.values()) or any(c > 1 for c in afters.values()):
            self.loop.refuse("which loop variables hold the same tensor changes per iteration")


def _equal(x, y) -> bool:
    try:
        return bool(x == y)
    except Exception:
        return False
