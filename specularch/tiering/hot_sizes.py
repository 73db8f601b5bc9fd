"""A graph with dynamic sizes, compiled for the sizes most of its calls have.

A training loop's batch dimension becomes dynamic at its first short batch (a ``DataLoader``'s
last batch of an epoch, without ``drop_last``: ``guards/relax.py``), and from then on one
graph runs every size. The worker process compiles a forward graph whose results need
autograd as its forward and backward (``fx_lower/split.py``), traced for fixed sizes: one
with dynamic sizes compiled instead through AOT autograd for every size, on the program's
background thread, holding the GIL for seconds beside the program's steps (a transformer's
forward: steps up to 113x eager's, docs/tiering.md). A flattened graph (a whole step)
compiled in the worker for every size, symbolically.

Yet most calls have one size, or one of a few. While a graph is not yet hot, its ``Tier``
counts the sizes of its dynamic dimensions on each call (``SizeCount``, wrapped around the
``fx`` code; gone once the graph is hot). Where one set of sizes is at least ``SHARE`` of
those calls, or a few (at most ``MAX_FORMS``, each ``FORM_SHARE`` of them: an LSTM's few
sequence lengths) are together (``SizeCount.common``), each candidate the worker compiles is
compiled for each of those sizes (``examples``; the job says ``fixed_sizes``) and the call's
sizes pick the form (``checked``): a call of other sizes (the short batch) runs the graph's
``fx`` code, which computes any size. Elsewhere (sizes that vary from call to call) the
candidates compile for every size as before.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from ..fx_lower import compile_cache
from ..fx_lower.dynamic_sizes import SizeChecked, dynamic_inputs
from ..fx_lower.passes import example_inputs

SHARE = 0.5  # the share of the counted calls the sizes compiled for must have
MAX_FORMS = 4  # fixed-size forms of one graph at most (one compile each)
FORM_SHARE = 0.1  # the counted calls a size needs for a form of its own, where none has SHARE


class SizeCount:
    """``graph_fn`` (the graph's ``fx`` code), counting the sizes of the dimensions
    ``dynamic`` (``{input position: dimensions}``) of its calls' inputs."""

    def __init__(self, graph_fn: Callable, dynamic: dict[int, list[int]]):
        self.graph_fn = graph_fn
        self.dims = _dims(dynamic)
        self.counts: Counter = Counter()

    def __call__(self, *args):
        self.counts[tuple(args[i].shape[d] for i, d in self.dims)] += 1
        return self.graph_fn(*args)

    def summary(self) -> str:
        """What was counted, for ``explain()`` where no sizes were most calls'."""
        total = sum(self.counts.values())
        return f"{len(self.counts)} different sizes in {total} calls, the commonest in " \
               f"{max(self.counts.values(), default=0)}"

    def common(self) -> list[tuple[int, ...]] | None:
        """The sizes (each one per counted dimension, in ``dims`` order) to compile
        fixed-size forms for: those of at least ``SHARE`` of the
        counted calls (one form); else the commonest sizes, at most ``MAX_FORMS``, each of
        at least ``FORM_SHARE`` of the calls (and seen twice), if together they have ``SHARE`` of them (a
        few sequence lengths, bucketed batches: one form each); None where no such few do
        (sizes that vary from call to call: candidates compile for every size)."""
        total = sum(self.counts.values())
        top = self.counts.most_common(MAX_FORMS)
        if top and top[0][1] >= SHARE * total:
            return [top[0][0]]
        chosen = [(sizes, n) for sizes, n in top if n >= max(FORM_SHARE * total, 2)]
        return [sizes for sizes, _ in chosen] \
            if chosen and sum(n for _, n in chosen) >= SHARE * total else None


def counted(gm: torch.fx.GraphModule) -> dict[int, list[int]] | None:
    """The dynamic dimensions to count on ``gm``'s calls: those of a graph with dynamic
    sizes that a worker process compiles for fixed ones (``process.route``), whose dynamic
    inputs are contiguous tensors (a fixed-size compile of them is then checked by size and
    contiguity alone); None for any other graph."""
    from . import process
    dynamic = dynamic_inputs(gm)
    if not dynamic or process.route(process.BACKENDS[0], gm, fixed_sizes=True) is not None:
        return None
    examples = example_inputs(gm)
    if any(not isinstance(examples[i], torch.Tensor) or not examples[i].is_contiguous() for i in dynamic):
        return None
    return dynamic


def examples(gm: torch.fx.GraphModule, sizes: tuple[int, ...]) -> list:
    """``gm``'s example inputs with its dynamic dimensions of ``sizes`` (``SizeCount``'s
    order): each dynamic input replaced by zeros of those sizes (contiguous, its dtype,
    device and ``requires_grad``)."""
    out = list(example_inputs(gm))
    for i, shape in _shapes(gm, sizes).items():
        value = out[i]
        out[i] = torch.zeros(shape, dtype=value.dtype, device=value.device,
                             requires_grad=value.requires_grad)
    return out


def expression(gm: torch.fx.GraphModule, sizes: tuple[int, ...]) -> str:
    """What a call's inputs must be for ``gm``'s form compiled for ``sizes`` (a size-guard
    expression over ``L['t<i>']``, ``fx_lower/dynamic_sizes``): each dynamic dimension of
    its size, each dynamic input contiguous (as traced). The graph's own guards check the
    rest of every input's layout."""
    dynamic = dynamic_inputs(gm)
    terms = [f"L['t{i}'].size()[{d}] == {n}" for (i, d), n in zip(_dims(dynamic), sizes)]
    return " and ".join(terms + [f"L['t{i}'].is_contiguous()" for i in sorted(dynamic)])


def checked(forms: list[tuple[tuple[int, ...], Callable]], gm: torch.fx.GraphModule) -> Callable:
    """``forms`` (``(sizes, gm compiled for them)`` pairs, commonest first): a call runs the
    first whose sizes its inputs have, else ``gm``'s ``fx`` code (a chain of
    ``SizeChecked``); cached in the compile cache's sense where every form was."""
    scope, note = ("the sizes of most calls", "compiled for the sizes of most calls") \
        if len(forms) == 1 else (f"the {len(forms)} commonest sizes",
                                 f"compiled for the {len(forms)} commonest sizes")
    out = gm.forward
    for sizes, compiled in reversed(forms):
        out = SizeChecked(compiled, expression(gm, sizes), out, scope=scope,
                          note=f"{note}, others run fx (explain's sizes line)")
    if all(compile_cache.from_cache(compiled) for _, compiled in forms):
        compile_cache.mark_cached(out)
    return out


def _dims(dynamic: dict[int, list[int]]) -> list[tuple[int, int]]:
    return [(i, d) for i, dims in sorted(dynamic.items()) for d in dims]


def _shapes(gm: torch.fx.GraphModule, sizes: tuple[int, ...]) -> dict[int, list[int]]:
    inputs, dynamic = example_inputs(gm), dynamic_inputs(gm)
    shapes = {i: list(inputs[i].shape) for i in dynamic}
    for (i, d), n in zip(_dims(dynamic), sizes):
        shapes[i][d] = n
    return shapes
