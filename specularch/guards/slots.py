"""Keeping a generated function's frame small: its locals reuse the slots of dead ones.

A generated entry function binds every source and computed number to a local of its own
(``s0``, ``s1``, ... ``n0``, ...): a 12-layer Transformer step has ~3,200. CPython 3.11
allocates a frame's locals on the thread's data stack, in chunks of 16 KB (~2,000 locals);
a frame that does not fit gets a chunk of its own, mapped from the operating system at each
call and unmapped at its return: 15-20 µs per call from ~2,000 locals on, ~5 µs more per
1,000 locals (docs/benchmarks.md, "Third pass"). Most locals are dead a few lines after
they are bound (a module read on the way to its parameter), so locals whose uses do not
overlap can share a slot: that step then needs ~1,160.

The renaming is done on the bytecode, where every use of a local is an instruction naming
its slot: no text to parse. It applies to straight-line code only (no backward jump: no
loop), where instructions run in the order of their offsets, so a local is live from its
first instruction to its last one; code with cells (a closure) or an argument reused as a
local is left as it is, and so is any code this CPython's bytecode is not known for.
"""
from __future__ import annotations

import heapq
import opcode
import sys
import types

import torch

# Below this many locals the frame fits a chunk (unless the callers' frames nearly fill it):
# the code stays as compiled.
REUSE_FROM = 512

_SUPPORTED = sys.version_info[:2] == (3, 11)
_LOCAL_OPS = {opcode.opmap[name] for name in ("LOAD_FAST", "STORE_FAST", "DELETE_FAST")
              if name in opcode.opmap}
_BACKWARD = {opcode.opmap[name] for name in ("JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT")
             if name in opcode.opmap}
_EXTENDED_ARG = opcode.EXTENDED_ARG
_STORE = opcode.opmap["STORE_FAST"]


def compact_locals(code: types.CodeType, threshold: int | None = None) -> types.CodeType:
    """``code`` with locals that are never live at once sharing a slot, or ``code`` itself
    when it has fewer than ``threshold`` locals or is not straight-line code."""
    threshold = REUSE_FROM if threshold is None else threshold
    if (not _SUPPORTED or code.co_nlocals < threshold or code.co_cellvars or code.co_freevars
            or code.co_flags & (0x04 | 0x08)):  # *args / **kwargs: keep the signature simple
        return code
    units = _Units(code.co_code)
    if units.jumps_back():
        return code
    fixed = code.co_argcount + code.co_kwonlyargcount
    mapping = _allocate(units, code.co_nlocals, fixed)
    if mapping is None or not units.rename(mapping):
        return code
    slots = max(mapping) + 1
    names = code.co_varnames
    new_names: list = list(names[:fixed]) + [None] * (slots - fixed)
    for old, new in enumerate(mapping):
        if new >= fixed and new_names[new] is None:
            new_names[new] = names[old]  # a slot is named after the first local it holds
    new_names = [n if n is not None else f"_unused{i}" for i, n in enumerate(new_names)]
    return code.replace(co_code=units.code(), co_varnames=tuple(new_names), co_nlocals=slots)


_PAD = 3  # code units before the code: an instruction has at most three EXTENDED_ARGs


class _Units:
    """The code's units (opcode, argument) as a tensor over a copy of its bytes (a 10,000-line
    entry has ~200,000 units: too many for a Python loop), and its local instructions."""

    def __init__(self, raw: bytes) -> None:
        self._buf = bytearray(bytes(2 * _PAD) + raw)
        self._u8 = torch.frombuffer(self._buf, dtype=torch.uint8).view(-1, 2)
        self.ops = self._u8[:, 0].long()
        args = self._u8[:, 1].long()
        self.pos = torch.nonzero(torch.isin(self.ops, torch.tensor(sorted(_LOCAL_OPS)))).flatten()
        ext = self.ops == _EXTENDED_ARG
        # how many EXTENDED_ARG units precede each local instruction (0-3), and its argument
        self.prefix = [ext[self.pos - 1]]
        for k in (2, 3):
            self.prefix.append(self.prefix[-1] & ext[self.pos - k])
        self.index = args[self.pos]
        for k, has in enumerate(self.prefix, start=1):
            self.index = self.index + (args[self.pos - k] << (8 * k)) * has

    def jumps_back(self) -> bool:
        return bool(torch.isin(self.ops, torch.tensor(sorted(_BACKWARD) or [-1])).any())

    def live_ranges(self, nlocals: int) -> tuple[list, list, list]:
        """Per local: the unit of its first and last instruction (-1: none), and whether the
        first one stores it."""
        big = len(self.ops)
        first = torch.full((nlocals,), big, dtype=torch.long).scatter_reduce(
            0, self.index, self.pos, "amin")
        last = torch.full((nlocals,), -1, dtype=torch.long).scatter_reduce(
            0, self.index, self.pos, "amax")
        stores = self.ops[first.clamp(max=big - 1)] == _STORE
        return first.tolist(), last.tolist(), stores.tolist()

    def rename(self, mapping: list) -> bool:
        """Point each local instruction at its new slot; instruction lengths stay (an
        EXTENDED_ARG no longer needed carries 0), so no jump moves. False when a new slot
        needs more argument bytes than its instruction has."""
        new = torch.tensor(mapping, dtype=torch.long)[self.index]
        room = 1 + sum(has.long() for has in self.prefix)
        if bool((new >= (1 << (8 * room))).any()):
            return False
        column = self._u8[:, 1]
        column[self.pos] = (new & 0xFF).to(torch.uint8)
        for k, has in enumerate(self.prefix, start=1):
            at = self.pos[has] - k
            column[at] = ((new[has] >> (8 * k)) & 0xFF).to(torch.uint8)
        return True

    def code(self) -> bytes:
        return bytes(self._buf[2 * _PAD:])


def _allocate(units: _Units, nlocals: int, fixed: int) -> list | None:
    """New slot per local (arguments keep theirs): linear scan over live ranges. None when a
    local other than an argument is read before it is first stored (left alone, safely)."""
    first, last, stores = units.live_ranges(nlocals)
    ranges = []
    for index in range(fixed, nlocals):
        if last[index] < 0:
            continue  # never used
        if not stores[index]:
            return None
        ranges.append((first[index], last[index], index))
    ranges.sort()
    mapping = list(range(nlocals))
    active: list[tuple[int, int]] = []  # (last unit, slot)
    free: list[int] = []
    count = fixed
    for start, end, index in ranges:
        while active and active[0][0] < start:
            heapq.heappush(free, heapq.heappop(active)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, count = count, count + 1
        mapping[index] = slot
        heapq.heappush(active, (end, slot))
    for index in range(fixed, nlocals):
        if last[index] < 0:
            mapping[index] = fixed  # never used: any slot (no instruction names it)
    return mapping
