"""What tiering did with one graph, for ``explain()``: each candidate backend, what its compile
cost, what it measured against the tier it was timed with, and what was decided."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# Decisions, as explain() prints them.
KEPT, REJECTED, FAILED, REFUSED, RAISED = "kept", "rejected", "compile failed", "refused", \
    "raised at run time"
REMEMBERED = "rejected in an earlier run"  # skipped in this one (remembered.py)


@dataclass
class TierEvent:
    candidate: str
    decision: str
    compile_seconds: float = 0.0
    candidate_us: float | None = None  # median µs per call of the candidate in its trial
    current_us: float | None = None    # ... and of the tier it was timed against
    against: str = ""                  # that tier's backend
    reason: str = ""
    # "worker process", "from the compile cache", or "thread: " and why not a process
    compiled_in: str = ""

    def __str__(self) -> str:
        line = f"{self.candidate}: {self.decision}"
        if self.compile_seconds:
            where = f", {self.compiled_in}" if self.compiled_in else ""
            line += f" (compile {self.compile_seconds:.2f}s{where})"
        if self.candidate_us is not None:
            line += (f"; {self.candidate_us:.1f} µs/call vs {self.against} "
                     f"{self.current_us:.1f} µs/call")
        return line + (f"; {self.reason}" if self.reason else "")


@dataclass
class TierHistory:
    """One graph's tiers: it starts on ``fx`` (tier 0); ``events`` in the order decided."""

    tier: str = "fx"
    events: list[TierEvent] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)  # the graph's first call
    submitted_at: float | None = None   # when its compile was asked for
    promoted_at: float | None = None    # when a candidate was first kept
    settled: bool = False               # every candidate decided

    def add(self, event: TierEvent) -> None:
        self.events.append(event)
        if event.decision == KEPT:
            self.tier = event.candidate
            if self.promoted_at is None:
                self.promoted_at = time.perf_counter()

    def lines(self) -> list[str]:
        """explain()'s lines for this graph: where it is now, then each decision."""
        if self.submitted_at is None:
            return [f"tier: {self.tier} (not hot enough to compile in the background)"]
        state = "final" if self.settled else "candidates pending"
        return [f"tier: {self.tier} ({state})", *[f"  {e}" for e in self.events]]
