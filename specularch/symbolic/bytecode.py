"""Code objects analysed before they are run: instructions, jump targets, handlers.

Supported bytecode: CPython 3.11 only (``SUPPORTED_VERSIONS``). The instruction set, the
NULL-below-callable call protocol and the exception-table layout are all 3.11-specific;
importing the executor on another version raises a clear error instead of misreading code.
"""
from __future__ import annotations

import dis
import sys
import types
from dataclasses import dataclass

SUPPORTED_VERSIONS = {(3, 11)}

if sys.version_info[:2] not in SUPPORTED_VERSIONS:
    raise ImportError(
        f"specularch's symbolic executor reads CPython 3.11 bytecode; this is Python "
        f"{sys.version_info[0]}.{sys.version_info[1]}. Use Python 3.11.")

CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR = 0x20, 0x80, 0x200
CO_VARARGS, CO_VARKEYWORDS = 0x04, 0x08


@dataclass(frozen=True)
class CodeInfo:
    code: types.CodeType
    instructions: tuple
    index_of: dict          # offset -> index into instructions
    is_generator: bool
    # instruction offset -> the exception-table entry (target, depth, lasti) covering it: where
    # an exception raised there continues (3.11 tables never overlap: one entry per offset)
    handlers: dict

    def handler_at(self, offset: int):
        return self.handlers.get(offset)

    @property
    def filename(self) -> str:
        return self.code.co_filename


_CACHE: dict[int, tuple[types.CodeType, CodeInfo]] = {}


def analyse(code: types.CodeType) -> CodeInfo:
    """Decode and check ``code`` once; cached by identity."""
    hit = _CACHE.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    decoded = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
    # ``EXTENDED_ARG`` only widens the next instruction's argument, which ``dis`` folded into
    # it: dropped, so the instruction after ``GET_ITER`` of a loop whose body is longer than
    # 255 code units is its ``FOR_ITER``; a jump to a prefix lands on what it prefixes
    instructions = tuple(i for i in decoded if i.opname != "EXTENDED_ARG")
    index_of = {ins.offset: n for n, ins in enumerate(instructions)}
    prefixes: list = []
    for ins in decoded:
        if ins.opname == "EXTENDED_ARG":
            prefixes.append(ins.offset)
        else:
            index_of.update((offset, index_of[ins.offset]) for offset in prefixes)
            prefixes.clear()
    for ins in instructions:
        if ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs:
            if ins.argval not in index_of:
                raise ValueError(f"{code.co_qualname}: jump to {ins.argval} is not an instruction")
    info = CodeInfo(code, instructions, index_of,
                    bool(code.co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR)),
                    _handlers(code, instructions))
    _CACHE[id(code)] = (code, info)
    return info


def _handlers(code, instructions) -> dict:
    entries = dis.Bytecode(code).exception_entries
    return {ins.offset: entry for entry in entries for ins in instructions
            if entry.start <= ins.offset < entry.end}


def arg_names(code: types.CodeType) -> tuple[str, ...]:
    n = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & CO_VARARGS)
         + bool(code.co_flags & CO_VARKEYWORDS))
    return code.co_varnames[:n]
