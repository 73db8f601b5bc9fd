"""Spent history: tensors a flattened training step returns or stores whose autograd history
eager's own backward has already used up.

A graph with an in-graph backward is compiled as one ATen graph without autograd
(``_torch_compilers.flatten``), so what it returns has no history. Eager's results do: the
LSTM LM's step stores its last hidden state on ``self``, and returns its loss, both with a
``grad_fn``. That history is unusable when the root node of it was run by the step's own
``loss.backward()`` (no ``retain_graph``: its saved tensors are freed): any later backward
through the tensor (``h.backward()``, or a next step that uses ``h`` without detaching it)
runs into such a node and raises "Trying to backward through the graph a second time".
When every path from the tensor to a leaf passes such a node, and the nodes before them are
built-in ones (they compute gradients, nothing else), that error is all a backward can do.

Such a tensor is returned as the compiled value behind a ``SpentBackward`` node that raises
that same error, linked to the same leaves (so ``autograd.grad(h, [p])`` raises too instead of
answering "unused"): ``requires_grad``, ``is_leaf``, a non-None ``grad_fn`` and every backward
behave as eager's; only the node's type name differs. A tensor whose history can still run
(``retain_graph``, ``p * 2`` of a parameter ``p``, a custom ``autograd.Function``'s node,
a leaf) keeps the graph on a backend with autograd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

_FREED = "Trying to backward through the graph a second time"


@dataclass(frozen=True)
class SpentOutput:
    index: int  # position in the graph's outputs
    leaves: tuple[int, ...]  # graph inputs eager's history reaches (its AccumulateGrad nodes)
    message: str  # eager's error, word for word


class Spent(torch.autograd.Function):
    """The compiled value, with a history whose backward raises eager's error."""

    @staticmethod
    def forward(ctx, message, value, *leaves):
        ctx.message = message
        return value.detach()  # not a view: in-place ops on it work as on eager's tensor

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def plan(gm: torch.fx.GraphModule, value_outputs) -> list[SpentOutput] | str:
    """For each output in ``value_outputs`` (positions the program sees as tensors) that
    requires grad, how to give it eager's spent history; or why one cannot have it."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    inputs = {id(n.meta.get("example")): i for i, n in
              enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    spent = []
    for index in sorted(value_outputs):
        example = output.args[0][index].meta.get("example")
        if not isinstance(example, torch.Tensor) or not example.requires_grad:
            continue
        found = _spent(example, inputs)
        if isinstance(found, str):
            return f"output {index} {found}"
        spent.append(SpentOutput(index, *found))
    return spent


def _spent(example: torch.Tensor, inputs: dict) -> tuple[tuple[int, ...], str] | str:
    root = example.grad_fn
    if root is None:
        return "is a tensor that requires grad from outside the graph"
    message = _first_freed(root)
    if not message.startswith(_FREED):
        return message
    leaves = _reachable_leaves(root, inputs)
    if leaves is None:
        return "has a history that reaches tensors from outside the graph"
    return leaves, message


def _first_freed(root) -> str:
    """Eager's error when a backward through ``root`` runs, or why it could do something
    first. Capture ran the graph's ops for real, so the nodes are in the state eager's run
    leaves them in. A backward runs the nodes below ``root`` until one of them finds its
    saved tensors freed; it has done nothing observable by then if every node it can run
    before is a built-in one (it computes gradients, nothing else) and no leaf's gradient
    could be accumulated before (every path to a leaf passes a freed node)."""
    seen, pending, message = set(), [root], None
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        freed = _freed_message(node)
        if freed is not None:
            message = freed
            continue
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return "has a history through a custom autograd.Function (its backward is user code)"
        if hasattr(node, "variable"):  # AccumulateGrad
            return "has a history that a later backward could still run"
        pending.extend(next_node for next_node, _ in node.next_functions)
    return message or "has a history that a later backward could still run"


def _freed_message(node) -> str | None:
    """The error a built-in node raises when it runs with its saved tensors freed (its
    generated ``apply`` unpacks every saved value first), or None."""
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                getattr(node, name)
            except RuntimeError as error:
                if _FREED in str(error):
                    return str(error)
    return None


def _reachable_leaves(root, inputs: dict) -> tuple[int, ...] | None:
    """The graph inputs eager's history of ``root`` ends in; None when it reaches others."""
    seen, pending, leaves = set(), [root], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            if id(variable) not in inputs:
                return None
            leaves.add(inputs[id(variable)])
        pending.extend(next_node for next_node, _ in node.next_functions)
    return tuple(sorted(leaves))


def attach(spent: list[SpentOutput], compiled: Callable) -> Callable:
    """``compiled`` (a flattened graph's runner) with its spent outputs given their history."""
    if not spent:
        return compiled

    def run(*args):
        outputs = list(compiled(*args))
        with torch.enable_grad():
            for s in spent:
                outputs[s.index] = Spent.apply(s.message, outputs[s.index],
                                                       *(args[i] for i in s.leaves))
        return outputs

    run.__dict__.update(getattr(compiled, "__dict__", {}))  # e.g. compile_cache's mark
    return run
