"""The test of a rolled loop's ``if <test>: break`` (``rolled/exits.py``) while the loop is
captured: speculated on its no-break side whatever the capturing call's value, its
assertion recorded for the loop (``Tracer.exit_test``). Here, below ``rolled/``, because
``item_args`` and the tracer's ``assume_truth`` make that assertion."""
from __future__ import annotations


def record(tracer, jump: int, assertion: tuple) -> None:
    """``assertion`` (made by the test of the exit jump at ``jump``) for the loop to find
    (``rolled/exits.Exits.stepped``)."""
    tracer.exit_test = (jump, assertion)


def is_exit(tracer, frame, jump: int) -> bool:
    return (id(frame.code), jump) in tracer.exit_jumps


def no_break(frame, jump: int) -> bool:
    """The outcome of the exit test at ``jump`` that goes on looping. Capture takes it
    whatever the capturing call's own value is (the body is the same either way: the test
    is its last statement), and the runner stops where the value is the other one: a
    capture whose own call breaks in its first iterations rolls the loop too."""
    return frame.info.instructions[jump].opname == "POP_JUMP_FORWARD_IF_TRUE"
