"""The deferred writes: one frozen record per kind of write, from capture to commit.

A record is made when capture meets the write (``ShadowHeap.write_attr`` and friends), with
its fields holding the symbolic values involved. When capture ends, ``lower`` returns the
same kind of record with those fields turned into rebuild records (``rebuild.py``): the
values as they are at the end of the call, read from the graph's outputs, from sources or
from constants. The entry renders the lowered records, in program order, as its commit
(``render``); ``lint_writes`` checks them against the graph when capture ends.

What happens to ``self.count += 1``: ``attrs.store_attr`` calls ``heap.write_attr``, which
records ``SetAttr(L['self'], 'count', <value>)`` and shows the new value to later reads in
the call; at the end it is lowered to ``SetAttr(FromSource(L['self']), 'count', Constant(4))``
and the entry runs ``setattr(s0, 'count', 4)`` once every guard and assertion passed.

``lowering`` (``symbolic.capture.SpecBuilder``) gives ``build(value) -> Rebuild``,
``out(node) -> GraphOutput``, ``version_bumps(tensor) -> int | None`` and ``top_globals``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

from ..guards.sources import Source
from .rebuild import CallerGlobals, FromSource, GraphOutput, Pinned, Rebuild, Scratch, malformed


@dataclass(frozen=True, eq=False)
class Write:
    """One deferred write. ``kind`` names it in explanations and aliasing guards."""

    kind: ClassVar[str] = ""

    def lower(self, lowering) -> "Write":
        raise NotImplementedError

    def render(self, r) -> str:
        """The commit statement (``r``: a ``render.Renderer``)."""
        raise NotImplementedError

    def rebuilds(self) -> Iterator[Rebuild]:
        """The rebuild records the commit statement evaluates (after ``lower``)."""
        return iter(())

    def check(self, r, stored: set) -> str | None:
        """The statement that raises ``checks.CommitRefused`` when this write would raise,
        run before the commit's first write; None for a write that cannot raise once the
        guards passed (``checks.py``). ``stored``: ``(target, name)`` of the attributes
        earlier writes of the commit store."""
        return None


def _source_of(value, what: str) -> FromSource:
    source = getattr(value, "source", None)
    if source is None:  # (no repr of value: that would specialise a symbolic number)
        if not False:
            raise malformed(what, f"the target, a {type(value).__name__}, has no source to commit "
                                  "through")
    return FromSource(source)


@dataclass(frozen=True, eq=False)
class SetAttr(Write):
    """``target.name = value`` (target: an object, module or tensor with a source).
    ``before_ops``: made before the call ran any graph op (``release.py``)."""

    kind: ClassVar[str] = "setattr"
    target: Any
    name: str
    value: Any
    where: str = ""
    before_ops: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise malformed("SetAttr", f"attribute name {self.name!r} is not a str")

    def lower(self, lowering):
        return SetAttr(_source_of(self.target, "SetAttr"), self.name, lowering.build(self.value),
                       self.where, self.before_ops)

    def rebuilds(self):
        return iter((self.target, self.value))

    def check(self, r, stored: set) -> str:
        target = r.expr(self.target)
        stored.add((target, self.name))
        return f"CAN_SETATTR({target}, {self.name!r}, {r.bound(self.value)})"

    def render(self, r) -> str:
        return f"setattr({r.expr(self.target)}, {self.name!r}, {r.bound(self.value)})"


@dataclass(frozen=True, eq=False)
class SetGrad(SetAttr):
    """``tensor.grad = value``: torch checks the value (shape, dtype, device, layout) and
    refuses it without writing. The commit assigns every gradient first, as one block that
    puts the old ones back if torch refuses one (``render.grad_commit``), so nothing else
    was written yet."""

    def __post_init__(self):
        if self.name != "grad":
            raise malformed("SetGrad", f"attribute {self.name!r} is not .grad")

    def lower(self, lowering):
        return SetGrad(_source_of(self.target, "SetGrad"), "grad", lowering.build(self.value),
                       self.where, self.before_ops)

    def check(self, r, stored: set) -> None:
        return None  # torch's own check, in render.grad_commit

    def render(self, r) -> str:
        raise TypeError("gradient assignments are rendered together by render.grad_commit")


@dataclass(frozen=True, eq=False)
class DelAttr(Write):
    kind: ClassVar[str] = "delattr"
    target: Any
    name: str
    where: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise malformed("DelAttr", f"attribute name {self.name!r} is not a str")

    def lower(self, lowering):
        return DelAttr(_source_of(self.target, "DelAttr"), self.name, self.where)

    def rebuilds(self):
        return iter((self.target,))

    def check(self, r, stored: set) -> str:
        target = r.expr(self.target)
        set_before = (target, self.name) in stored
        stored.discard((target, self.name))
        return f"CAN_DELATTR({target}, {self.name!r}, {set_before})"

    def render(self, r) -> str:
        return f"delattr({r.expr(self.target)}, {self.name!r})"


@dataclass(frozen=True, eq=False)
class SetGlobal(Write):
    """``globals_dict[name] = value``: the optimized function's globals (``G``) or those
    of a function it called (pinned by the entry)."""

    kind: ClassVar[str] = "global"
    target: Any
    name: str
    value: Any
    where: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise malformed("SetGlobal", f"global name {self.name!r} is not a str")

    def lower(self, lowering):
        target = CallerGlobals() if self.target is lowering.top_globals else Pinned(self.target)
        return SetGlobal(target, self.name, lowering.build(self.value), self.where)

    def rebuilds(self):
        return iter((self.target, self.value))

    def render(self, r) -> str:
        return f"{r.expr(self.target)}[{self.name!r}] = {r.expr(self.value)}"


@dataclass(frozen=True, eq=False)
class SetCell(Write):
    """``cell.cell_contents = value``: a ``nonlocal`` of an outer function. ``target`` is the
    cell's value during capture and its ``CellSource`` once lowered."""

    kind: ClassVar[str] = "cell"
    target: Any
    value: Any
    where: str = ""

    def lower(self, lowering):
        if not isinstance(self.target.source, Source):
            raise malformed("SetCell", "the cell has no source")
        return SetCell(self.target.source, lowering.build(self.value), self.where)

    def rebuilds(self):
        return iter((self.value,))

    def render(self, r) -> str:
        parent = self.target.parent
        lvalue = self.target.render(r.namer.name(parent) if parent is not None else "")
        return f"{lvalue} = {r.expr(self.value)}"


