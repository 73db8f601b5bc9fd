"""Python-number graph inputs that reach a torch function (``torch.full((3,), k)``,
``clamp(max=k)``, a size): a compiling backend compiles the graph once per value of them,
with the values written into the graph, and checks them on every call.

Numbers that only feed arithmetic stay run-time inputs (``passes.scalar_inputs_as_tensors``);
the others cannot: a torch function may take only a number, or branch on it while being
flattened. A value is matched by its type and exact bits (``-0.0`` is not ``0.0``; ``1`` is
not ``1.0`` nor ``True``), so a new value never reuses another value's compile. At most
``LIMIT`` values are compiled per graph; other values, and new values once the graph is
compiled in the background (a call must never wait for a compile), run the graph's ``fx``
code, which takes any value.
"""
from __future__ import annotations

import struct
from typing import Callable

import torch
import torch.fx

LIMIT = 8


def value_key(value) -> tuple:
    if isinstance(value, float):
        return float, struct.pack("<d", value)
    return type(value), value


def with_values(gm: torch.fx.GraphModule, values: dict[int, object]) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose placeholders at the positions in ``values`` are unused, their
    uses reading the given numbers instead (node metadata shared, not copied)."""
    graph = torch.fx.Graph()
    mapping: dict = {}
    output = graph.graph_copy(gm.graph, mapping)
    graph.output(output)
    placeholders = [mapping[n] for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {placeholders[i]: value for i, value in values.items()}
    for placeholder in constants:
        for user in list(placeholder.users):
            user.args = torch.fx.node.map_arg(user.args, lambda n: constants.get(n, n))
            user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda n: constants.get(n, n))
    graph.lint()
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(gm.meta, constructed_by="specularch.fx_lower.specialise.with_values",
                    specialised={i: values[i] for i in sorted(values)})
    return new


class PerValue:
    """The graph compiled per value of the numbers at ``positions``."""

    def __init__(self, gm: torch.fx.GraphModule, positions: list[int],
                 compile_one: Callable, any_value: Callable, *, lazily: bool):
        self.gm, self.positions = gm, positions
        self.compile_one, self.any_value, self.lazily = compile_one, any_value, lazily
        self.compiled: dict[tuple, Callable] = {}

    def add(self, example_inputs: list) -> None:
        values = {i: example_inputs[i] for i in self.positions}
        key = tuple(value_key(v) for v in values.values())
        self.compiled[key] = self.compile_one(with_values(self.gm, values), example_inputs)

    def __call__(self, *args):
        key = tuple(value_key(args[i]) for i in self.positions)
        run = self.compiled.get(key)
        if run is None:
            if not self.lazily or len(self.compiled) >= LIMIT:
                return self.any_value(*args)
            self.add(list(args))
            run = self.compiled[key]
        return run(*args)
