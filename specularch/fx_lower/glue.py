"""A forward graph's compiled forward and backward (``_torch_joint.split``, each compiled
like a flattened graph) joined as one autograd node: the forward's outputs are the graph's
results, the tensors it saves are kept for the backward, whose gradients go to the inputs
that require grad, and outputs that are views of an input, of another output or of an
intermediate value (returned by the forward after the outputs, hidden from the program) are
made again from their bases. What AOT autograd's run-time wrappers do besides (input updates,
symbolic sizes, subclasses) is refused by the split, so this is all that is left:
on a small model those wrappers cost more than the compiled code saves (docs/tiering.md).
"""
from __future__ import annotations

from typing import Callable

import torch

from .passes import as_tensor_input
from .randomness import generator_states, restore_generators, same_generator_states


class Replay:
    """What a backward under ``create_graph`` runs again: the captured graph's ``fx`` code
    (``fn``). ``random``: the graph draws random numbers, so the call's forward saves the
    generators' states before and after it, and the replay runs from the first and must
    end at the second (the compiled forward draws eager's numbers, ``same_draws.py``), so
    that it draws the forward's numbers and leaves the program's generators as they are."""

    def __init__(self, fn: Callable, random: bool = False):
        self.fn, self.random = fn, random

    def __call__(self, *args):
        return self.fn(*args)


class Glued:
    """``forward`` and ``backward`` (compiled callables returning lists of tensors) joined
    by ``meta`` (``Split.meta``); called with the graph's inputs, returns its outputs.
    ``replay``: the captured graph's ``fx`` code (a ``Replay``, or a function that draws no
    random numbers), for a backward under ``create_graph`` (double backward, a gradient
    penalty), whose gradients must themselves carry history: the compiled backward's do
    not, so that backward runs the graph again with autograd (on the call's inputs,
    checked unchanged; from the generator states the call started with) and differentiates
    it (``_replayed``). None raises there."""

    def __init__(self, forward: Callable, backward: Callable, meta: dict,
                 replay: Callable | None = None):
        if replay is not None and not isinstance(replay, Replay):
            replay = Replay(replay)
        self.forward, self.backward, self.replay = forward, backward, replay
        self.random = replay is not None and replay.random
        self.outputs = meta["outputs"]
        # The intermediate bases: the forward's results after the outputs, their views made
        # again from them (aliases), themselves not returned
        self.bases = meta.get("bases", 0)
        self.base_layouts = [tuple(map(tuple, layout)) for layout in meta.get("base_layouts", ())]
        # The outputs (and bases) the autograd node returns (the others are views, made again
        # from their bases in ``__call__``: ``_torch_joint._aliases``); ``differentiable``
        # indexes these.
        self.direct = list(meta.get("direct", range(self.outputs)))
        self.aliases = [dict(a) for a in meta.get("aliases", ())]
        self.differentiable = list(meta["differentiable"])
        self.not_differentiable = [i for i in range(len(self.direct)) if i not in set(self.differentiable)]
        self.inputs = meta["inputs"]
        self.gradients = list(meta["gradients"])
        self.strides = [tuple(s) for s in meta["tangent_strides"]]
        self.passthrough = [tuple(p) for p in meta.get("passthrough", ())]
        # (saved tensors that are outputs: saved as the output object, _torch_joint._saved_outputs)
        self.saved_outputs = [tuple(p) for p in meta.get("saved_outputs", ())]
        self.converted = list(meta.get("converted", ()))  # number inputs, given as 0-d tensors
        self.numbers = list(meta.get("numbers", ()))  # number outputs, returned as 0-d tensors
        self.artefact_note = "; ".join(filter(None, (getattr(forward, "artefact_note", ""),
                                                     getattr(backward, "artefact_note", ""))))

    def saved(self, results) -> list:
        """What the backward reads: the forward's results after the outputs and bases, with
        each output it reads put in at its place (the forward does not return it twice:
        ``_torch_joint._drop_saved``), the object the program gets, so that changing it in
        place before the backward raises, as in eager."""
        rest = iter(results[self.outputs + self.bases:])
        outputs = dict(self.saved_outputs)
        count = len(results) - self.outputs - self.bases + len(outputs)
        return [results[outputs[k]] if k in outputs else next(rest) for k in range(count)]

    def _replayed(self, ctx, grads: tuple) -> list:
        """The inputs' gradients with history (``create_graph``), from the ``fx`` code run
        again on the call's inputs."""
        if self.replay is None:
            raise _not_twice("its graph's code was not kept")
        if any(a._version != v for a, v in zip(ctx.inputs, ctx.versions)):
            raise RuntimeError("one of the variables needed for gradient computation has been "
                               "modified by an inplace operation (a specularch graph's input, "
                               "read again for create_graph=True)")
        dropped = {i for i, _ in self.passthrough}
        with torch.enable_grad():
            every = self._replay(ctx)
            every = list(every) if isinstance(every, (list, tuple)) else [every]
            traced = [v for i, v in enumerate(every) if i not in dropped]
            traced += self._replayed_bases(traced)
            outputs = [traced[i] for i in self.direct]
            wanted = [ctx.given[i] for i in self.gradients]
            got = torch.autograd.grad([outputs[i] for i in self.differentiable], wanted,
                                      [grads[i] for i in self.differentiable],
                                      create_graph=True, allow_unused=True)
        return list(got)

    def _replay(self, ctx):
        """The graph's ``fx`` code run on the call's inputs; one that draws random numbers
        runs from the generator states its forward started with (the program's are put back
        after it) and must end where the forward did."""
        if not self.random:
            return self.replay(*ctx.given)
        before, after = ctx.draws
        now = generator_states()
        restore_generators(before)
        try:
            every = self.replay(*ctx.given)
            same = same_generator_states(generator_states(), after)
        finally:
            restore_generators(now)
        if not same:
            raise _not_twice("running its graph again did not draw the random numbers its "
                             "compiled forward drew")
        return every

    def _replayed_bases(self, traced: list) -> list:
        """The intermediate bases of the replayed outputs: the ``_base`` of a view made from
        each, where it has the layout the split traced (otherwise the replay cannot tell
        which tensor the base's gradient belongs to, and raises)."""
        bases = []
        for position, layout in enumerate(self.base_layouts, self.outputs):
            view = next(traced[a["output"]] for a in self.aliases if a.get("of") == position)
            base = view._base
            if base is None or (tuple(base.shape), base.stride()) != layout:
                raise _not_twice("an output is a view of a value it does not return, and "
                                 "running the graph again did not make that value as traced")
            bases.append(base)
        return bases

    def __call__(self, *args):
        given = args
        if self.converted:
            args = list(args)
            for i in self.converted:
                args[i] = as_tensor_input(args[i])
        out = [None] * (self.outputs + self.bases)
        for i, value in zip(self.direct, _Node.apply(self, given, *args)):
            out[i] = value
        for alias in self.aliases:  # (views of inputs, or of outputs or bases made above)
            base = args[alias["input"]] if "input" in alias else out[alias["of"]]
            if not alias["requires_grad"]:  # (e.g. ``w.detach()``: a view without history)
                base = base.detach()
            out[alias["output"]] = base.as_strided(alias["size"], alias["stride"],
                                                   base.storage_offset() + alias["offset"])
        del out[self.outputs:]  # (the bases)
        for output, position in self.passthrough:  # (in output order)
            out.insert(output, args[position])
        for i in self.numbers:
            out[i] = out[i].item()
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