@dataclass(frozen=True, eq=False)
class SetItem(Write):
    """``target[key] = value`` where target and key are values with sources (a new
    optimizer state entry keyed by a parameter, an item of an append-only dict)."""

    kind: ClassVar[str] = "item"
    target: Any
    key: Any
    value: Any
    where: str = ""

    def lower(self, lowering):
        return SetItem(lowering.build(self.target), lowering.build(self.key),
                       lowering.build(self.value), self.where)

    def rebuilds(self):
        return iter((self.target, self.key, self.value))

    def render(self, r) -> str:
        return f"{r.expr(self.target)}[{r.expr(self.key)}] = {r.expr(self.value)}"


@dataclass(frozen=True, eq=False)
class Append(Write):
    """``target.append(value)`` on a list whose items this capture does not track."""

    kind: ClassVar[str] = "append"
    target: Any
    value: Any
    where: str = ""

    def lower(self, lowering):
        return Append(_source_of(self.target, "Append"), lowering.build(self.value), self.where)

    def rebuilds(self):
        return iter((self.target, self.value))

    def render(self, r) -> str:
        return f"{r.expr(self.target)}.append({r.expr(self.value)})"


@dataclass(frozen=True, eq=False)
class ReplaceList(Write):
    """A list that existed before the call gets the contents it ended the call with
    (``append``, ``extend``, ``l[i] = v``, ``pop``, ``+=`` ... all become this one write).
    The read-your-writes view is the list's own value, mutated during capture."""

    kind: ClassVar[str] = "container"
    target: Any
    items: tuple = ()
    where: str = ""

    def lower(self, lowering):
        return ReplaceList(_source_of(self.target, "ReplaceList"),
                           tuple(lowering.build(i) for i in self.target.items), self.where)

    def rebuilds(self):
        return iter((self.target, *self.items))

    def render(self, r) -> str:
        return f"{r.expr(self.target)}[:] = [{', '.join(r.expr(s) for s in self.items)}]"


