"""Opcode handlers: the registry and one module per opcode family."""
