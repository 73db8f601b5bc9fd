"""Capture's autograd history, let go of once a graph is captured.

Capture runs the call's ops for real, so the example tensor of each node (``node.meta
["example"]``) carries the autograd history that made it, down to the ``AccumulateGrad``
node of every parameter it used. Autograd keeps one such node per leaf for as long as any
history refers to it, and that node remembers the leaf's shape *when it was made*: a
backward sums each gradient to that shape. Eager's history dies with the step; a cached
graph's examples kept it alive, so after ``bias.resize_(1, 2)`` the next capture's backward
(and every run of its graph) summed the bias's gradient to the old shape ``(2,)`` where eager
gives ``(1, 2)``, and the commit then failed to assign it.

``release`` keeps what later passes read of an example (shape, strides, dtype, device,
``requires_grad``) and drops its history. Backends read the history of a graph's outputs
once, for ``spent.py``; that answer is computed first and cached in ``gm.meta``. Graph inputs
keep their examples: they are the program's own tensors (their identity matters).
"""
from __future__ import annotations

import torch
import torch.fx

from .backends import spent_outputs


def release(gm: torch.fx.GraphModule) -> None:
    """Drop the autograd history of every example tensor computed in ``gm`` (and in the
    graph modules it holds: rolled loop bodies, whose inputs are computed too)."""
    if gm.meta.get("outputs_require_grad"):
        spent_outputs(gm)  # reads the outputs' history: answered now, kept in gm.meta
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if module is gm and node.op == "placeholder":
                continue
            example = node.meta.get("example")
            # (not ``grad_fn``: reading it raises on a view whose base was written in place)
            if isinstance(example, torch.Tensor) and example.requires_grad:
                node.meta["example"] = without_history(example)


def without_history(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data and metadata (the same storage), as a leaf with ``t.requires_grad``."""
    return t.detach().requires_grad_(t.requires_grad)
