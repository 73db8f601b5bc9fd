"""When a capture gives up on a long Python loop: before ``config.max_instructions``, once
unrolling it has cost more than running the call eagerly would.

Capture unrolls loops; a loop of tens of thousands of iterations makes a graph that never
pays off, yet reaching ``max_instructions`` takes seconds (each symbolic instruction costs
some microseconds, and the capturing call then runs eagerly as well). Time alone cannot tell
such a loop from an ordinary capture (symbolically executing a training step takes 10-100x
its eager time too), but an ordinary capture does not run one loop thousands of times. So a
capture is abandoned when both hold:

* one loop (one backward jump of one code object) has run more than
  ``config.max_instructions / 100`` iterations (2,000 by default), and
* the capture has run longer than ``max(FLOOR_SECONDS, EAGER_FACTOR x eager)``, where
  ``eager`` is the median duration of the eager calls the dispatcher profiled (the floor
  alone when nothing was profiled).

The capturing call thus costs at most about ``max(FLOOR_SECONDS, 2 x eager) + eager``. It
falls back as ``recursion_limit``, and like every failed capture its guard path is
remembered, so later calls on that path run eagerly without trying again. A larger
``max_instructions`` raises the loop threshold too (for who really wants the loop unrolled).

The dispatcher says what eager costs with ``eager_cost(seconds)`` around a capture; each
``Tracer`` takes a fresh ``CaptureBudget`` (its own start time) from ``for_capture``.
"""
from __future__ import annotations

import contextlib
import statistics
import threading
import time

from ..records import Unsupported

FLOOR_SECONDS = 0.5      # never give up sooner (short calls: the compile step dominates)
EAGER_FACTOR = 2.0       # a capture may cost this many eager calls before giving up
CHECK_EVERY = 256        # instructions between two looks at the clock (a power of two)
LOOP_DIVISOR = 100       # a loop is long past max_instructions / LOOP_DIVISOR iterations

_eager = threading.local()  # .seconds: the eager cost of the call being captured, or None


@contextlib.contextmanager
def eager_cost(durations):
    """Captures in this block may cost about ``EAGER_FACTOR`` x the median of ``durations``
    (seconds of eager calls of the same code; empty: unknown, the floor applies)."""
    before = getattr(_eager, "seconds", None)
    _eager.seconds = statistics.median(durations) if durations else None
    try:
        yield
    finally:
        _eager.seconds = before


def for_capture(max_instructions: int) -> "CaptureBudget":
    return CaptureBudget(getattr(_eager, "seconds", None), max_instructions)


class CaptureBudget:
    """The budget of one capture: ``backward_jump`` counts loop iterations per loop,
    ``check`` (every ``CHECK_EVERY`` instructions) raises once the capture is over budget."""

    def __init__(self, eager_seconds: float | None, max_instructions: int):
        self.eager_seconds = eager_seconds
        self.allowed = max(FLOOR_SECONDS, EAGER_FACTOR * (eager_seconds or 0.0))
        self.start = time.perf_counter()
        self.long_loop = max(max_instructions // LOOP_DIVISOR, 1)
        self.iterations: dict = {}  # (code, offset of the backward jump) -> times taken
        self.hottest = (0, None, 0)  # (iterations, code, line) of the busiest loop

    def backward_jump(self, code, offset: int, lineno: int) -> None:
        key = (code, offset)
        n = self.iterations[key] = self.iterations.get(key, 0) + 1
        if n > self.hottest[0]:
            self.hottest = (n, code, lineno)

    def check(self) -> None:
        iterations, code, lineno = self.hottest
        if iterations <= self.long_loop:
            return
        spent = time.perf_counter() - self.start
        if spent <= self.allowed:
            return
        raise Unsupported("recursion_limit", self._explanation(code, lineno), (
            "Keep the long Python loop out of the optimized function (optimize its body, or "
            "call it from eager code), or write it with tensor operations; raise "
            "config.max_instructions only if the loop is meant to be unrolled into the graph."))

    def _explanation(self, code, lineno: int) -> str:
        # No measured numbers: the text keys the record, which must not multiply per call.
        eager = "" if self.eager_seconds is None else f", {EAGER_FACTOR:g} x an eager call"
        return (f"capture gave up unrolling a long loop: the loop in {code.co_qualname} "
                f"(line {lineno}) ran more than {self.long_loop} iterations "
                f"(config.max_instructions/{LOOP_DIVISOR}) and capture took longer than "
                f"max({FLOOR_SECONDS:g}s{eager}); a graph that long would not pay off, so "
                f"this path runs eagerly")
