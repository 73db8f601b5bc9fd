"""Logging of what specularch does (``SPECULARCH_LOG=graphs,guards,fallbacks,recompiles``),
through the standard ``logging`` module, logger ``specularch``. Disabled topics cost one
set lookup. Fallbacks are never silent: the first of each kind at each user line is a
WARNING even with no topic chosen (``config.warn_fallbacks``). The root logger is never
configured: when the program has set up no logging at all, the ``specularch`` logger gets its
own stderr handler (and does not propagate), so a ``logging.basicConfig`` the program calls
later still takes effect, and from then on specularch's messages go to the program's
handlers."""
from __future__ import annotations

import logging

from .config import config

logger = logging.getLogger("specularch")


# Assumption failures are speculation working as designed (the branch is then merged or no
# longer speculated, which is warned about on its own).
_NOT_WARNED = frozenset({"assumption_failed"})
_WARNED: set = set()  # (kind, filename, lineno) already warned about in this process


def emit(topic: str, message: str) -> None:
    if topic in config.log:
        _ensure_handler()
        if logger.level == logging.NOTSET:  # a level the program chose is kept
            logger.setLevel(logging.INFO)
        logger.info("[%s] %s", topic, message)


def warn_fallback(record) -> None:
    """A call returned from the original Python for ``record``'s reason. The first time for
    its kind and line (in any optimized object): one WARNING saying what runs eagerly, why,
    and how to look further or silence it. Calls that raised are not warned about: the
    program sees the exception itself."""
    key = (record.kind, record.filename, record.lineno)
    if (not config.warn_fallbacks or "fallbacks" in config.log or record.kind in _NOT_WARNED
            or key in _WARNED):
        return
    _WARNED.add(key)
    _ensure_handler()
    logger.warning("%s runs eagerly [%s] at %s: %s\n    hint: %s\n    (specularch.explain(...) "
                   "lists every fallback; SPECULARCH_WARN_FALLBACKS=0 silences this warning)",
                   record.function, record.kind, record.location, record.explanation,
                   record.hint)


def forget_warnings() -> None:
    """``specularch.reset()``: warn again about fallbacks seen before."""
    _WARNED.clear()


_OWN_HANDLER: logging.Handler | None = None  # the stderr handler added while none was set up


def _ensure_handler() -> None:
    """When the program has set up no logging at all, the ``specularch`` logger gets its own
    stderr handler (and does not propagate); otherwise the program's handlers are used, also
    when it set them up after that handler was added (it is then removed)."""
    global _OWN_HANDLER
    configured = bool(logging.getLogger().handlers)
    if _OWN_HANDLER is not None and configured:
        logger.removeHandler(_OWN_HANDLER)
        logger.propagate = True
        _OWN_HANDLER = None
    if not logger.handlers and not configured:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        _OWN_HANDLER = handler
