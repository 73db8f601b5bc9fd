"""The shadow heap: writes that outlive a call, deferred until the call is known to succeed.

During capture every write to state that existed before the call — an attribute, a global,
a closure cell, an item of a list or dict, the values of a tensor (in-place ops on buffers,
parameters, arguments) — goes into this log instead of into the real object. Reads in the
same call see the logged values first (read-your-writes). The log becomes part of the
cache entry: after the graph ran and every guard and in-graph assertion passed, the entry
replays it in program order (``commit``); if anything failed the log is dropped
(``discard``) and no real object was touched.

API (capture time): ``read_attr`` / ``write_attr`` / ``delete_attr``, ``write_grad``, ``read_global`` /
``write_global``, ``write_cell``, ``write_item``, ``write_append``, ``write_print``,
``touch_container``, ``touched``, ``update_tensor``, ``pending()``, ``lower()``,
``discard()``. Each write is one record of ``writes.py``; the commit is generated code
(``render.commit_lines``, run by the entry) built from the lowered records.

Read-your-writes: attributes and globals through the overlay here (``read_attr``,
``read_global``); a list or dict through its ``ContainerView`` (``views.py``), opened by its
first write (``touch_container``) and keyed by the container value's identity: the value
reads and writes its items through the view, the real object is untouched, and the commit
stores the view's final contents; a tensor through its value, which ``update_tensor`` points
at the graph's copy.
"""
from __future__ import annotations

from typing import Any

from .views import ContainerView
from .writes import (Append, DelAttr, Effect, Print, ReplaceDict, ReplaceList, SetAttr, SetCell, SetGlobal,
                     SetGrad, SetItem, UpdateTensor, Write)

DELETED = object()


