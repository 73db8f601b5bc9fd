"""Compat: a frozen TorchScript module's graph as IR text, and a function made from that text
(``torch._C.parse_ir``, ``torch._C._create_function_from_graph``: private TorchScript APIs).

Why: ``torch.jit.load`` compiles the archive's TorchScript source again and holds the GIL
while it does (1.4 ms warm for the MLP's training step, 2.4 ms for LeNet's, 4-16 ms in a
tiered program's background thread, where the program's step waits for it). Parsing the
frozen graph's IR and making a function of it is 0.2-0.4 ms. Only a graph whose text parses
back to the same graph with exactly the same constants travels this way; any other (a
tensor constant, a graph that reads ``self``) is loaded with ``torch.jit.load``.
"""
from __future__ import annotations

from typing import Callable

import torch


def function_text(module: torch.jit.ScriptModule) -> str | None:
    """``module.forward``'s graph as the IR text of a function of its other inputs, or None
    where that text would not give the same graph back (checked here, by parsing it)."""
    try:
        graph = module.forward.graph.copy()
        inputs = list(graph.inputs())
        if not inputs or inputs[0].uses():  # a frozen module's graph does not read self
            return None
        graph.eraseInput(0)
        text = graph.str(False)  # without source locations
        parsed = _parsed(text)
    except Exception:  # e.g. a tensor constant: its value is not in the text
        return None
    if _signature(parsed) != _signature(graph):
        return None
    return text


def _signature(graph) -> list:
    """The graph up to its values' names (which parsing renumbers): its inputs' types, then
    per node, nested blocks included, in order: its kind, which values it reads (by the
    order they were defined in), its outputs' types, and a constant's exact value (the text
    must not have rounded a float)."""
    number: dict = {}

    def define(values) -> list:
        for v in values:
            number[v.debugName()] = len(number)
        return [str(v.type()) for v in values]

    def walk(block) -> list:
        out = [define(list(block.inputs()))]
        for node in block.nodes():
            reads = [number.get(v.debugName(), -1) for v in node.inputs()]
            value = repr(node.output().toIValue()) if node.kind() == "prim::Constant" else None
            out.append((node.kind(), reads, define(list(node.outputs())), value,
                        [walk(inner) for inner in node.blocks()]))
        out.append([number.get(v.debugName(), -1) for v in block.outputs()])
        return out
    return walk(graph)


def function_from_text(text: str) -> Callable:
    """A TorchScript function running the graph ``function_text`` wrote."""
    return torch._C._create_function_from_graph("forward", _parsed(text))


def _parsed(text: str):
    """The graph of ``text``. The printer writes a ``bool[]`` constant as numbers
    (``[0, 1, 1]``: ``convolution_backward``'s output mask), which the parser reads back as
    a list of ints typed ``bool[]``: such constants are made again from their values."""
    graph = torch._C.parse_ir(text)
    for node in list(graph.nodes()):
        if node.kind() == "prim::Constant" and str(node.output().type()) == "List[bool]":
            graph.setInsertPoint(node)
            fixed = graph.insertConstant([bool(v) for v in node.output().toIValue()])
            node.output().replaceAllUsesWith(fixed)
            node.destroy()
    return graph
