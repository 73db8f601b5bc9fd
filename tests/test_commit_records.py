"""The shadow heap's records: one typed record per kind of deferred write and per kind of
rebuilt value, checked when built and linted against the graph when capture ends, so a
malformed one fails at capture with a message naming it, not inside generated code.
Programs writing every kind run as graphs and leave the heap as eager leaves it."""
from __future__ import annotations

import collections

import pytest
import torch

from differential import A, T, check, module_globals
from specularch.guards.sources import CellSource, LocalSource
from specularch.shadow_heap import MalformedRebuild, lint, lint_writes
from specularch.shadow_heap import rebuild as rb
from specularch.shadow_heap import writes as wr
from specularch.symbolic.capture import capture

pytestmark = pytest.mark.usefixtures("no_profiling")


# --------------------------------------------------------------------------- checked when built

@pytest.mark.parametrize("make, message", [
    (lambda: rb.TupleOf([rb.GraphOutput(0)], tuple), "TupleOf: items must be a tuple"),
    (lambda: rb.GraphOutput(-1), "GraphOutput: index -1 is not an output number"),
    (lambda: rb.GraphItem("0"), "GraphItem: index '0' is not an output number"),
    (lambda: rb.FromSource("L['x']"), "FromSource: \"L['x']\" is not a Source"),
    (lambda: rb.Formatted(rb.Constant(1), 7, ""), "Formatted: conversion 7 is not one of"),
    (lambda: rb.ClockRead(lambda: 0.0, 0, "during"), "ClockRead: phase 'during' is neither"),
    (lambda: rb.NewObject(object, ((1, rb.Constant(2)),), 5), "NewObject: attrs must be"),
    (lambda: rb.DictOf(((1, 2),), 5), "DictOf: items must be a tuple of (key, record) pairs"),
    (lambda: rb.AsInference(rb.Constant(1), 3), "AsInference: "),
    (lambda: rb.CallOf(None, ()), "CallOf: None is not callable"),
    (lambda: wr.UpdateTensor(None, bumps=-1), "UpdateTensor: bumps -1 is not a count"),
    (lambda: wr.SetAttr(None, 3, None), "SetAttr: attribute name 3 is not a str"),
])
def test_a_malformed_record_fails_when_built_with_a_message_naming_it(make, message):
    with pytest.raises(MalformedRebuild) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


def test_lint_refuses_a_read_of_an_output_the_graph_does_not_have():
    value = rb.TupleOf((rb.GraphOutput(0), rb.ListOf((rb.GraphItem(2),), 7)))
    lint([value], outputs=3)
    with pytest.raises(MalformedRebuild, match="GraphItem: reads output 2 of a graph with 2 outputs"):
        lint([value], outputs=2)


def test_lint_refuses_one_uid_naming_two_objects_across_the_value_and_the_writes():
    returned = rb.ListOf((rb.Constant(1),), 11)
    stored = rb.DictOf((("k", rb.Constant(2)),), 11)
    lint([returned, returned], outputs=0)  # one list used twice: one object, fine
    with pytest.raises(MalformedRebuild, match="DictOf: uid 11 already names a ListOf"):
        lint([returned, stored], outputs=0)


def test_lint_refuses_a_write_that_was_not_lowered():
    class Owner:
        source = LocalSource(0, "box")
    pending = wr.SetAttr(Owner(), "count", object())
    with pytest.raises(MalformedRebuild, match="SetAttr: .* is not a rebuild record: was the write lowered"):
        lint_writes([pending])
    lowered = wr.SetAttr(rb.FromSource(Owner.source), "count", rb.Constant(1))
    lint_writes([lowered])


# --------------------------------------------------------------------------- every kind, end to end

class Box:
    def __init__(self):
        self.count = 0
        self.last = "x"


TOTAL = 0


def every_kind(box, lst, d, buf, t):
    global TOTAL
    box.count += 1
    del box.last
    TOTAL = TOTAL + 2
    lst.append(t.sum())
    d["k"] = t * 2
    with torch.no_grad():
        buf.add_(t)
    print("sum", f"{t.sum().item():.3f}")
    return {"a": [t + 1, box.count]}, collections.OrderedDict(b=t), (TOTAL, buf)


def _every_kind_args():
    return A(Box(), [T(2)], {"j": 1}, T(3), T(3))


def test_every_write_kind_is_a_typed_record_and_the_value_a_typed_tree():
    (box, lst, d, buf, t), _ = _every_kind_args()
    names = every_kind.__code__.co_varnames[:5]
    cap = capture(every_kind.__code__, every_kind.__globals__, names, (box, lst, d, buf, t), None,
                  max_instructions=100_000, inline_depth=8)
    kinds = [type(w) for w in cap.writes]
    # `buf.add_(t)`, read by nothing after: replayed by the commit (a copy, UpdateTensor, when
    # read: tests/test_copy_tax.py)
    assert kinds == [wr.SetAttr, wr.DelAttr, wr.SetGlobal, wr.ReplaceList, wr.ReplaceDict,
                     wr.ReplayTensor, wr.Print], kinds
    assert cap.writes[5].ops[0][0] == "add_" and isinstance(cap.writes[5].ops[0][1][0], rb.GraphOutput)
    assert isinstance(cap.writes[2].target, rb.CallerGlobals)
    assert isinstance(cap.output, rb.TupleOf)
    made = {type(r) for r in rb.walk(cap.output)}
    assert {rb.DictOf, rb.ListOf, rb.GraphOutput, rb.FromSource, rb.TupleOf} <= made, made
    assert box.count == 0 and box.last == "x" and lst == [lst[0]] and d == {"j": 1}  # untouched


def test_every_write_kind_commits_as_eager_writes():
    check(every_kind, _every_kind_args, expect="graph", state=module_globals(__name__, TOTAL=0))


def test_a_nonlocal_write_is_a_cell_record_committed_through_the_cell_source():
    # (committed like eager: test_shadow_heap.test_nonlocal_tensor_accumulator_and_counter)
    def make():
        seen = 0

        def step(t):
            nonlocal seen
            seen = seen + 1
            return t * seen
        return step
    step = make()
    cap = capture(step.__code__, step.__globals__, ("t",), (torch.ones(2),), step.__closure__,
                  max_instructions=10_000, inline_depth=8)
    assert [type(w) for w in cap.writes] == [wr.SetCell]
    assert isinstance(cap.writes[0].target, CellSource) and isinstance(cap.writes[0].value, rb.Constant)
    assert step.__closure__[0].cell_contents == 0  # nothing written before the entry commits
