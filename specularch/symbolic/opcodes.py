"""The opcode table: which handler runs each opcode. The handlers (``ops/``) register here
when imported (``@handles``); the symbolic frame (``frame.py``) only looks them up, so the
core of capture never imports the handlers written against it (``capture.py``, which drives
a capture, imports ``ops/``, and so fills the table before the first frame runs).
"""
from __future__ import annotations

import dis
from typing import Callable

HANDLERS: dict[str, Callable] = {}

# Opcodes that never reach the executor: inline caches and argument prefixes are folded away
# by ``dis``; the others only occur at module or class level.
NOT_IN_FUNCTIONS = {"CACHE", "LOAD_NAME", "STORE_NAME", "DELETE_NAME",
                    "SETUP_ANNOTATIONS", "IMPORT_STAR", "LOAD_BUILD_CLASS", "LOAD_CLASSDEREF",
                    "PRINT_EXPR", "INTERPRETER_EXIT", "HAVE_ARGUMENT"}


FALLS_BACK: set[str] = set()  # handled by always falling back (try/except, async, ...)


def handles(*opnames: str, falls_back: bool = False):
    """Register a handler; ``falls_back=True`` marks one that always refuses (the opcode is
    recognised, and code using it runs eagerly with a clear reason)."""
    def register(fn: Callable) -> Callable:
        for name in opnames:
            if name not in dis.opmap:
                raise ValueError(f"{name} is not an opcode of this Python version")
            if name in HANDLERS:
                raise ValueError(f"{name} already handled by {HANDLERS[name].__qualname__}")
            HANDLERS[name] = fn
            if falls_back:
                FALLS_BACK.add(name)
        return fn
    return register
