"""``benchmarks/tiering.py --trace``: what tiering did during each slow step.

Wraps tiering's functions (those present: the set changes as tiering does) to record
``(start, end, what, thread)``; ``slowest`` matches the slowest steps while compiling with the
records that overlap each. Benchmark-only instrumentation: nothing here is part of specularch.
"""
from __future__ import annotations

import functools
import gc
import threading
import time

from specularch.tiering import history, job, process, trial, worker

MAIN = threading.main_thread().ident


class Trace:
    def __init__(self):
        self.records: list[list] = []  # [start, end, what, thread]
        self.settled: dict[int, float] = {}  # id(TierHistory) -> when it settled
        spans = [(process, "_run", "worker job"), (process, "_load", "artefact load"),
                 (worker, "warm_up", "warm-up"), (trial.Tier, "_submit", "submit"),
                 (process, "prestart", "prestart"), (job, "pack", "job pack"),
                 (process, "_Worker", "worker start"), (process, "_cached", "cache lookup"),
                 (trial.Tier, "_compile", "background job"), (trial.Trial, "__init__", "trial start"),
                 (trial.Trial, "call", "trial call"), (trial.Tier, "decide", "decision"),
                 (trial.Tier, "_next_trial", "next trial")]
        for owner, name, what in spans:
            if hasattr(owner, name):
                self._wrap(owner, name, what)
        add = history.TierHistory.add

        def add_logged(h, event):
            now = time.perf_counter()
            self.records.append([now, now, f"event: {event}", _thread()])
            return add(h, event)
        history.TierHistory.add = add_logged
        self._gc_start: float | None = None
        gc.callbacks.append(self._collection)

    def _collection(self, phase, info):
        """Python's garbage collections (a slow step may be one: nothing of tiering's)."""
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
        elif self._gc_start is not None and (info["generation"] == 2 or now - self._gc_start > 5e-4):
            self.records.append([self._gc_start, now, f"gc gen{info['generation']}", _thread()])
        if phase != "start":
            self._gc_start = None

    def _wrap(self, owner, name, what):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            record = [start, float("inf"), what, _thread()]  # open until it returns
            if what != "trial call":
                self.records.append(record)
            try:
                return fn(*args, **kwargs)
            finally:
                end = record[1] = time.perf_counter()
                if what == "trial call" and end - start > 0.002:
                    self.records.append(record)
                if what == "next trial" and args and getattr(args[0], "history", None) \
                        and args[0].history.settled:
                    self.settled.setdefault(id(args[0].history), end)
        setattr(owner, name, wrapped)

    def final_tier_at(self, histories) -> float | None:
        """When the last hot graph settled; None while one has candidates pending."""
        hot = [h for h in histories if h.submitted_at is not None]
        if not hot or not all(id(h) in self.settled for h in hot):
            return None
        return max(self.settled[id(h)] for h in hot)

    def slowest(self, rows, first, eager_s, count=8):
        """The ``count`` slowest steps while compiling, each with what overlapped it."""
        out = []
        for t, s, c in sorted((r for r in rows if r[2]), key=lambda r: -r[1])[:count]:
            start, end = first + t, first + t + s
            during = sorted({f"{what} [{thread}] {min(e, end) - max(b, start):.4f}s"
                             for b, e, what, thread in self.records
                             if b <= end and e >= start and what not in ("background job",)})
            out.append({"at_s": round(t, 3), "over_eager": round(s / eager_s, 1), "during": during})
        return out


def _thread() -> str:
    return "user" if threading.get_ident() == MAIN else "bg"
