"""Why a loop of user code was unrolled when it is not a ``range()`` loop (loops.py).

``for x in xs`` over a list that comes from the call (an argument, an attribute) and
``while`` loops (``while i < n:``, ``while node is not None:``) that ``lists.py`` /
``while_loops.py`` / ``walk.py`` do not roll are unrolled: each iteration
is captured, the list's length and items or each test of the condition are guarded, so a
call with another trip count captures another graph (then ``cache_limit``). Capture
notes them at their first backward jump, as ``LoopReport``s that ``explain()`` lists with
the number of iterations captured and the reason, so a user sees which loop makes the
graphs and how to write it so it rolls.
"""
from __future__ import annotations

from ..library_files import is_library_file
from ..values import IterV, ListV, TupleV

LIST_WHY = ("a list from the call is iterated item by item: its length and items are guarded, "
            "one graph per length (a list of tensors, or of tuples of tensors and numbers, that "
            "all share item 0's dtype/shape/requires_grad, or of objects of one class, is rolled, "
            "and so are enumerate() and zip() of such lists: symbolic/rolled/lists.py, objects.py)")
WHILE_WHY = ("its condition is decided by Python values at capture and guarded at every test, "
             "one graph per trip count (`while i < n:` with an int counter stepped by a constant "
             "and a run-time bound is rolled, as `for t in range(n)` is, and so is "
             "`while node is not None: ...; node = node.next` over objects from the call: "
             "symbolic/rolled/walk.py)")


def mark_list_iterator(it: IterV, iterated) -> None:
    """``GET_ITER`` of a list or tuple that the call passed in: its loop is worth a note."""
    if isinstance(iterated, (ListV, TupleV)) and getattr(iterated, "source", None) is not None:
        it.iterates_source = iterated.source


def backward_jump(frame, target: int) -> None:
    """One more iteration of the loop whose head is at offset ``target``."""
    tracer = frame.tracer
    site = (id(frame.code), target)
    notes = tracer.loop_notes
    if site not in notes:
        notes[site] = _note(frame, site, target)
    if notes[site] is not None:
        notes[site].iterations += 1


def _note(frame, site: tuple, target: int):
    from .loops import LoopReport  # loops.py imports what imports this module
    if is_library_file(frame.code.co_filename):
        return None
    head = frame.info.instructions[frame.info.index_of[target]]
    if head.opname == "FOR_ITER":  # its jump back ends every iteration, and is on its line
        source = getattr(frame.stack[-1], "iterates_source", None) if frame.stack else None
        if source is None or frame.code.co_name.startswith("<"):
            return None  # a comprehension's list is most often the model's fixed one
        line = head.positions.lineno if head.positions else frame.lineno
        report = LoopReport(f"{frame.code.co_filename}:{line}", False, LIST_WHY, site=site,
                            form=f"for x in {source}")
    else:  # a while loop's test at its end (the ``while`` line) jumps back from the 2nd on
        report = LoopReport(f"{frame.code.co_filename}:{frame.lineno}", False, WHILE_WHY,
                            site=site, form="while loop", iterations=1)
    frame.tracer.loops.append(report)
    return report