class ShadowHeap:
    def __init__(self, graph=None) -> None:
        self._log: list[Write] = []
        self._graph = graph  # the capture's fx.Graph: has an op run yet? (``_before_ops``)
        self._ops_started = graph is None
        self._nodes_seen = 0
        self._attrs: dict[int, dict[str, Any]] = {}
        self._globals: dict[int, dict[str, Any]] = {}
        self._touched: set[int] = set()
        self._views: dict[int, tuple[Any, ContainerView]] = {}  # id(container value) ->
        self._keep: list = []  # keeps overlay owners alive so ids stay unique

    # ---- attributes -------------------------------------------------------------------
    def read_attr(self, owner_obj: Any, name: str) -> Any:
        """The value written to ``owner_obj.name`` in this call, ``DELETED``, or None."""
        return self._attrs.get(id(owner_obj), {}).get(name)

    def write_attr(self, owner, owner_obj: Any, name: str, value, where: str = "") -> None:
        self._attrs.setdefault(id(owner_obj), {})[name] = value
        self._keep.append(owner_obj)
        self._log.append(SetAttr(owner, name, value, where, before_ops=self._before_ops()))

    def _before_ops(self) -> bool:
        """Whether the call has run no graph op yet (only read its inputs): nothing before
        this point can raise or be seen, so a write made here may be done before the graph
        (``release.py``). Placeholders go before the first op and other nodes at the end,
        so a new op is among the nodes added since the last look, which are the last ones."""
        if not self._ops_started:
            nodes = self._graph.nodes
            added, self._nodes_seen = len(nodes) - self._nodes_seen, len(nodes)
            for node, _ in zip(reversed(nodes), range(added)):
                if node.op not in ("placeholder", "get_attr"):
                    self._ops_started = True
                    break
        return not self._ops_started

    def write_grad(self, owner, tensor: Any, value, where: str = "") -> None:
        """``tensor.grad = value`` (``owner``: the tensor's value, with a source)."""
        self._attrs.setdefault(id(tensor), {})["grad"] = value
        self._keep.append(tensor)
        self._log.append(SetGrad(owner, "grad", value, where, before_ops=self._before_ops()))

    def delete_attr(self, owner, owner_obj: Any, name: str, where: str = "") -> None:
        self._attrs.setdefault(id(owner_obj), {})[name] = DELETED
        self._keep.append(owner_obj)
        self._log.append(DelAttr(owner, name, where))

    # ---- globals and cells --------------------------------------------------------------
    def overlay_values(self) -> list:
        """Every value written to an attribute or a global so far (what later reads see)."""
        return [v for table in (*self._attrs.values(), *self._globals.values())
                for v in table.values()]

    def read_global(self, globals_: dict, name: str) -> Any:
        return self._globals.get(id(globals_), {}).get(name)

    def write_global(self, globals_: dict, name: str, value, where: str = "") -> None:
        self._globals.setdefault(id(globals_), {})[name] = value
        self._keep.append(globals_)
        self._log.append(SetGlobal(globals_, name, value, where))

    def write_item(self, container, key, value, where: str = "") -> None:
        """``container[key] = value`` where container and key are values with sources
        (e.g. a new optimizer state entry keyed by a parameter)."""
        self._log.append(SetItem(container, key, value, where))

    def write_append(self, container, value, where: str = "") -> None:
        """``container.append(value)`` on a list whose items this capture does not track."""
        self._log.append(Append(container, value, where))

    def write_print(self, args: list, sep, end, stream, flush: bool, where: str = "") -> None:
        """``print(...)``: an effect with no target, committed in program order."""
        self._log.append(Print(tuple(args), sep, end, stream, bool(flush), where))

    def write_effect(self, fn, args: list, where: str = "") -> None:
        """``fn(*args)`` at commit, in program order: an effect with no target."""
        self._log.append(Effect(fn, tuple(args), where))

    def write_cell(self, cell, value, where: str = "") -> None:
        self._log.append(SetCell(cell, value, where))

    # ---- containers and tensors -----------------------------------------------------------
    def touch_container(self, container, where: str = "") -> None:
        """A list/dict that existed before the call was mutated; commit its final contents."""
        if id(container) not in self._touched:
            self._touched.add(id(container))
            self._keep.append(container)
            view = ContainerView(container.items)
            self._views[id(container)] = (container, view)
            container.open_view(view)  # its items are the view's from now on
            replace = ReplaceDict if view.is_dict() else ReplaceList
            self._log.append(replace(container, where=where))

    def view(self, container) -> ContainerView | None:
        """The read-your-writes view of a pre-existing list/dict written in this call."""
        entry = self._views.get(id(container))
        return None if entry is None else entry[1]

    def touched(self, value) -> bool:
        """Whether ``value`` (a container or tensor value) was mutated in this call."""
        return id(value) in self._touched

    def update_tensor(self, tensor_value, copy, where: str = "") -> None:
        """An existing tensor was written in place, functionally on ``copy`` (a tensor value
        in the graph): later reads in the call see the copy, and the commit copies the
        graph's final value into the real tensor."""
        tensor_value.node, tensor_value.example = copy.node, copy.example
        tensor_value.updated = True
        if id(tensor_value) not in self._touched:
            self._touched.add(id(tensor_value))
            self._keep.append(tensor_value)
            self._log.append(UpdateTensor(tensor_value, where=where))

    def pending(self) -> list[Write]:
        """The writes to commit, in program order (fields: the values of the capture)."""
        return list(self._log)

    def lower(self, lowering) -> list[Write]:
        """The writes to commit with the values they store as rebuild records (``writes.py``),
        read when the call's capture ended."""
        return [w.lower(lowering) for w in self._log]

    def discard(self) -> None:
        """Forget every pending write; no real object was touched by any of them."""
        self._log.clear()
        for container, view in self._views.values():  # they read the real object's items again
            container.close_view(view.base)
        self._views.clear()
        self._attrs.clear()
        self._globals.clear()
        self._touched.clear()
        self._keep.clear()

    def __len__(self) -> int:
        return len(self._log)