@dataclass(frozen=True, eq=False)
class ReplaceDict(Write):
    """A dict that existed before the call gets the items it ended the call with."""

    kind: ClassVar[str] = "container"
    target: Any
    items: tuple = ()  # ((key, record), ...) once lowered
    where: str = ""

    def lower(self, lowering):
        return ReplaceDict(_source_of(self.target, "ReplaceDict"),
                           tuple((k, lowering.build(i)) for k, i in self.target.items.items()),
                           self.where)

    def rebuilds(self):
        return iter((self.target, *(s for _, s in self.items)))

    def render(self, r) -> str:
        items = ", ".join(f"{r.key(k)}: {r.expr(s)}" for k, s in self.items)
        return f"REPLACE_DICT({r.expr(self.target)}, {{{items}}})"


@dataclass(frozen=True, eq=False)
class UpdateTensor(Write):
    """An existing tensor gets the values the graph computed for it on a copy. ``bumps``:
    the version-counter increments eager's in-place ops made (counted at capture). All
    tensor updates of an entry are committed together (``render.tensor_commit``)."""

    kind: ClassVar[str] = "tensor"
    target: Any
    value: Any = None
    bumps: int = 1
    where: str = ""

    def __post_init__(self):
        if not (type(self.bumps) is int and self.bumps >= 0):
            raise malformed("UpdateTensor", f"bumps {self.bumps!r} is not a count of version "
                                            "increments")

    def lower(self, lowering):
        bumps = lowering.version_bumps(self.target.example)  # None: a copy made in inference mode
        return UpdateTensor(_source_of(self.target, "UpdateTensor"), lowering.out(self.target.node),
                            1 if bumps is None else bumps, self.where)

    def rebuilds(self):
        return iter((self.target, self.value))

    def render(self, r) -> str:
        raise TypeError("tensor updates are rendered together by render.tensor_commit")


@dataclass(frozen=True, eq=False)
class ReplayTensor(Write):
    """An existing tensor updated by the commit itself with the in-place ops eager ran on it,
    in order (``p.add_(R[3], alpha=n0)``), instead of a copy of the graph's result: made by
    ``symbolic/commit_inplace.py`` when nothing in the graph reads the new value. The target
    may be a ``Scratch`` tensor the commit makes with its first op (``D0 = s57.sqrt()``) and
    only replayed ops read. ``ops``:
    ``((method, (arg record, ...), (("name", record), ...)), ...)``, already lowered (read from
    graph outputs, sources, constants and numbers); ``bumps``: version increments eager made
    beyond one per op. The commit batches replays into foreach calls (``replay.py``)."""

    kind: ClassVar[str] = "tensor"
    target: Any
    ops: tuple
    bumps: int = 0
    where: str = ""
    form: tuple = ()  # ((operand kinds: "t" / "n" / "name=n"), dtype) when batchable (replay.py)
    makes: bool = False  # the op binds the scratch target: ``D0 = s57.sqrt()`` (args[0]: s57)
    nbytes: int = 0  # the target's size at capture: large ones run in program order (replay.py)

    def __post_init__(self):
        if self.makes and not (isinstance(self.target, Scratch) and len(self.ops) == 1):
            raise malformed("ReplayTensor", "only one op makes a scratch tensor")
        if not self.ops or not all(isinstance(m, str) and (m.endswith("_") or self.makes)
                                   and isinstance(a, tuple) and isinstance(k, tuple)
                                   for m, a, k in self.ops):
            raise malformed("ReplayTensor", f"ops {self.ops!r} are not (in-place method, args, "
                                            "kwargs) triples")
        if not (type(self.bumps) is int and self.bumps >= 0):
            raise malformed("ReplayTensor", f"bumps {self.bumps!r} is not a count of version "
                                            "increments")

    def lower(self, lowering):
        return self  # made from lowered records

    def rebuilds(self):
        yield self.target
        for _, args, kwargs in self.ops:
            yield from args
            yield from (v for _, v in kwargs)

    def render(self, r) -> str:
        raise TypeError("tensor updates are rendered together by render.tensor_commit")


