"""When a graph is compiled in the background, by which backends, and when a candidate wins.

A graph is *hot* once it ran ``config.tier_min_hits`` times and its calls took
``config.tier_min_seconds`` in all: before that a compile cannot pay off (and the small graphs
of tests stay on ``fx``, bit-identical to eager). Its candidates are the compiling backends
that take it (``supports``), cheapest compile first, so that a quick win comes early.
"""
from __future__ import annotations

import torch

from ..config import config
from ..fx_lower import get_backend
from ..fx_lower.randomness import graph_uses_randomness

AUTO = "auto"  # the tiered mode's backend name (registered in fx_lower/backends.py)
TIER0 = "fx"
CANDIDATES = ("torchscript", "inductor", "cudagraphs")  # cheapest compile first
MARGIN = 0.05   # a candidate is kept only when its median is this much below the current one
ROUNDS = 3      # interleaved rounds of a trial: config.tier_trial_calls calls per side each
WARM_UP = 3     # a candidate's first calls, not timed (TorchScript's profiling runs)


def tiered(backend: str) -> bool:
    return backend == AUTO


def hot(hits: int, seconds: float) -> bool:
    return hits >= config.tier_min_hits and seconds >= config.tier_min_seconds


def candidates(gm: torch.fx.GraphModule) -> list[tuple[str, str | None]]:
    """``(backend, why it is refused or None)`` for each candidate of ``gm``."""
    out = []
    for name in CANDIDATES:
        if name == "cudagraphs" and not torch.cuda.is_available():
            continue
        out.append((name, _refusal(name, gm)))
    return out


def _refusal(name: str, gm: torch.fx.GraphModule) -> str | None:
    if graph_uses_randomness(gm):  # see backends.compile_in_background
        return ("the graph draws random numbers: compiling it beside the running program "
                "could not keep the generators' state apart")
    return get_backend(name).supports(gm)


def faster(candidate_us: float, current_us: float) -> bool:
    return candidate_us < current_us * (1 - MARGIN)
