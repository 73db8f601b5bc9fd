"""The opcode registry: one small handler function per opcode (or tiny family).

Handlers are registered by opcode name with ``@handles("LOAD_FAST")`` in the table of
``symbolic/opcodes.py`` (which the symbolic frame reads); the registry rejects
unknown names (for this Python version) and duplicates, and can list what is not handled.
A handler takes ``(frame, instruction)``; it returns None to fall through or a jump target
offset.
"""
from __future__ import annotations

import dis

from ..opcodes import FALLS_BACK, HANDLERS, NOT_IN_FUNCTIONS, handles  # noqa: F401  (re-exported)


def fallback_opcodes() -> list[str]:
    """Opcodes the executor recognises only to fall back (code using them runs eagerly)."""
    return sorted(FALLS_BACK)


def unhandled_opcodes() -> list[str]:
    """Opcodes of this Python version that a function's bytecode may contain but that the
    symbolic executor does not handle (code using them falls back to eager)."""
    return sorted(set(dis.opmap) - set(HANDLERS) - NOT_IN_FUNCTIONS)
