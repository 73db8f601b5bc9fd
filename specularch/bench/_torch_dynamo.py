"""What torch.compile did, for the benchmark's report: graphs compiled and recompile limits
hit. The only place in ``bench/`` that reads ``torch._dynamo`` (a private API)."""
from __future__ import annotations

import logging

# convert_frame logs one WARNING when a code object reaches its recompile limit; from then
# on torch.compile runs that code eagerly, without saying so again.
_LIMIT_LOGGER = "torch._dynamo.convert_frame"
_LIMIT_MESSAGE = "torch._dynamo hit config."


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process (all functions together)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


class RecompileLimitHits(logging.Handler):
    """Counts torch.compile's recompile-limit warnings while installed (``with`` block)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record):
        if str(record.msg).startswith(_LIMIT_MESSAGE):
            self.hits += 1

    def __enter__(self):
        logging.getLogger(_LIMIT_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(_LIMIT_LOGGER).removeHandler(self)
