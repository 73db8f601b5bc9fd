"""Opcode family: loads and stores (locals, constants, globals, cells, attributes, imports)
and plain stack manipulation."""
from __future__ import annotations

import sys

from ...records import Unsupported
from ..attrs import load_attr, store_attr
from ..frame import read_cell
from .registry import handles
from ..values import NULL, CellV, ConstV


@handles("NOP", "RESUME", "PRECALL", "MAKE_CELL", "COPY_FREE_VARS")
def _nop(frame, ins):
    # MAKE_CELL / COPY_FREE_VARS: cells are set up when the frame is created (EXTENDED_ARG
    # never runs: bytecode.analyse drops it, ``dis`` folded it into the next instruction)
    return None


@handles("LOAD_FAST")
def _load_fast(frame, ins):
    value = frame.locals.get(ins.argval)
    if value is None:
        raise Unsupported("exception_handling",
                          f"UnboundLocalError: local variable {ins.argval!r} referenced before assignment")
    frame.push(value)


@handles("STORE_FAST")
def _store_fast(frame, ins):
    frame.locals[ins.argval] = frame.pop()


@handles("DELETE_FAST")
def _delete_fast(frame, ins):
    frame.locals.pop(ins.argval, None)


@handles("LOAD_CONST")
def _load_const(frame, ins):
    frame.push(ConstV(ins.argval))


@handles("LOAD_GLOBAL")
def _load_global(frame, ins):
    if ins.arg & 1:
        frame.push(NULL)
    frame.push(frame.load_global(ins.argval))


@handles("STORE_GLOBAL")
def _store_global(frame, ins):
    frame.tracer.heap.write_global(frame.globals, ins.argval, frame.pop(), frame.tracer.where())


@handles("DELETE_GLOBAL")
def _delete_global(frame, ins):
    raise Unsupported("side_effect", f"`del` of global {ins.argval!r} outlives the call")


def cell_of(frame, name: str) -> CellV:
    cell = frame.cells.get(name)
    if cell is None:
        cell = frame.cells[name] = CellV(frame.locals.pop(name, None))
    return cell


@handles("LOAD_DEREF")
def _load_deref(frame, ins):
    frame.push(read_cell(frame, cell_of(frame, ins.argval)))


@handles("STORE_DEREF")
def _store_deref(frame, ins):
    cell = cell_of(frame, ins.argval)
    cell.contents = frame.pop()
    if cell.real is not None:  # a cell of an outer function: the write outlives the call
        if cell.source is None:
            raise Unsupported("side_effect", f"`nonlocal {ins.argval}`: the cell cannot be "
                              "addressed after the call")
        frame.tracer.heap.write_cell(cell, cell.contents, frame.tracer.where())


@handles("DELETE_DEREF")
def _delete_deref(frame, ins):
    cell = cell_of(frame, ins.argval)
    if cell.real is not None:
        raise Unsupported("side_effect", f"`del {ins.argval}` of a closure variable outlives the call")
    cell.contents = None


@handles("LOAD_CLOSURE")
def _load_closure(frame, ins):
    frame.push(cell_of(frame, ins.argval))


@handles("LOAD_ATTR")
def _load_attr(frame, ins):
    frame.push(load_attr(frame.tracer, frame, frame.pop(), ins.argval))


@handles("LOAD_METHOD")
def _load_method(frame, ins):
    # We always bind: [NULL, bound-callable] is equivalent to [method, self].
    owner = frame.pop()
    frame.push(NULL)
    frame.push(load_attr(frame.tracer, frame, owner, ins.argval))


@handles("STORE_ATTR", "DELETE_ATTR")
def _store_attr(frame, ins):
    owner = frame.pop()
    value = frame.pop() if ins.opname == "STORE_ATTR" else None
    store_attr(frame.tracer, owner, ins.argval, value)


@handles("LOAD_ASSERTION_ERROR")
def _load_assertion_error(frame, ins):
    frame.push(frame.tracer.wrap(AssertionError, None))


@handles("IMPORT_NAME")
def _import_name(frame, ins):
    fromlist, level = frame.pop(), frame.pop()
    name = ins.argval
    if level.concrete() != 0 or name not in sys.modules:
        raise Unsupported("unsupported_call", f"`import {name}` inside the function (not yet imported)")
    module = sys.modules[name] if fromlist.concrete() else sys.modules[name.split(".")[0]]
    frame.push(frame.tracer.wrap(module, None))


@handles("IMPORT_FROM")
def _import_from(frame, ins):
    frame.push(load_attr(frame.tracer, frame, frame.stack[-1], ins.argval))


@handles("POP_TOP")
def _pop_top(frame, ins):
    frame.pop()


@handles("PUSH_NULL")
def _push_null(frame, ins):
    frame.push(NULL)


@handles("COPY")
def _copy(frame, ins):
    frame.push(frame.stack[-ins.arg])


@handles("SWAP")
def _swap(frame, ins):
    s = frame.stack
    s[-1], s[-ins.arg] = s[-ins.arg], s[-1]


@handles("RETURN_VALUE")
def _return(frame, ins):
    frame.result = frame.pop()
