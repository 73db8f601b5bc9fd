"""A forward graph's compiled forward and backward (``_torch_joint.split``, each compiled
like a flattened graph) joined as one autograd node: the forward's outputs are the graph's
results, the tensors it saves are kept for the backward, whose gradients go to the inputs
that require grad. What AOT autograd's run-time wrappers do besides (input updates, aliased
outputs, symbolic sizes, subclasses) is refused by the split, so this is all that is left:
on a small model those wrappers cost more than the compiled code saves (docs/tiering.md).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable


class Glued:
    """``forward`` and ``backward`` (compiled callables returning lists of tensors) joined
    by ``meta`` (``Split.meta``); called with the graph's inputs, returns its outputs."""

    def __init__(self, forward: Callable, backward: Callable, meta: dict):
        self.forward, self.backward = forward, backward
        self.outputs = meta["outputs"]
        self.differentiable = list(meta["differentiable"])
        self.not_differentiable = [i for i in range(self.outputs) if i not in set(self.differentiable)]
        self.inputs = meta["inputs"]
        self.gradients = list(meta["gradients"])
        self.strides = [tuple(s) for s in meta["tangent_strides"]]
        self.passthrough = [tuple(p) for p in meta.get("passthrough", ())]
        self.artefact_note = "; ".join(filter(None, (getattr(forward, "artefact_note", ""),
                                                     getattr(backward, "artefact_note", ""))))

    def __call__(self, *args):
        out = list(_Node.apply(self, *args))
        for output, given in self.passthrough:  # (in output order)
            out.insert(output, args[given])
        return out

    def tangents(self, grads: tuple) -> list:
        """The differentiable outputs' gradients in the layout the backward was traced for
        (a ``sum().backward()`` gives an expanded one: strides of 0)."""
        out = []
        for i, stride in zip(self.differentiable, self.strides):
            g = grads[i]
            if g.stride() != stride:
                g = torch.empty_strided(g.shape, stride, dtype=g.dtype, device=g.device).copy_(g)
            out.append(g)
        return out


class _Node(torch.autograd.Function):
    @staticmethod
    def forward(ctx, glued: Glued, *args):
        results = glued.forward(*args)
        outputs = results[:glued.outputs]
        ctx.glued = glued
        ctx.save_for_backward(*results[glued.outputs:])
        ctx.mark_non_differentiable(*[outputs[i] for i in glued.not_differentiable])
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        glued = ctx.glued
        got = glued.backward(*ctx.saved_tensors, *glued.tangents(grads))
        out = [None] * (1 + glued.inputs)
        for position, gradient in zip(glued.gradients, got):
            out[1 + position] = gradient
        return tuple(out)
