"""``optimize(..., exact=True)``: results bit-identical to eager. Such a state is pinned to
``fx`` (the same kernels as eager, no tiering), and recursion templates and rolled loops run
in eager's exact order (``templates="exact"``) for it alone, whatever ``config.templates``
says for the rest of the program: while it is captured and, for graphs that call a template,
while they run (the template's run reads the mode)."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

from ..config import config


def capturing(state):
    """Around a capture of ``state``."""
    if not state.exact or config.templates != "batched":  # "off" unrolls: exact too
        return contextlib.nullcontext()
    return config.patch(templates="exact")


def entry(state, gm, fn: Callable) -> Callable:
    """``fn`` (an entry function of ``gm``), running its templates in exact order if
    ``state`` is exact."""
    if not state.exact or not any(n.meta.get("template_family") is not None
                                  for n in gm.graph.nodes):
        return fn

    @functools.wraps(fn)
    def exact_entry(L, C, G, B):
        if config.templates != "batched":
            return fn(L, C, G, B)
        with config.patch(templates="exact"):
            return fn(L, C, G, B)
    return exact_entry
