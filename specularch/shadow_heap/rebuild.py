"""Rebuild records: how the entry builds a Python value after the graph ran.

Capture describes the return value, and every value a deferred write stores, as a small tree
of frozen records; the entry function renders each tree into one Python expression
(``render``). A record checks its own fields when built, and ``lint`` checks a whole tree
against the graph it reads from (like ``torch.fx.Graph.lint``), so a malformed description
fails at capture with a message naming the record, not later inside generated code.

    GraphOutput(3)                         R[3]
    GraphItem(3)                           R[3].item()
    Constant(2.5) / Pinned(obj)            2.5 / K0 (an object the entry holds)
    FromSource(L['self'].fc)               the pre-call object at that source
    CallerGlobals()                        G (the globals of the optimized function)
    SetOf(frozenset)                       set(K0)
    TupleOf((..), cls)                     (a, b) / Point(a, b) / cls((a, b))
    ListOf((..), uid) / DictOf(((k, ..),), uid) / NewObject(cls, (("name", ..),), uid)
                                           made once per uid: one object stays one object
    AsInference(GraphOutput(i), key)       graph output i as an inference tensor (grad_mode.py)
    Formatted(v, conversion, spec) / Concat((..)) / CallOf(fn, (..), (("k", ..),))
                                           strings formatted after the graph (printing.py)
    Number(fn, (..), uid) / ClockRead(fn, seq, phase)
                                           numbers the entry computes (deferred.py)
    Scratch(uid)                           D0: a tensor the commit computes for its replayed
                                           in-place ops (Adam's denominator; replay.py)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from ..guards.sources import Source


class MalformedRebuild(ValueError):
    """A rebuild or write record whose fields cannot describe a value, e.g.
    ``TupleOf([GraphOutput(0)], tuple)``: items must be a tuple of rebuild records
    (``TupleOf((GraphOutput(0),), tuple)``). Raised at capture: an ``internal_error``."""


def malformed(record: str, message: str) -> MalformedRebuild:
    """The error for a malformed ``record`` (its messages are formatted only on failure:
    formatting a symbolic value would specialise it)."""
    return MalformedRebuild(f"{record}: {message}")


def _all_rebuilds(items: Any) -> bool:
    return isinstance(items, tuple) and all(isinstance(i, Rebuild) for i in items)


def _all_pairs(items: Any, key_type: type = object) -> bool:
    return isinstance(items, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], key_type)
        and isinstance(p[1], Rebuild) for p in items)


class Rebuild:
    """A value the entry builds after the graph ran. Subclasses are frozen dataclasses."""

    def render(self, r) -> str:
        """The Python expression for this value (``r``: a ``render.Renderer``)."""
        raise NotImplementedError

    def children(self) -> Iterator["Rebuild"]:
        return iter(())


def _index_ok(index: Any) -> bool:
    return type(index) is int and index >= 0


@dataclass(frozen=True)
class GraphOutput(Rebuild):
    index: int

    def __post_init__(self):
        if not _index_ok(self.index):
            raise malformed("GraphOutput", f"index {self.index!r} is not an output number")

    def render(self, r) -> str:
        return f"R[{self.index}]"


@dataclass(frozen=True)
class GraphItem(Rebuild):
    """``t.item()`` read from graph output ``index`` after the graph ran."""

    index: int

    def __post_init__(self):
        if not _index_ok(self.index):
            raise malformed("GraphItem", f"index {self.index!r} is not an output number")

    def render(self, r) -> str:
        return f"R[{self.index}].item()"


@dataclass(frozen=True, eq=False)
class Constant(Rebuild):
    value: Any

    def render(self, r) -> str:
        return r.literal(self.value)


@dataclass(frozen=True, eq=False)
class Pinned(Rebuild):
    """An object held by the entry itself (no source reaches it)."""

    obj: Any

    def render(self, r) -> str:
        return r.const(self.obj)


@dataclass(frozen=True)
class FromSource(Rebuild):
    source: Source

    def __post_init__(self):
        if not isinstance(self.source, Source):
            raise malformed("FromSource", f"{self.source!r} is not a Source (the value must be "
                                          "reachable from the frame)")

    def render(self, r) -> str:
        return r.namer.name(self.source)


@dataclass(frozen=True)
class CallerGlobals(Rebuild):
    def render(self, r) -> str:
        return "G"


@dataclass(frozen=True)
class SetOf(Rebuild):
    items: frozenset

    def __post_init__(self):
        if not isinstance(self.items, frozenset):
            raise malformed("SetOf", "items must be a frozenset of constants")

    def render(self, r) -> str:
        return f"set({r.const(self.items)})"


@dataclass(frozen=True, eq=False)
class TupleOf(Rebuild):
    """A tuple, a namedtuple (``cls._make``-able: called with the items), or anything else
    called with one sequence of the items (a structseq, ``OrderedDict`` from pairs)."""

    items: tuple
    cls: Callable = tuple

    def __post_init__(self):
        if not _all_rebuilds(self.items):
            raise malformed("TupleOf", "items must be a tuple of rebuild records")
        if not callable(self.cls):
            raise malformed("TupleOf", f"cls {self.cls!r} is not callable")

    def children(self):
        return iter(self.items)

    def render(self, r) -> str:
        body = "".join(f"{r.expr(s)}, " for s in self.items)
        if self.cls is tuple:
            return f"({body})"
        if hasattr(self.cls, "_make"):
            return f"{r.const(self.cls)}({body})"
        return f"{r.const(self.cls)}(({body}))"


class _Made(Rebuild):
    """A mutable object made in the call: built once per ``uid`` into a local, so two
    uses (returned and stored) stay one object."""

    uid: int

    def render(self, r) -> str:
        return r.once(self.uid, "t", self.make, r.prelude)

    def make(self, r) -> str:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class ListOf(_Made):
    items: tuple
    uid: int

    def __post_init__(self):
        if not _all_rebuilds(self.items):
            raise malformed("ListOf", "items must be a tuple of rebuild records")
        if type(self.uid) is not int:
            raise malformed("ListOf", f"uid {self.uid!r} is not an int")

    def children(self):
        return iter(self.items)

    def make(self, r) -> str:
        return "[" + ", ".join(r.expr(s) for s in self.items) + "]"


@dataclass(frozen=True, eq=False)
class DictOf(_Made):
    items: tuple  # ((key, record), ...): keys are constants
    uid: int

    def __post_init__(self):
        if not _all_pairs(self.items):
            raise malformed("DictOf", "items must be a tuple of (key, record) pairs")
        if type(self.uid) is not int:
            raise malformed("DictOf", f"uid {self.uid!r} is not an int")

    def children(self):
        return (s for _, s in self.items)

    def make(self, r) -> str:
        return "{" + ", ".join(f"{r.key(k)}: {r.expr(s)}" for k, s in self.items) + "}"


@dataclass(frozen=True, eq=False)
class NewObject(_Made):
    """An instance of a user class made in the call, with the attributes it ended with."""

    cls: type
    attrs: tuple  # (("name", record), ...)
    uid: int

    def __post_init__(self):
        if not isinstance(self.cls, type):
            raise malformed("NewObject", f"cls {self.cls!r} is not a class")
        if not _all_pairs(self.attrs, str):
            raise malformed("NewObject", "attrs must be a tuple of (attribute name, record) pairs")
        if type(self.uid) is not int:
            raise malformed("NewObject", f"uid {self.uid!r} is not an int")

    def children(self):
        return (s for _, s in self.attrs)

    def make(self, r) -> str:
        attrs = "{" + ", ".join(f"{k!r}: {r.expr(s)}" for k, s in self.attrs) + "}"
        return f"NEW({r.const(self.cls)}, {attrs})"


@dataclass(frozen=True)
class AsInference(Rebuild):
    """A graph output made an inference tensor again, once per tensor (``key``)."""

    output: GraphOutput
    key: int

    def __post_init__(self):
        if not isinstance(self.output, GraphOutput):
            raise malformed("AsInference", f"{self.output!r} is not a GraphOutput (only graph "
                                           "results are made inference tensors)")

    def children(self):
        return iter((self.output,))

    def render(self, r) -> str:
        return r.once(("inference", self.key), "t",
                      lambda r: f"AS_INFERENCE({r.expr(self.output)})", r.prelude)


_CONVERSIONS = {0: "", 1: "STR", 2: "REPR", 3: "ASCII"}  # FORMAT_VALUE's oparg & 3


@dataclass(frozen=True)
class Formatted(Rebuild):
    """``f"{v!r:spec}"``, as FORMAT_VALUE computes it."""

    value: Rebuild
    conversion: int
    spec: str

    def __post_init__(self):
        if not isinstance(self.value, Rebuild):
            raise malformed("Formatted", f"{self.value!r} is not a rebuild record")
        if self.conversion not in _CONVERSIONS:
            raise malformed("Formatted", f"conversion {self.conversion!r} is not one of "
                                         "FORMAT_VALUE's 0-3")
        if not isinstance(self.spec, str):
            raise malformed("Formatted", f"format spec {self.spec!r} is not a str")

    def children(self):
        return iter((self.value,))

    def render(self, r) -> str:
        conv = _CONVERSIONS[self.conversion]
        value = f"{conv}({r.expr(self.value)})" if conv else r.expr(self.value)
        return f"FORMAT({value}, {self.spec!r})"


@dataclass(frozen=True)
class Concat(Rebuild):
    parts: tuple

    def __post_init__(self):
        if not _all_rebuilds(self.parts):
            raise malformed("Concat", "parts must be a tuple of rebuild records")

    def children(self):
        return iter(self.parts)

    def render(self, r) -> str:
        return "''.join((" + "".join(f"{r.expr(s)}, " for s in self.parts) + "))"


@dataclass(frozen=True, eq=False)
class CallOf(Rebuild):
    """``fn(*args, **kwargs)`` evaluated where the value is used (a string method, a dict view)."""

    fn: Callable
    args: tuple
    kwargs: tuple = ()  # (("name", record), ...)

    def __post_init__(self):
        if not callable(self.fn):
            raise malformed("CallOf", f"{self.fn!r} is not callable")
        if not _all_rebuilds(self.args):
            raise malformed("CallOf", "args must be a tuple of rebuild records")
        if not _all_pairs(self.kwargs, str):
            raise malformed("CallOf", "kwargs must be a tuple of (name, record) pairs")

    def children(self):
        yield from self.args
        yield from (s for _, s in self.kwargs)

    def render(self, r) -> str:
        args = [r.expr(s) for s in self.args] + [f"{k}={r.expr(s)}" for k, s in self.kwargs]
        return f"{r.const(self.fn)}({', '.join(args)})"


@dataclass(frozen=True, eq=False)
class Number(Rebuild):
    """``fn(*args)`` on ``.item()`` values, computed once before any write (deferred.py)."""

    fn: Callable
    args: tuple
    uid: int

    def __post_init__(self):
        if not callable(self.fn):
            raise malformed("Number", f"{self.fn!r} is not callable")
        if not _all_rebuilds(self.args):
            raise malformed("Number", "args must be a tuple of rebuild records")
        if type(self.uid) is not int:
            raise malformed("Number", f"uid {self.uid!r} is not an int")

    def children(self):
        return iter(self.args)

    def render(self, r) -> str:
        return r.once(("num", self.uid), "n", self._call, r.numbers)

    def _call(self, r) -> str:
        return f"{r.const(self.fn)}({', '.join(r.expr(s) for s in self.args)})"


@dataclass(frozen=True)
class Scratch(Rebuild):
    """A tensor the commit computes itself between replayed in-place ops (``D0 =
    s57.sqrt()``, symbolic/commit_inplace.py), bound by the replay (shadow_heap/replay.py)."""

    uid: int

    def __post_init__(self):
        if not _index_ok(self.uid):
            raise malformed("Scratch", f"uid {self.uid!r} is not a scratch tensor number")

    def render(self, r) -> str:
        return f"D{self.uid}"


@dataclass(frozen=True, eq=False)
class ClockRead(Rebuild):
    """A clock read (``time.perf_counter()``) placed before or after the graph (deferred.py)."""

    fn: Callable
    seq: int
    phase: str

    def __post_init__(self):
        if not callable(self.fn):
            raise malformed("ClockRead", f"{self.fn!r} is not callable")
        if not _index_ok(self.seq):
            raise malformed("ClockRead", f"seq {self.seq!r} is not a read number")
        if self.phase not in ("before", "after"):
            raise malformed("ClockRead", f"phase {self.phase!r} is neither 'before' nor 'after' "
                                         "the graph")

    def render(self, r) -> str:
        r.clocks[self.seq] = (self.fn, self.phase)
        return f"c{self.seq}"


def walk(record: Rebuild) -> Iterator[Rebuild]:
    yield record
    for child in record.children():
        yield from walk(child)


def lint(roots: Iterable[Rebuild], outputs: int) -> None:
    """Check the trees one entry renders (its return value and what its writes store)
    against a graph with ``outputs`` results: every node is a record, every output read
    exists, and a uid names one kind of object across all of them."""
    kinds: dict[int, type] = {}
    for root in roots:
        if not isinstance(root, Rebuild):
            raise malformed("lint", f"{root!r} is not a rebuild record")
        _lint_tree(root, outputs, kinds)


def _lint_tree(root: Rebuild, outputs: int, kinds: dict[int, type]) -> None:
    for r in walk(root):
        if isinstance(r, (GraphOutput, GraphItem)):
            if r.index >= outputs:
                raise malformed(type(r).__name__, f"reads output {r.index} of a graph with "
                                                  f"{outputs} outputs")
        if isinstance(r, _Made):
            seen = kinds.setdefault(r.uid, type(r))
            if seen is not type(r):
                raise malformed(type(r).__name__, f"uid {r.uid} already names a {seen.__name__}: "
                                                  "one uid is one object")