def _not_twice(why: str) -> RuntimeError:
    return RuntimeError(f"specularch: this graph's compiled form cannot be differentiated twice "
                        f"({why}); optimize it with backend=\"fx\" (or exact=True) to use "
                        f"create_graph=True")


class _Pinned(torch.autograd.Function):
    """Gradients from the replay (``Glued._replayed``) made to hold the outputs the program
    has that eager's backward reads (``tanh``'s result): eager's gradients-with-history read
    them again in the next backward, so an in-place change of one in between raises there;
    the replay's history reads its own fresh copies, and this node's backward unpacks the
    program's, which raises as eager does."""

    @staticmethod
    def forward(ctx, count: int, *tensors):
        ctx.save_for_backward(*tensors[count:])
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        ctx.saved_tensors  # (the version check)
        return (None, *grads, *[None] * len(ctx.saved_tensors))

    @staticmethod
    def pin(gradients: list, outputs: list) -> list:
        pinned = [i for i, g in enumerate(gradients) if g is not None and g.requires_grad]
        if not outputs or not pinned:
            return gradients
        held = _Pinned.apply(len(pinned), *[gradients[i] for i in pinned], *outputs)
        gradients = list(gradients)
        for i, g in zip(pinned, held):
            gradients[i] = g
        return gradients


class _Node(torch.autograd.Function):
    @staticmethod
    def forward(ctx, glued: Glued, given: tuple, *args):
        # (for create_graph only: the states the replay starts from and must end at, _replay)
        before = generator_states() if glued.random else None
        results = glued.forward(*args)
        if before is not None:
            ctx.draws = before, generator_states()
        outputs = [results[i] for i in glued.direct]
        ctx.glued = glued
        saved = glued.saved(results)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*[outputs[i] for i in glued.not_differentiable])
        # (for create_graph only: references, and the versions to check them against)
        ctx.inputs, ctx.versions, ctx.given = args, [a._version for a in args], given
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        glued = ctx.glued
        if torch.is_grad_enabled():  # create_graph=True: gradients with history
            saved = ctx.saved_tensors  # (changed in place since: raises, as eager does)
            got = _Pinned.pin(glued._replayed(ctx, grads),
                              [saved[k] for k, _ in glued.saved_outputs])
        else:
            got = glued.backward(*ctx.saved_tensors, *glued.tangents(grads))
        out = [None] * (2 + glued.inputs)  # (none for glued, given)
        for position, gradient in zip(glued.gradients, got):
            out[2 + position] = gradient
        return tuple(out)
