"""Branches on a tensor's value where one side only raises: argument validation.

``if not torch._is_all_true(scale > 0): raise ValueError(...)`` (torch.distributions checks
its arguments like this) is an assumption the graph checks, never a branch to merge: the
raising side cannot be part of a graph. A call that violates it fails the assumption and runs
eagerly, which raises eager's error; later valid calls keep using a graph, instead of the
site being marked as going both ways and no longer speculated.
"""
from __future__ import annotations

import dis
import linecache

import torch.fx

_ENDS_BLOCK = {"RETURN_VALUE", "RERAISE"} | {dis.opname[op] for op in dis.hasjrel + dis.hasjabs}


def side_raises(frame, ins) -> bool:
    """Whether a side of the conditional jump ``ins`` (just executed in ``frame``) raises an
    exception that nothing in the frame catches, before any other control flow."""
    return _jump_raises(frame.info, frame.info.index_of[ins.offset])


def conditional_jump(info, index: int):
    """The instruction at ``index`` if it is a conditional jump on a value's truth
    (``POP_JUMP_{FORWARD,BACKWARD}_IF_{TRUE,FALSE}``), else None."""
    if not 0 <= index < len(info.instructions):
        return None
    ins = info.instructions[index]
    return ins if ins.opname.startswith("POP_JUMP") and ins.opname.endswith(("TRUE", "FALSE")) else None


def _jump_raises(info, index: int) -> bool:
    """Whether a side of the conditional jump at instruction ``index`` raises (``side_raises``)."""
    target = info.index_of[info.instructions[index].argval]
    return _raises_from(info, index + 1) or _raises_from(info, target)


def _raises_from(info, index: int) -> bool:
    for ins in info.instructions[index:]:
        if ins.opname == "RAISE_VARARGS":
            return ins.arg > 0 and info.handler_at(ins.offset) is None
        if ins.opname in _ENDS_BLOCK:
            return False
    return False


def validates(frame) -> bool:
    """Whether the test being made in ``frame`` decides a conditional jump with a side that
    raises (``if loss.item() < 0: raise ValueError(...)``): the jump running now (a truth
    test made by it) or the one right after (a comparison). Speculated again after a call
    that fails it, like ``keep_speculating``'s tensor branches."""
    for index in (frame.ip - 1, frame.ip):
        if conditional_jump(frame.info, index) is not None:
            return _jump_raises(frame.info, index)
    return False


def keep_speculating(frame, ins) -> None:
    """Speculate the branch ``ins`` again (an assumption the graph checks) when a side raises."""
    if side_raises(frame, ins):
        frame.tracer.unstable_sites.discard((id(frame.code), frame.ip))


def raising_nodes(error: BaseException, graphs: list):
    """The graph nodes ``error`` was raised at, innermost frame last: found from each
    traceback line in the FX code of one of ``graphs`` (GraphModules)."""
    codes = {}
    for gm in graphs:
        forward = getattr(type(gm), "forward", None)
        if isinstance(gm, torch.fx.GraphModule) and forward is not None:
            codes[forward.__code__] = gm
    tb = error.__traceback__
    while tb is not None:
        gm = codes.get(tb.tb_frame.f_code)
        if gm is not None:
            line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
            name = line.split(" = ", 1)[0].strip() if " = " in line else ""
            node = next((n for n in gm.graph.nodes if n.name == name), None)
            if node is not None:
                yield node
        tb = tb.tb_next
