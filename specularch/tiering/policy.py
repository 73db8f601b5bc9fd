"""When a graph is compiled in the background, by which backends, and when a candidate wins.

A graph is *hot* once it ran ``config.tier_min_hits`` times and its calls took
``config.tier_min_seconds`` in all: before that a compile cannot pay off (and the small graphs
of tests stay on ``fx``, bit-identical to eager). Its candidates are the compiling backends
that take it (``supports``), cheapest compile first, so that a quick win comes early.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..config import config
from ..fx_lower import get_backend
from ..fx_lower.backends import autograd_forward
from ..fx_lower.randomness import graph_uses_randomness
from . import process
from .eager_tier import EAGER

AUTO = "auto"  # the tiered mode's backend name (registered in fx_lower/backends.py)
TIER0 = "fx"
# Cheapest compile first; last, "eager": the graph's path run as the original Python
# (eager_tier.py), kept only when measured faster than the graph's best tier, so that the
# default is never slower than eager by more than a trial's margin.
CANDIDATES = ("torchscript", "inductor", "cudagraphs", EAGER)
MARGIN = 0.05   # a candidate is kept only when its median is this much below the current one
ROUNDS = 3      # interleaved rounds of a trial: config.tier_trial_calls calls per side each
# A candidate measured faster after ROUNDS, but by less than MARGIN, gets more rounds, up to
# this many in all, before it is rejected: on the shared 2-core VM one call's CPU time varies
# by +-30%, and after 3 rounds of 5 calls TorchScript's 17% win on LeNet's step measured 3%
# in one run and 13-22% in others. One that measured slower is rejected after ROUNDS.
MAX_ROUNDS = 9
WARM_UP = 3     # a candidate's first calls, not timed (TorchScript's profiling runs)
# A candidate whose first round's median is this many times the current tier's is rejected
# then: each further call of it would slow the program down (Inductor on LeNet: 0.5x eager).
HOPELESS = 1.5
# A candidate rejected in a graph's trial is not compiled or timed again in the next this many
# runs of the program (remembered.py, in the compile cache); then it is tried again.
REMEMBER_RUNS = 3
# Backends whose compile (flattened or through AOT autograd: fake tensors, never run) draws no
# random numbers
FAKE_TRACED = ("torchscript", "inductor")


def clock() -> Callable[[], float]:
    """What a trial times calls with: this thread's CPU time when torch computes on this
    thread alone (one thread, no GPU), so that a call preempted by other jobs on a busy
    machine costs no more than it computed (on the team's 2-core VM at load 8 a tiny step
    measured 138 ms of wall time, and trials decided on the noise); wall time otherwise,
    where the work of torch's other threads, or of a GPU, is not this thread's CPU time."""
    if torch.get_num_threads() == 1 and not torch.cuda.is_initialized():
        return time.thread_time
    return time.perf_counter


def times_backward(gm: torch.fx.GraphModule) -> bool:
    """Whether a trial of ``gm`` times each call with its backward (``backward_timing.py``):
    a forward graph whose results need autograd, the backward left to the program."""
    return autograd_forward(gm)


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
    if name == EAGER:
        return None  # (the original Python: always eager's results)
    return get_backend(name).supports(gm) or (
        _random_refusal(name, gm) if graph_uses_randomness(gm) else None)


def _random_refusal(name: str, gm: torch.fx.GraphModule) -> str | None:
    """Why a graph that draws random numbers cannot be compiled in the background by
    ``name``, or None. The global generator is shared by every thread of the program: its
    compile must neither draw from it nor set its state (AOT autograd and Inductor save and
    restore it around tracing) while the program draws. In a worker process neither can
    happen; on the compile thread the state is never set (``background_tracing``), and both
    forms are traced with fake tensors and never run, so they draw nothing: the flattened
    one, and AOT autograd's, whose forward and backward compilers get fake inputs (so
    ``ts_compile`` does not run its graph; ``tests/test_tiering_random.py`` checks both).
    Rolled loops' bodies are compiled on a warm-up run, which a graph that draws is not
    given. The compiled graph itself must draw eager's numbers: checked in its trial
    (``same_draws.py``)."""
    if process.ENABLED and process.route(name, gm) is None:
        return None
    if name in FAKE_TRACED and not gm.meta.get("rolled_loops"):
        return None
    return ("the graph draws random numbers, and compiling its form beside the running "
            "program could draw from the program's generator")


def faster(candidate_us: float, current_us: float) -> bool:
    return candidate_us < current_us * (1 - MARGIN)


def undecided(candidate_us: float, current_us: float) -> bool:
    """Faster, but not by ``MARGIN``: worth more rounds (``MAX_ROUNDS``)."""
    return candidate_us < current_us and not faster(candidate_us, current_us)


def hopeless(candidate_us: float, current_us: float) -> bool:
    """Rejected after one round: far slower, and not ``faster`` either."""
    return candidate_us > current_us * HOPELESS and not faster(candidate_us, current_us)
