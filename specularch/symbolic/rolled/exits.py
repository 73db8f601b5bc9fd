"""Rolled loops that stop early: ``for t in range(n): ...; if tok.item() == EOS: break``.

A loop whose body *ends* with ``if <test>: break`` (greedy decoding, iterate-until-converged)
runs a data-dependent number of iterations. Unrolled, the test is speculated ("no break")
and every call that breaks runs eagerly. Rolled, the test is the body's *exit check*: the
body computes it in every iteration like its other assumptions, and where it says "break"
the runner stops after that iteration, as eager does. Because the test is the body's last
statement, an iteration that breaks has done all of its work, so what the loop's variables
hold after it is that iteration's carried values. The loop's index after the loop is then a
number the graph produces (a ``.item()``-like value: returned, stored or computed on, it is
captured; used where Python needs the number itself, it falls back).

Such a loop is rolled even with constant bounds (``range(max_len)``, ``range(1, max_len)``),
since it is where it stops that varies. Lists it appends to hold the iterations it ran (``len`` of one
is a number the graph produces, ``torch.stack`` of one takes them all). Refused (the loop
unrolled, as before, and ``explain()`` says why): a loop over anything but ``range``, or
one reading items of a list it walks.

The bytecode shape (CPython 3.11, ``frames/`` checks the version) is, at the body's end::

    POP_JUMP_FORWARD_IF_FALSE  back      (or _IF_TRUE: ``if not c: break``)
    POP_TOP                              (the iterator: ``break``)
    JUMP_FORWARD               exit      (FOR_ITER's own exit)
    back: JUMP_BACKWARD        FOR_ITER

While such a loop is captured its exit jump is in ``Tracer.exit_jumps``: the test deciding it
is speculated even where its site has gone both ways, on its no-break side
(``speculation/exit_tests.py``, used by ``speculation/item_args.speculated`` and
``Tracer.assume_truth``), and ``Tracer.exit_test`` records which assertion it made.
"""
from __future__ import annotations

import torch

from ...records import AssumptionBroken

_TESTS = ("POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE")
EARLY_ROWS = ("it may stop early (its body ends with `if ...: break`) and reads items of a "
              "list it walks (which item is last would depend on where it stops)")


def exit_jump(instructions: list, head: int, exit_: int) -> int | None:
    """The index of the conditional jump of an ``if <test>: break`` that ends the body of
    the ``for`` loop whose ``FOR_ITER`` is at ``head`` (its exit at ``exit_``), or None."""
    bottom = exit_ - 1
    if bottom - head < 5:
        return None
    test, pop, leave, back = instructions[bottom - 3:bottom + 1]
    if back.opname != "JUMP_BACKWARD" or back.argval != instructions[head].offset:
        return None
    if leave.opname != "JUMP_FORWARD" or leave.argval != instructions[exit_].offset \
            or pop.opname != "POP_TOP":
        return None
    if test.opname not in _TESTS or test.argval != back.offset:
        return None
    return bottom - 3


class Exits:
    """What capture found of a loop's exit test: per captured iteration, the assertion the
    test at the exit jump made (``tracer.assertions``' tuple), or None where it made none
    (a test on a value that is not speculated there, an iteration that did not reach it)."""

    def __init__(self, tracer, code, at: int | None):
        self.tracer, self.key, self.at = tracer, (id(code), at), at
        self.found: list = []

    def __enter__(self):
        if self.at is not None:
            self.tracer.exit_jumps.add(self.key)
        return self

    def __exit__(self, *exc):
        self.tracer.exit_jumps.discard(self.key)
        self.tracer.exit_test = None

    def iteration(self) -> None:
        """A captured iteration starts (its exit test: None until ``stepped`` finds it)."""
        self.found.append(None)

    def stepped(self, at: int) -> None:
        """After the frame ran the instruction at ``at``: the exit test's record, if that
        was the exit jump."""
        if at == self.at:
            record, self.tracer.exit_test = self.tracer.exit_test, None
            self.found[-1] = record[1] if record is not None and record[0] == at else None


def run_until_exit(loop, n: int, carried: tuple, invariants: tuple, stopped) -> tuple:
    """``RolledLoop.__call__`` of a loop with an exit check (``loop.exit``, its position
    among the checks): the body's iterations until the check says "break" (after that
    iteration) or ``n`` is reached; ``stopped``: iteration 0's exit test where the graph
    ran it before the loop (``loop.first_expected``, its no-break outcome), else None.
    Returns the carried values, the per-iteration values (lists), the flag of the body's
    other assumptions, and the index of the last iteration run (a 0-d tensor: the loop
    variable after the loop)."""
    step, k, o = loop.run_body or loop.body.forward, loop.carried, loop.outputs
    invariants = loop.prepare(n, invariants) if loop.prepare is not None else invariants
    last, expected, at = 0, loop.expected, loop.exit
    outs: tuple = tuple([] for _ in range(o))
    if stopped is None or bool(stopped) is loop.first_expected:
        for t in range(loop.first, n):
            results = step(t, *carried, *invariants)
            carried, last = results[:k], t
            for out, value in zip(outs, results[k:k + o]):
                out.append(value)
            flags = results[k + o:]
            for i, (v, e) in enumerate(zip(flags, expected)):
                if i != at and bool(v) is not e:
                    raise AssumptionBroken(*loop.assumption)
            if bool(flags[at]) is not expected[at]:
                break
    loop.report.trips.append(last + 1)
    return (*carried, *outs, True, torch.tensor(last))
