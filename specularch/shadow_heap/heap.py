"""The shadow heap: writes that outlive a call, deferred until the call is known to succeed.

During capture every write to state that existed before the call — an attribute, a global,
a closure cell, an item of a list or dict, the values of a tensor (in-place ops on buffers,
parameters, arguments) — goes into this log instead of into the real object. Reads in the
same call see the logged values first (read-your-writes). The log becomes part of the
cache entry: after the graph ran and every guard and in-graph assertion passed, the entry
replays it in program order (``commit``); if anything failed the log is dropped
(``discard``) and no real object was touched.

API (capture time): ``read_attr`` / ``write_attr`` / ``delete_attr``, ``read_global`` /
``write_global``, ``write_cell``, ``write_print``, ``write_effect``, ``touch_container``, ``touched``, ``update_tensor``, ``pending()``.
The commit itself is generated code (``entry.py``), built from ``pending()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DELETED = object()


@dataclass
class Write:
    """One deferred write. ``kind`` is one of:

    * ``setattr`` / ``delattr``: ``owner.<name> = value`` (owner: a value with a source)
    * ``global``: ``globals_dict[name] = value``
    * ``cell``: ``cell.cell_contents = value`` (a ``nonlocal`` of an outer function)
    * ``item``: ``container[key] = value`` (container and key: values with sources)
    * ``append``: ``container.append(value)`` (an append-only list)
    * ``container``: a list/dict that existed before the call gets its final contents
    * ``tensor``: an existing tensor gets the values computed functionally by the graph
    * ``print``: ``print(*value[0], sep=, end=, file=, flush=)`` (``value``: the arguments,
      sep, end, the stream value or None, flush), text formatted at commit
    * ``effect``: ``name(*value)``, a function called at commit (``warnings.warn``'s replay)
    """

    kind: str
    target: Any          # the value written into (Obj, ListV, DictV, CellV, TensorV) or globals
    name: Any = None     # attribute / global name
    value: Any = None    # the value written (for setattr / global / cell)
    where: str = ""


class ShadowHeap:
    def __init__(self) -> None:
        self._log: list[Write] = []
        self._attrs: dict[int, dict[str, Any]] = {}
        self._globals: dict[int, dict[str, Any]] = {}
        self._touched: set[int] = set()
        self._keep: list = []  # keeps overlay owners alive so ids stay unique

    # ---- attributes -------------------------------------------------------------------
    def read_attr(self, owner_obj: Any, name: str) -> Any:
        """The value written to ``owner_obj.name`` in this call, ``DELETED``, or None."""
        return self._attrs.get(id(owner_obj), {}).get(name)

    def write_attr(self, owner, owner_obj: Any, name: str, value, where: str = "") -> None:
        self._attrs.setdefault(id(owner_obj), {})[name] = value
        self._keep.append(owner_obj)
        self._log.append(Write("setattr", owner, name, value, where))

    def delete_attr(self, owner, owner_obj: Any, name: str, where: str = "") -> None:
        self._attrs.setdefault(id(owner_obj), {})[name] = DELETED
        self._keep.append(owner_obj)
        self._log.append(Write("delattr", owner, name, None, where))

    # ---- globals and cells --------------------------------------------------------------
    def read_global(self, globals_: dict, name: str) -> Any:
        return self._globals.get(id(globals_), {}).get(name)

    def write_global(self, globals_: dict, name: str, value, where: str = "") -> None:
        self._globals.setdefault(id(globals_), {})[name] = value
        self._keep.append(globals_)
        self._log.append(Write("global", globals_, name, value, where))

    def write_item(self, container, key, value, where: str = "") -> None:
        """``container[key] = value`` where container and key are values with sources
        (e.g. a new optimizer state entry keyed by a parameter)."""
        self._log.append(Write("item", container, key, value, where))

    def write_append(self, container, value, where: str = "") -> None:
        """``container.append(value)`` on a list whose items this capture does not track."""
        self._log.append(Write("append", container, None, value, where))

    def write_print(self, args: list, sep, end, stream, flush: bool, where: str = "") -> None:
        """``print(...)``: an effect with no target, committed in program order."""
        self._log.append(Write("print", None, None, (args, sep, end, stream, flush), where))

    def write_effect(self, fn, args: list, where: str = "") -> None:
        """``fn(*args)`` at commit, in program order: an effect with no target."""
        self._log.append(Write("effect", None, fn, args, where))

    def write_cell(self, cell, value, where: str = "") -> None:
        self._log.append(Write("cell", cell, None, value, where))

    # ---- containers and tensors -----------------------------------------------------------
    def touch_container(self, container, where: str = "") -> None:
        """A list/dict that existed before the call was mutated; commit its final contents."""
        if id(container) not in self._touched:
            self._touched.add(id(container))
            self._keep.append(container)
            self._log.append(Write("container", container, where=where))

    def touched(self, value) -> bool:
        """Whether ``value`` (a container or tensor value) was mutated in this call."""
        return id(value) in self._touched

    def update_tensor(self, tensor_value, where: str = "") -> None:
        """An existing tensor was written in place; commit the graph's final value into it."""
        if id(tensor_value) not in self._touched:
            self._touched.add(id(tensor_value))
            self._keep.append(tensor_value)
            self._log.append(Write("tensor", tensor_value, where=where))

    def pending(self) -> list[Write]:
        """The writes to commit, in program order."""
        return list(self._log)

    def __len__(self) -> int:
        return len(self._log)
