"""Logging of what specularch does (``SPECULARCH_LOG=graphs,guards,fallbacks,recompiles``),
through the standard ``logging`` module, logger ``specularch``. Disabled topics cost one
set lookup. The root logger is never configured: when the program has set up no logging at
all, the ``specularch`` logger gets its own stderr handler (and does not propagate), so a
``logging.basicConfig`` the program calls later still takes effect."""
from __future__ import annotations

import logging

from .config import config

logger = logging.getLogger("specularch")


def emit(topic: str, message: str) -> None:
    if topic in config.log:
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
        if logger.level == logging.NOTSET:  # a level the program chose is kept
            logger.setLevel(logging.INFO)
        logger.info("[%s] %s", topic, message)
