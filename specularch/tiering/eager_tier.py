"""The eager tier: a graph's path run as the original Python when that is measured faster.

A captured graph is not always faster than the program it replaces: where the kernels are
the whole cost (a large softmax, a CNN step), ``fx`` runs eager's kernels plus guards and a
commit, and a compiled candidate may lose too. So the last candidate of every hot graph is
``eager``: calls whose guards pass (this graph's path) run the original bytecode instead of
the graph, exactly as a fallback does (the frame hook on for nested optimized calls; no
fallback is recorded or warned about: it is a choice). Its trial times the guard check and
the run of the original together, against the current tier's guards, graph and commit; it
is kept only when faster by the trial's margin, like any candidate. An eager run leaves the
program's state exactly as eager does, so choosing it changes nothing but the time.

The run itself happens after the entry function returns (the dispatcher's caller runs the
``EagerRun`` token in its own frame, ``eager_run.py``), so the token carries a ``timer``
whose ``start``/``stop`` bracket it.
"""
from __future__ import annotations

from typing import Callable

from ..entry_function import MISS
from ..eager_run import EagerRun

EAGER = "eager"  # the candidate's name in the tier history and explain()


class _Untimed:
    """The timer of the eager tier's runs once it is kept: nothing to measure."""

    __slots__ = ()

    def start(self) -> None:
        pass

    def stop(self, result=None) -> None:
        pass


UNTIMED = _Untimed()


class EagerChoice:
    """The eager tier's entry function: ``MISS`` when the graph's guards fail (another path),
    else an ``EagerRun`` of the original for the caller to run (a trial replaces its
    ``timer`` before the caller runs it)."""

    def __init__(self, check: Callable, target):
        self.check, self.target = check, target

    def __call__(self, L, C, G, B):
        if not self.check(L, C, G, B):
            return MISS
        return EagerRun(None, self.target, C, UNTIMED)


class RunTimer:
    """Times one eager run of a trial: ``start`` when the original starts, ``stop(result)``
    when it returned; ``record(seconds)`` gets the run's time plus ``before`` (the guard
    check's), unless ``backward(seconds, result)`` takes it (a forward graph's trial: the
    run's backward is timed too, ``backward_timing.py``) and returns True."""

    __slots__ = ("clock", "before", "record", "began", "backward")

    def __init__(self, clock: Callable[[], float], before: float, record: Callable[[float], None],
                 backward: Callable[[float, object], bool] | None = None):
        self.clock, self.before, self.record, self.backward = clock, before, record, backward
        self.began = None

    def start(self) -> None:
        self.began = self.clock()

    def stop(self, result=None) -> None:
        if self.began is None:
            return
        seconds = self.before + self.clock() - self.began
        if self.backward is None or not self.backward(seconds, result):
            self.record(seconds)


def eager_choice(guards, target) -> EagerChoice:
    """The eager tier of a graph with ``guards`` (a ``GuardSet``) of optimized ``target``."""
    return EagerChoice(guards.compile(), target)
