"""One symbolically executed Python frame: a value stack, locals, cells and an instruction
pointer over an analysed code object. Opcode semantics live in the handlers of ``ops/``,
looked up in the table ``opcodes.py``.
"""
from __future__ import annotations

import types
from typing import Any, Callable

from ..guards.sources import BuiltinSource, GlobalSource, ItemSource, ObjectSource, pin
from ..guards import NotShadowedGuard
from ..records import Unsupported
from .bytecode import analyse
from .exceptions import PyRaise, step_in_try, unwind
from .opcodes import HANDLERS
from .rolled import unrolled as loop_notes
from .values import CellV, Value


class Frame:
    def __init__(self, tracer, code: types.CodeType, globals_: dict, locals_: dict[str, Value],
                 cells: dict[str, CellV], *, generator: bool = False):
        self.tracer = tracer
        self.code = code
        self.info = analyse(code)
        self.globals = globals_
        self.locals = locals_
        self.cells = cells
        self.stack: list[Value] = []
        self.ip = 0
        self.lineno = code.co_firstlineno
        self.kw_names: tuple[str, ...] = ()
        self.result: Value | None = None
        self.generator = generator
        self.yielded: list[Value] = []

    # ---- stack helpers ------------------------------------------------------------------
    def push(self, v: Value) -> None:
        self.stack.append(v)

    def pop(self) -> Value:
        return self.stack.pop()

    def popn(self, n: int) -> list[Value]:
        if n == 0:
            return []
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def jump(self, offset: int) -> None:
        self.ip = self.info.index_of[offset]

    # ---- globals --------------------------------------------------------------------------
    def global_source(self, name: str):
        if self.globals is self.tracer.globals:
            return GlobalSource(name)
        module = self.globals.get("__name__", "<module>")
        return ItemSource(ObjectSource(pin(self.globals), f"{module}.__dict__"), name)

    def load_global(self, name: str) -> Value:
        written = self.tracer.heap.read_global(self.globals, name)
        if written is not None:
            return written
        if name in self.globals:
            return self.tracer.wrap(self.globals[name], self.global_source(name))
        builtins_ = self.globals.get("__builtins__", self.tracer.builtins)
        if isinstance(builtins_, types.ModuleType):
            builtins_ = builtins_.__dict__
        if name not in builtins_:
            raise Unsupported("exception_handling", f"name {name!r} is not defined")
        if self.globals is self.tracer.globals:
            self.tracer.guards.add(NotShadowedGuard(None, name=name, where=self.tracer.where()))
        value = builtins_[name]
        return self.tracer.wrap(value, None) if not isinstance(value, (list, dict)) else \
            self.tracer.wrap(value, BuiltinSource(name))

    # ---- running ------------------------------------------------------------------------
    def run(self) -> Value:
        return self.on_stack(self._run_to_return)

    def _run_to_return(self) -> Value:
        while self.result is None:
            self._step()
        return self.result

    def on_stack(self, body: Callable[[], Any], leaving: Callable | None = None) -> Any:
        """``body()`` with this frame on the tracer's stack: a call run to its return, or a
        generator resumed (``library/context_managers.py``). The inlining depth is checked
        first; a refusal raised inside gets the user's line; an exception the code raises
        leaves through ``leaving`` when given (a generator's, PEP 479) instead."""
        tracer = self.tracer
        if len(tracer.frames) >= tracer.inline_depth:
            raise Unsupported("recursion_limit",
                              f"inlined calls nested deeper than config.inline_depth="
                              f"{tracer.inline_depth} (at {self.code.co_qualname})")
        tracer.frames.append(self)
        try:
            return body()
        except Unsupported as e:
            if leaving is not None and isinstance(e, PyRaise):
                raise leaving(e) from None
            if e.filename is None:
                e.filename, e.lineno, e.function = tracer.user_position()
            raise
        finally:
            tracer.frames.pop()

    def _step(self) -> None:
        ins = self.info.instructions[self.ip]
        self.ip += 1
        if ins.positions is not None and ins.positions.lineno is not None:
            self.lineno = ins.positions.lineno
        self.tracer.tick()
        handler = HANDLERS.get(ins.opname)
        if handler is None:
            raise Unsupported("unsupported_opcode",
                              f"opcode {ins.opname} is not supported by the symbolic executor")
        try:
            if self.info.handlers and ins.offset in self.info.handlers:
                target = step_in_try(self, handler, ins)
            else:
                target = handler(self, ins)
        except PyRaise as error:  # raised as eager raises it: to the handler, if one covers it
            target = unwind(self, ins, error)
        if target is not None:
            if target < ins.offset:  # one more iteration of a loop
                self.tracer.budget.backward_jump(self.code, ins.offset, self.lineno)
                loop_notes.backward_jump(self, target)
            self.jump(target)

    def run_span(self, stop: int | None) -> bool:
        """Run (inside ``run``) from ``self.ip`` until the instruction index ``stop`` or a
        ``return`` (one side of a branch, see ``branch_merge``), never jumping back before
        where it started nor past ``stop``. Returns whether it returned."""
        start = self.ip
        while self.result is None:
            if self.ip < start or (stop is not None and self.ip > stop):
                raise Unsupported("data_dependent_branch", "a side of the branch loops or "
                                  "jumps out of it")
            if self.ip == stop:
                return False
            self._step()
        return True

    def __repr__(self) -> str:
        return f"<Frame {self.code.co_qualname} line {self.lineno}>"


def read_cell(frame, cell: CellV) -> Value:
    if cell.contents is None and cell.real is not None:
        try:
            contents = cell.real.cell_contents
        except ValueError:
            raise Unsupported("exception_handling", "NameError: free variable referenced before "
                              "assignment") from None
        cell.contents = frame.tracer.wrap(contents, cell.source)
    if cell.contents is None:
        raise Unsupported("exception_handling", "NameError: cell variable referenced before assignment")
    return cell.contents
