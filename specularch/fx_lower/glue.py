"""A forward graph's compiled forward and backward (``_torch_joint.split``, each compiled
like a flattened graph) joined as one autograd node: the forward's outputs are the graph's
results, the tensors it saves are kept for the backward, whose gradients go to the inputs
that require grad, and outputs that are views of an input or of another output are made again
from their bases. What AOT autograd's run-time wrappers do besides (input updates, views of
intermediates, symbolic sizes, subclasses) is refused by the split, so this is all that is left:
on a small model those wrappers cost more than the compiled code saves (docs/tiering.md).
"""
from __future__ import annotations

from typing import Callable

import torch

from .passes import as_tensor_input


class Glued:
    """``forward`` and ``backward`` (compiled callables returning lists of tensors) joined
    by ``meta`` (``Split.meta``); called with the graph's inputs, returns its outputs.
    ``replay``: the captured graph's ``fx`` code, for a backward under ``create_graph``
    (double backward, a gradient penalty), whose gradients must themselves carry history:
    the compiled backward's do not, so that backward runs the graph again with autograd
    (on the call's inputs, checked unchanged) and differentiates it (``_replayed``). None
    (a graph that draws random numbers: a second run would draw others) raises there."""

    def __init__(self, forward: Callable, backward: Callable, meta: dict,
                 replay: Callable | None = None):
        self.forward, self.backward, self.replay = forward, backward, replay
        self.outputs = meta["outputs"]
        # The outputs the autograd node returns (the others are views, made again from their
        # bases in ``__call__``: ``_torch_joint._aliases``); ``differentiable`` indexes these.
        self.direct = list(meta.get("direct", range(self.outputs)))
        self.aliases = [dict(a) for a in meta.get("aliases", ())]
        self.differentiable = list(meta["differentiable"])
        self.not_differentiable = [i for i in range(len(self.direct)) if i not in set(self.differentiable)]
        self.inputs = meta["inputs"]
        self.gradients = list(meta["gradients"])
        self.strides = [tuple(s) for s in meta["tangent_strides"]]
        self.passthrough = [tuple(p) for p in meta.get("passthrough", ())]
        self.converted = list(meta.get("converted", ()))  # number inputs, given as 0-d tensors
        self.artefact_note = "; ".join(filter(None, (getattr(forward, "artefact_note", ""),
                                                     getattr(backward, "artefact_note", ""))))

    def _replayed(self, ctx, grads: tuple) -> list:
        """The inputs' gradients with history (``create_graph``), from the ``fx`` code run
        again on the call's inputs."""
        if self.replay is None:
            raise RuntimeError(
                "specularch: this graph's compiled form cannot be differentiated twice (its "
                "graph draws random numbers, which a second run would draw differently); "
                "optimize it with backend=\"fx\" (or exact=True) to use create_graph=True")
        if any(a._version != v for a, v in zip(ctx.inputs, ctx.versions)):
            raise RuntimeError("one of the variables needed for gradient computation has been "
                               "modified by an inplace operation (a specularch graph's input, "
                               "read again for create_graph=True)")
        dropped = {i for i, _ in self.passthrough}
        with torch.enable_grad():
            every = self.replay(*ctx.given)
            every = list(every) if isinstance(every, (list, tuple)) else [every]
            traced = [v for i, v in enumerate(every) if i not in dropped]
            outputs = [traced[i] for i in self.direct]
            wanted = [ctx.given[i] for i in self.gradients]
            got = torch.autograd.grad([outputs[i] for i in self.differentiable], wanted,
                                      [grads[i] for i in self.differentiable],
                                      create_graph=True, allow_unused=True)
        return list(got)

    def __call__(self, *args):
        given = args
        if self.converted:
            args = list(args)
            for i in self.converted:
                args[i] = as_tensor_input(args[i])
        out = [None] * self.outputs
        for i, value in zip(self.direct, _Node.apply(self, given, *args)):
            out[i] = value
        for alias in self.aliases:  # (views of inputs, or of outputs made above)
            base = args[alias["input"]] if "input" in alias else out[alias["of"]]
            if not alias["requires_grad"]:  # (e.g. ``w.detach()``: a view without history)
                base = base.detach()
            out[alias["output"]] = base.as_strided(alias["size"], alias["stride"],
                                                   base.storage_offset() + alias["offset"])
        for output, position in self.passthrough:  # (in output order)
            out.insert(output, args[position])
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
    def forward(ctx, glued: Glued, given: tuple, *args):
        results = glued.forward(*args)
        outputs = [results[i] for i in glued.direct]
        ctx.glued = glued
        ctx.save_for_backward(*results[glued.outputs:])
        ctx.mark_non_differentiable(*[outputs[i] for i in glued.not_differentiable])
        # (for create_graph only: references, and the versions to check them against)
        ctx.inputs, ctx.versions, ctx.given = args, [a._version for a in args], given
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        glued = ctx.glued
        if torch.is_grad_enabled():  # create_graph=True: gradients with history
            got = glued._replayed(ctx, grads)
        else:
            got = glued.backward(*ctx.saved_tensors, *glued.tangents(grads))
        out = [None] * (2 + glued.inputs)  # (none for glued, given)
        for position, gradient in zip(glued.gradients, got):
            out[2 + position] = gradient
        return tuple(out)
