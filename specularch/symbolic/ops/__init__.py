"""Opcode handlers: the registry and one module per opcode family, each registering its
handlers in ``symbolic/opcodes.py`` when imported (importing this package imports them all)."""
from . import builders, calls, control, exceptions, loads, operators  # noqa: F401