@dataclass(frozen=True, eq=False)
class Print(Write):
    """``print(*args, sep=, end=, file=, flush=)``: an effect with no target, its text
    formatted at commit. ``stream`` is the file's value (read before the graph) or None."""

    kind: ClassVar[str] = "print"
    args: tuple
    sep: Any = None
    end: Any = None
    stream: Any = None
    flush: bool = False
    where: str = ""

    def __post_init__(self):
        if not isinstance(self.args, tuple):
            raise malformed("Print", "args must be a tuple")
        if type(self.flush) is not bool:
            raise malformed("Print", f"flush {self.flush!r} is not a bool")

    @property
    def target(self) -> None:  # nothing is written into (see symbolic/alias_guards.py)
        return None

    def lower(self, lowering):
        opt = lambda v: None if v is None else lowering.build(v)  # noqa: E731
        stream = None if self.stream is None else _source_of(self.stream, "Print")
        return Print(tuple(lowering.build(a) for a in self.args), opt(self.sep), opt(self.end),
                     stream, self.flush, self.where)

    def rebuilds(self):
        return (s for s in (*self.args, self.sep, self.end, self.stream) if s is not None)

    def check(self, r, stored: set) -> str:
        return f"CAN_PRINT({'None' if self.stream is None else r.expr(self.stream)})"

    def render(self, r) -> str:  # the stream (sys.stdout / sys.stderr) was read before the graph
        args = [r.expr(s) for s in self.args]
        args += [f"{k}={r.expr(s)}" for k, s in (("sep", self.sep), ("end", self.end),
                                                  ("file", self.stream)) if s is not None]
        return f"PRINT({', '.join(args + ['flush=True'] * self.flush)})"


@dataclass(frozen=True, eq=False)
class Effect(Write):
    """``fn(*args)`` at commit, in program order: an effect with no target (the replay of
    ``warnings.warn``: symbolic/library/warnings.py). ``fn`` is a Python callable."""

    kind: ClassVar[str] = "effect"
    fn: Any
    args: tuple
    where: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise malformed("Effect", f"{self.fn!r} is not callable")
        if not isinstance(self.args, tuple):
            raise malformed("Effect", "args must be a tuple")

    @property
    def target(self) -> None:  # nothing is written into (see symbolic/alias_guards.py)
        return None

    def lower(self, lowering):
        return Effect(self.fn, tuple(lowering.build(a) for a in self.args), self.where)

    def rebuilds(self):
        return iter(self.args)

    def render(self, r) -> str:
        return f"{r.const(self.fn)}({', '.join(r.expr(a) for a in self.args)})"


def lint_writes(writes: list[Write]) -> None:
    """Lowered writes hold only rebuild records (and a cell write its cell's source)."""
    for w in writes:
        if not isinstance(w, Write):
            raise malformed("lint", f"{w!r} is not a write record")
        for r in w.rebuilds():
            if not isinstance(r, Rebuild):
                raise malformed(type(w).__name__, f"{r!r} is not a rebuild record: was the write "
                                                  "lowered?")
        if isinstance(w, SetCell):
            if not isinstance(w.target, Source):
                raise malformed("SetCell", f"{w.target!r} is not a cell source")
        if isinstance(w, UpdateTensor):
            if not isinstance(w.value, GraphOutput):
                raise malformed("UpdateTensor", f"{w.value!r} is not a graph output: the graph "
                                                "computes the tensor's new value")
