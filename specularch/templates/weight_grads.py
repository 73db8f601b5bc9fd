"""One weight gradient per call, not one per level.

Run by wavefront, a structure of ``k`` levels calls the path's ``linear(x, W, b)`` ``k``
times. Under autograd each of those calls makes a full ``W``-sized gradient in the backward
pass (``g_l.T @ x_l``) and adds it into ``W``'s: for the tree models (``W`` 750 x 300, a
handful of rows per level) that is two memory-bound passes over ``W`` per level, the largest
cost of the backward after the fixed ones (the profile is in docs/recursion.md). The sum
over levels is one product of the stacked rows, ``cat(g).T @ cat(x)``: the levels' linears
save their rows and leave ``W``'s gradient to one node in front of them (``_Shared``), which
autograd runs after all of them, and which makes it in one ``mm``.

Only the batched evaluation does this (its gradients are equal to eager's within float
rounding, like its values); ``templates="exact"`` runs the path graphs as captured.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F


class Rows:
    """The rows the levels' linears of one weight saw in one call, and their gradients."""

    def __init__(self):
        self.inputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []


class _Shared(torch.autograd.Function):
    """``W`` as the levels' linears see it; its backward makes ``W``'s gradient once, from the
    rows they saved (plus any gradient that reached it the ordinary way)."""

    @staticmethod
    def forward(ctx, weight, rows):
        ctx.rows = rows
        ctx.set_materialize_grads(False)  # no W-sized zeros when only linears used it
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        rows = ctx.rows
        if rows.grads:
            g, x = _stacked(rows.grads), _stacked(rows.inputs)
            rows.grads, rows.inputs = [], []  # a second backward (retain_graph) starts anew
            summed = g.t().mm(x)
            grad = summed if grad is None else grad + summed
        return grad, None


class _Linear(torch.autograd.Function):
    """``linear(x, shared, bias)`` that leaves the weight's gradient to ``_Shared``."""

    @staticmethod
    def forward(ctx, x, shared, bias, rows):
        ctx.save_for_backward(x, shared)
        ctx.rows, ctx.has_bias = rows, bias is not None
        return F.linear(x, shared, bias)

    @staticmethod
    def backward(ctx, grad):
        x, shared = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            ctx.rows.grads.append(flat)
            ctx.rows.inputs.append(x.reshape(-1, x.shape[-1]))
        grad_x = grad.matmul(shared) if ctx.needs_input_grad[0] else None
        grad_bias = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


def _stacked(tensors: list) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def linear(x, weight, bias, rows):
    """The rewritten graph's linear: ``rows`` is None when the weight needs no gradient in
    this call (inference, frozen weights): then an ordinary ``linear``."""
    if rows is None:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, rows)


# Below this many elements a weight's per-level product and sum cost less than the Python
# autograd functions that replace them (measured on CPU: 150 x 300 loses, 750 x 300 gains).
MIN_ELEMENTS = 1 << 16


class SharedWeights:
    """Per call of the batched evaluation: the ``_Shared`` view of each deferred weight (made
    on first use) and its ``Rows``. ``levels``: how many levels each path runs in the call
    (by ``id``); a path of one level has nothing to share."""

    def __init__(self, levels: dict):
        self.levels = levels
        self.views: dict[int, tuple] = {}

    def get(self, index: int, weight: torch.Tensor, path) -> tuple:
        """(the weight as the batched form takes it, its ``Rows`` or None)."""
        found = self.views.get(index)
        if found is None:
            if self.levels[id(path)] > 1 and weight.numel() >= MIN_ELEMENTS \
                    and torch.is_grad_enabled() and weight.requires_grad:
                rows = Rows()
                found = (_Shared.apply(weight, rows), rows)
            else:
                found = (weight, None)
            self.views[index] = found
        return found


def defer(gm: torch.fx.GraphModule, weight_inputs: dict) -> tuple[torch.fx.GraphModule, tuple]:
    """``gm`` with each ``linear`` by a context weight rewritten to ``linear(..., rows)`` and
    one placeholder added (at the end) per such weight, receiving its ``Rows``; and the
    positions (of ``gm``'s inputs) of those weights, in the order of the added placeholders.
    ``weight_inputs``: input position -> whether that input is a context tensor. A weight
    used other than as a linear's weight is left alone (its gradient needs it whole)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    deferred = []
    for position, node in enumerate(placeholders):
        if weight_inputs.get(position) and node.users and all(
                _is_linear_weight(use, node) for use in node.users):
            deferred.append(position)
    if not deferred:
        return gm, ()
    graph = gm.graph
    last = placeholders[-1]
    rows_of = {}
    for position in reversed(deferred):
        with graph.inserting_after(last):
            rows_of[placeholders[position]] = graph.placeholder(f"rows_{placeholders[position].name}")
    for position in deferred:
        weight = placeholders[position]
        for use in list(weight.users):
            x, _, *rest = use.args
            bias = rest[0] if rest else use.kwargs.get("bias")
            use.target, use.args, use.kwargs = linear, (x, weight, bias, rows_of[weight]), {}
    graph.lint()
    gm.recompile()
    return gm, tuple(deferred)


def _is_linear_weight(use: torch.fx.Node, weight: torch.fx.Node) -> bool:
    """``use`` is ``linear(x, weight[, bias])`` with ``weight`` in that place only."""
    if use.op != "call_function" or use.target is not F.linear or len(use.args) < 2:
        return False
    others = list(use.args[2:]) + list(use.kwargs.values())
    return use.args[1] is weight and use.args[0] is not weight and weight not in others \
        and set(use.kwargs) <= {"bias"}
