"""A rolled body's LSTM cells with their input projection computed before the loop.

``torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)`` computes ``x @ w_ih.T + b_ih`` from
its input alone. Where ``x`` is a per-iteration value the prelude computes before the loop
(``fast.py``: ``embedding(tokens[t])``, ``xs[t]``), that projection moves into the
prelude too: one product over all rolled iterations' rows instead of one per iteration,
and in backward one product each for the gradients of ``x`` and ``w_ih`` instead of one
per iteration. The cell left in the body is ``rolled_cells.projected_lstm_cell`` (only
the recurrent product per iteration), fused like ``lstm_cell`` (``rolled_cells.fuse``).

A product over many rows may round differently from the same rows one batch at a time:
results are eager's within rounding, so nothing moves with ``templates="exact"`` (which
keeps the whole body as captured).
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from ...fx_lower.rolled import cells as rolled_cells

MARK = "cell_projection"  # node.meta key of the projections split out of the cells


def split(graph: torch.fx.Graph, invariant_names: list) -> int:
    """Rewrite each fusable ``lstm_cell`` as its input projection (a ``linear`` node marked
    ``MARK``, which the prelude may take) and a ``projected_lstm_cell``; returns how many."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    invariants = {n: k for n, k in ((n, n.name) for n in placeholders) if k in invariant_names}
    count = 0
    for node in [n for n in graph.nodes if rolled_cells.fusable(n, invariants)]:
        x, hc, w_ih, w_hh, b_ih, b_hh = node.args
        example = _projection_example(node, x)
        if node.target is not torch.lstm_cell or example is None:
            continue
        with graph.inserting_before(node):
            xp = graph.call_function(F.linear, (x, w_ih, b_ih))
        xp.meta.update(example=example, **{MARK: (x, w_ih, b_ih)})
        node.target, node.args = rolled_cells.projected_lstm_cell, (xp, hc, w_hh, b_hh)
        count += 1
    return count


def unsplit(graph: torch.fx.Graph) -> int:
    """Put back into their cells the projections that stayed in the body (the prelude did
    not take them: their input is computed from the carried values); returns how many
    moved before the loop."""
    moved = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is rolled_cells.projected_lstm_cell:
            xp, hc, w_hh, b_hh = node.args
            if isinstance(xp, torch.fx.Node) and MARK in xp.meta and xp.target is F.linear:
                x, w_ih, b_ih = xp.meta[MARK]
                node.target, node.args = torch.lstm_cell, (x, hc, w_ih, w_hh, b_ih, b_hh)
                graph.erase_node(xp)
            else:
                moved += 1
    return moved


def is_projection(node: torch.fx.Node) -> bool:
    """A projection ``split`` made: the prelude may run it on all rows at once."""
    return MARK in node.meta


def _projection_example(cell: torch.fx.Node, x: torch.fx.Node) -> torch.Tensor | None:
    """A tensor like the projection, ``(batch, 4 * hidden)``: the body's placeholders (the
    weights) carry no example, the cell's input and outputs do."""
    outputs = [u.meta.get("example") for u in cell.users]
    x = x.meta.get("example")
    if not isinstance(x, torch.Tensor) or not outputs \
            or not all(isinstance(o, torch.Tensor) and o.dim() == 2 for o in outputs):
        return None
    return x.new_empty(x.shape[0], 4 * outputs[0].shape[1])
