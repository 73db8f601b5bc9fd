"""The opcode registry: one small handler function per opcode (or tiny family).

Handlers are registered by opcode name with ``@handles("LOAD_FAST")``; the registry rejects
unknown names (for this Python version) and duplicates, and can list what is not handled.
A handler takes ``(frame, instruction)``; it returns None to fall through or a jump target
offset.
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


def fallback_opcodes() -> list[str]:
    """Opcodes the executor recognises only to fall back (code using them runs eagerly)."""
    _load_families()
    return sorted(FALLS_BACK)


def unhandled_opcodes() -> list[str]:
    """Opcodes of this Python version that a function's bytecode may contain but that the
    symbolic executor does not handle (code using them falls back to eager)."""
    _load_families()
    return sorted(set(dis.opmap) - set(HANDLERS) - NOT_IN_FUNCTIONS)


def _load_families() -> None:
    from . import builders, calls, control, exceptions, loads, operators  # noqa: F401
