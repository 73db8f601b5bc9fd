"""Tiered execution, the default (``backend="auto"``): every graph runs at once with ``fx``;
a hot one is compiled in the background by the compiling backends that take it, each
candidate is timed on live calls against the current tier and kept only if faster.

* ``policy.py`` — when a graph is hot, its candidates, when one wins;
* ``worker.py`` — the background compile thread; ``wait()`` for tests and benchmarks;
* ``process.py``, ``job.py``, ``compile_worker.py`` — that thread's compiles run in a worker
  process: the job file, the child's entry point, loading what it compiled;
* ``trial.py`` — the per-graph ``Tier`` (counting, trials, swapping the entry's function);
* ``hot_sizes.py`` — a graph with dynamic sizes compiled for those of most calls (or one form per few common sizes);
* ``remembered.py`` — rejections kept in the compile cache for the next runs;
* ``history.py`` — what ``explain()`` shows of each graph's tiers.
"""
from __future__ import annotations

from .eager_tier import eager_choice
from .history import RAISED, TierEvent, TierHistory
from .policy import AUTO, TIER0, tiered
from .trial import Tier
from . import worker
from .worker import pending, wait

__all__ = ["AUTO", "TierHistory", "eager_choice", "first_tier", "pending", "ran_back_to_fx", "tiered", "wait",
           "watch"]


def first_tier(backend: str) -> str:
    """The backend a new graph is compiled with: ``fx`` in the tiered mode."""
    return TIER0 if tiered(backend) else backend


def watch(entry, gm, build, eager=None) -> None:
    """Put ``entry`` (a fresh ``fx`` graph entry) under tiering; ``build(graph_fn)`` gives
    the entry function and its source for another compiled form of ``gm``; ``eager()`` the
    eager tier's (``eager_tier.EagerChoice``), None where the path may not run eagerly."""
    Tier(entry, gm, build, eager)
    worker.start()  # now, in the capture's call, rather than in a later step


def ran_back_to_fx(entry, replacement, error: Exception) -> None:
    """``replacement`` (``fx``) took over from ``entry``, whose kept candidate raised at run
    time: it keeps the history, says so, and is not tiered again."""
    history = getattr(entry, "tier", None)
    if history is None:
        return
    history.add(TierEvent(entry.backend, RAISED, reason=f"{type(error).__name__}: {error}; "
                                                        f"back to fx"))
    history.tier, history.settled = TIER0, True
    replacement.tier = history
