"""A hoisted rolled loop's first item computed with the others.

Iteration 0 of a rolled loop runs in the outer graph, so after ``hoist.py`` the list the
loop appended to is ``stack_joined([decoder(h_0)], decoder(stack(h_1 .. h_n-1)))``: the
first item is one small product of its own (and one more gradient product and accumulation
in backward), and the stacked whole is a copy of every item. Where the hoisted ops are one
op whose other operands are the loop invariants the head item's op reads too, the head's
operand joins the stack instead: ``decoder(stack(h_0 .. h_n-1))``, already the whole.

Results within rounding of the per-item ops (a product over more rows); nothing changes
with ``templates="exact"``, which hoists nothing.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from . import hoist as rolled_hoist


class HeadedTail:
    """A ``HoistedTail`` of one op run on the loop's head values and its per-iteration
    values stacked together: the whole list at once."""

    __name__ = "headed_tail"

    def __init__(self, tail: rolled_hoist.HoistedTail):
        self.tail = tail

    def __call__(self, heads: list, per_iteration: tuple, invariants: tuple) -> torch.Tensor:
        values = [*heads, *per_iteration[0]]
        if all(_alike(v, values[0]) for v in values):
            return self.tail.gm(torch.stack(values), *invariants)[0]
        # an item from before the loop unlike the rest (`[h0[:1] * w]`, then `h * w` per
        # iteration: results alike, inputs not): each on its own
        return torch.cat([self.tail.gm(v.unsqueeze(0), *invariants)[0] for v in values])


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def join_heads(graph: torch.fx.Graph) -> int:
    """Rewrite each ``stack_joined(heads, tail)`` whose heads the tail's one op computes
    from the same invariants (see the module docstring); returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is rolled_hoist.stack_joined:
            count += _join(graph, node)
    return count


def _join(graph: torch.fx.Graph, joined: torch.fx.Node) -> bool:
    heads, out = joined.args
    call = _tail_call(out)
    if call is None or not heads or not isinstance(heads, (list, tuple)):
        return False
    op = _only_op(call.target.gm.graph)
    if op is None:
        return False
    invariants = call.args[1]
    # the op's operands: the stacked value first, then invariants in its own order
    wanted = [invariants[int(a.name.split("_")[-1]) - 1] if isinstance(a, torch.fx.Node) else a
              for a in op.args[1:]]
    inputs = []
    for head in heads:
        if not isinstance(head, torch.fx.Node) or head.op != op.op or head.target != op.target \
                or head.kwargs != op.kwargs or list(head.args[1:]) != wanted \
                or len(head.users) != 1 or not isinstance(head.args[0], torch.fx.Node):
            return False
        inputs.append(head.args[0])
    with graph.inserting_before(joined):
        whole = graph.call_function(HeadedTail(call.target), (inputs, *call.args))
    whole.meta = dict(joined.meta)
    joined.replace_all_uses_with(whole)
    for dead in (joined, out, call, *heads):
        graph.erase_node(dead)
    return True


def _tail_call(out) -> torch.fx.Node | None:
    """The ``HoistedTail`` call that gives ``out`` as its one output, used only there."""
    if not isinstance(out, torch.fx.Node) or out.target is not operator.getitem \
            or len(out.users) != 1 or out.args[1] != 0:
        return None
    call = out.args[0]
    if not isinstance(call.target, rolled_hoist.HoistedTail) or len(call.users) != 1 \
            or len(call.target.appended) != 1 or len(call.args[0]) != 1:
        return None
    return call


def _only_op(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The one computing node of a tail graph: reads the stacked value first, placeholders
    (invariants) or constants after, and is the output."""
    ops = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    output = next(n for n in graph.nodes if n.op == "output")
    if len(ops) != 1 or output.args[0] != (ops[0],):
        return None
    op = ops[0]
    first = op.args[0] if op.args else None
    if not isinstance(first, torch.fx.Node) or first.name != "stacked_0" \
            or any(isinstance(a, torch.fx.Node) and a.op != "placeholder" for a in op.args) \
            or any(isinstance(a, torch.fx.Node) for a in op.kwargs.values()) \
            or any(a is first for a in op.args[1:]):
        return None
    return op
