"""Compiled graphs for every size of their dynamic dimensions.

A captured graph whose argument sizes varied keeps those dimensions dynamic
(``guards/relax.py``): its ``fx`` code computes with the sizes it is given. A compiling
backend traces it with those dimensions as symbols (``_torch_shapes``), so one compile serves
every size, except where the trace assumed something of them (sizes 0 and 1 are
specialised on, two sizes traced equal must stay equal, Inductor may assume more while it
compiles). Those assumptions become ``meta["size_guards"]``, checked before each call of the
compiled form; a call they do not hold for runs the captured graph's ``fx`` code, which
holds for every size.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import _torch_shapes


def dynamic_inputs(gm: torch.fx.GraphModule) -> dict[int, list[int]]:
    """``{graph input position: its dynamic dimensions}`` (capture's ``meta["dynamic_inputs"]``,
    pairs: it travels to the tiering worker as plain values). Empty where ``meta["fixed_sizes"]``
    says the graph is compiled for the sizes of its example inputs (a tiering worker's job,
    ``tiering/hot_sizes.py``)."""
    if gm.meta.get("fixed_sizes"):
        return {}
    return {int(i): list(dims) for i, dims in gm.meta.get("dynamic_inputs", ())}


def size_hints(gm: torch.fx.GraphModule) -> dict[int, tuple]:
    """``{graph input position: the shape its dynamic dims are traced at}`` (capture's
    ``meta["size_hints"]``: an earlier call's, a full batch rather than the short one)."""
    return {int(i): tuple(shape) for i, shape in gm.meta.get("size_hints", ())}


class SizeChecked:
    """``compiled`` where the call's sizes satisfy ``expression`` (``_torch_shapes.size_guards``),
    else ``fallback`` (the captured graph's ``fx`` code). ``misses`` counts the calls that
    ran the fallback. ``scope`` and ``note`` say what ``compiled`` was compiled for: every size
    of the graph's dynamic dimensions, or the sizes of most calls (``tiering/hot_sizes.py``)."""

    def __init__(self, compiled: Callable, expression: str, fallback: Callable,
                 scope: str = "every size",
                 note: str = "compiled for every size of its dynamic dimensions (explain's sizes line)"):
        self.compiled, self.expression, self.fallback = compiled, expression, fallback
        self.scope = scope  # what it was compiled for (explain's sizes line)
        self._holds = _torch_shapes.size_check(expression)
        self.misses = 0
        self.artefact_note = "; ".join(filter(None, [getattr(compiled, "artefact_note", ""), note]))
        if hasattr(compiled, "warm_calls"):
            self.warm_calls = compiled.warm_calls

    def __call__(self, *args):
        if self._holds(args):
            return self.compiled(*args)
        self.misses += 1
        return self.fallback(*args)


def checked(compiled: Callable, meta: dict, fallback: Callable | None) -> Callable:
    """``compiled`` (made from a graph whose flattening returned ``meta``), size-checked where
    it was compiled for dynamic sizes. Raises without a ``fallback`` then: the compiled form
    alone would run on sizes it was not traced for."""
    expression = meta.get("size_guards")
    if not expression:
        return compiled
    if fallback is None:
        raise ValueError("a graph compiled for dynamic sizes needs its fx code for the sizes "
                         "its trace did not hold for")
    return SizeChecked(compiled, expression, fallback)


def describe(graph_fn: Callable, inputs: list[str]) -> str:
    """``explain()``'s line for a graph's compiled form, where it is size-checked (also each
    compile per value of a number, ``specialise.PerValue``); ``inputs``: where each graph
    input is read from, as the report names them."""
    forms = _size_checked(graph_fn)
    if not forms:
        return ""
    chain = _chain(forms[0])
    if len(chain) > 1:  # forms for a few common sizes (tiering/hot_sizes.checked)
        where = " | ".join(_torch_shapes.named(f.expression, inputs) for f in chain)
        count, misses = f" ({len(chain)} compiles, one per size)", chain[-1].misses
    else:
        where = " | ".join(dict.fromkeys(_torch_shapes.named(f.expression, inputs) for f in forms))
        count = f" ({len(forms)} compiles, one per value of a number)" if len(forms) > 1 else ""
        misses = sum(f.misses for f in forms)
    return f"compiled for {forms[0].scope} where {where}{count}; {misses} call(s) outside ran fx"


def _chain(form: SizeChecked) -> list[SizeChecked]:
    """``form`` and the forms its other sizes go to, in turn (the last one's misses ran fx)."""
    chain = [form]
    while isinstance(chain[-1].fallback, SizeChecked):
        chain.append(chain[-1].fallback)
    return chain


def _size_checked(graph_fn: Callable) -> list[SizeChecked]:
    graph_fn = getattr(graph_fn, "wrapped", graph_fn)  # same_draws.FirstCallsChecked
    if isinstance(graph_fn, SizeChecked):
        return [graph_fn]
    per_value = getattr(graph_fn, "compiled", None)  # specialise.PerValue: compiles by value
    if isinstance(per_value, dict):
        return [f for f in per_value.values() if isinstance(f, SizeChecked)]
    return []
