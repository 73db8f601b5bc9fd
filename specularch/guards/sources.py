"""Sources: where a value read during capture came from, as a path from the frame.

A source prints as the user would recognise it (``L['self'].fc.weight``, ``G['FLAG']``) and
compiles to a Python expression over the three frame roots the runtime passes to every
check: ``L`` (argument slots, in ``co_varnames`` order), ``C`` (closure cells) and ``G``
(the function's globals). Guards and graph inputs are both built from sources.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class Source:
    """Base class; subclasses are frozen dataclasses with ``expr()`` and ``__str__``."""

    @property
    def parent(self) -> "Source | None":
        """The source this one is derived from (None for roots)."""
        return getattr(self, "base", None)

    def expr(self) -> str:
        """A Python expression over ``L``, ``C``, ``G``, ``B``, ``O`` evaluating the source."""
        parent = self.parent
        return self.render(parent.expr() if parent is not None else "")

    def render(self, base: str) -> str:
        """The expression, given the expression (or local name) of ``base``."""
        raise NotImplementedError

    def render_named(self, base: str, name_of) -> str:
        """``render``, where the other sources it reads (a key) are the names ``name_of``
        gives them: a generated check reads each source once."""
        return self.render(base)

    def root(self) -> "Source":
        parent = self.parent
        return self if parent is None else parent.root()


@dataclass(frozen=True)
class LocalSource(Source):
    index: int
    name: str

    def render(self, base: str) -> str:
        return f"L[{self.index}]"

    def __str__(self) -> str:
        return f"L[{self.name!r}]"


@dataclass(frozen=True)
class CellSource(Source):
    """A free variable of the optimized function, read through its closure cell."""

    index: int
    name: str

    def render(self, base: str) -> str:
        return f"C[{self.index}].cell_contents"

    def __str__(self) -> str:
        return f"C[{self.name!r}]"


@dataclass(frozen=True)
class GlobalSource(Source):
    name: str

    def render(self, base: str) -> str:
        return f"G[{self.name!r}]"

    def __str__(self) -> str:
        return f"G[{self.name!r}]"


@dataclass(frozen=True)
class BuiltinSource(Source):
    """A builtin reached through the globals' ``__builtins__`` (the name is not a global)."""

    name: str

    def render(self, base: str) -> str:
        return f"B[{self.name!r}]"

    def __str__(self) -> str:
        return f"builtins.{self.name}"


# Objects a source path may start from that are not frame roots (another module's globals
# dict, say). Generated checks see this list as ``O``; entries live as long as the process.
PINNED: list = []
_PINNED_IDS: dict[int, int] = {}


def pin(obj) -> int:
    index = _PINNED_IDS.get(id(obj))
    if index is None:
        index = _PINNED_IDS[id(obj)] = len(PINNED)
        PINNED.append(obj)
    return index


_KEY_ATOMS = (str, int, bool, type(None), torch.dtype)


def plain_key(key) -> bool:
    """A dict key whose equality and hash are its value, so the dict's key list can be
    guarded by ``==``: a str, an int, or a tuple of those, bools, None and dtypes (torch's
    ``{(device_type, dtype): ...}`` tables)."""
    if type(key) in (str, int):
        return True
    return type(key) is tuple and all(type(k) in _KEY_ATOMS or plain_key(k) for k in key)


@dataclass(frozen=True)
class ObjectSource(Source):
    """A long-lived object (e.g. an imported module's globals dict), shown by ``label``."""

    index: int
    label: str

    def render(self, base: str) -> str:
        return f"O[{self.index}]"

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class AttrSource(Source):
    base: Source
    attr: str

    def render(self, base: str) -> str:
        if self.attr.isidentifier() and not self.attr.startswith("__"):
            return f"{base}.{self.attr}"
        return f"getattr({base}, {self.attr!r})"

    def __str__(self) -> str:
        return f"{self.base}.{self.attr}"


@dataclass(frozen=True)
class ModuleDictSource(Source):
    """An entry of an nn.Module's ``_parameters``/``_buffers``/``_modules`` dict.

    Reading the dict directly skips ``nn.Module.__getattr__``, which matters on the hot path.
    """

    base: Source
    table: str
    key: str

    def render(self, base: str) -> str:
        return f"{base}.{self.table}[{self.key!r}]"

    def __str__(self) -> str:
        return f"{self.base}.{self.key}"


@dataclass(frozen=True)
class ItemSource(Source):
    base: Source
    key: object  # an int or str constant, or a ``plain_key`` tuple

    def render(self, base: str) -> str:
        if type(self.key) in (str, int):
            return f"{base}[{self.key!r}]"
        return f"{base}[O[{pin(self.key)}]]"  # a tuple holding dtypes has no literal repr

    def __str__(self) -> str:
        return f"{self.base}[{self.key!r}]"


@dataclass(frozen=True)
class ClosureSource(Source):
    """Contents of cell ``index`` of a function reached through another source."""

    base: Source
    index: int
    name: str

    def render(self, base: str) -> str:
        return f"{base}.__closure__[{self.index}].cell_contents"

    def __str__(self) -> str:
        return f"{self.base}.<closure {self.name}>"


@dataclass(frozen=True)
class DerefSource(Source):
    """The object a weak reference (read from ``base``) points to: ``base()``."""

    base: Source

    def render(self, base: str) -> str:
        return f"{base}()"

    def __str__(self) -> str:
        return f"{self.base}()"


@dataclass(frozen=True)
class KeyedSource(Source):
    """``base.get(key)`` where the key is another source's object (e.g. an optimizer's
    ``state`` entry of a parameter)."""

    base: Source
    key: Source

    def render(self, base: str) -> str:
        return f"{base}.get({self.key.expr()})"

    def render_named(self, base: str, name_of) -> str:
        return f"{base}.get({name_of(self.key)})"

    def __str__(self) -> str:
        return f"{self.base}[{self.key}]"


@dataclass(frozen=True)
class ScalarOfSource(Source):
    """The Python number in a one-element tensor (read before the graph runs, as a graph
    input; e.g. an Adam ``step`` count)."""

    base: Source

    def render(self, base: str) -> str:
        return f"{base}.item()"

    def __str__(self) -> str:
        return f"{self.base}.item()"
