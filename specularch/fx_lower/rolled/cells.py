"""A rolled loop's LSTM cells with one weight-gradient product per call instead of one per
iteration.

Run per iteration under autograd, ``torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)``
records about fifteen autograd nodes, and its backward computes the gradient of each weight
as a product over the batch only (``dgates.T @ x``: an inner size of 20 for a batch of 20),
then adds it into the weight's gradient: per iteration, two small products and two large
additions per cell. Here each cell of the body runs as one autograd node (``_FusedCell``)
whose backward computes the gradients of ``x``, ``h`` and ``c`` and keeps ``dgates``, ``x``
and ``h``; a second node per cell and call (``_WeightSink``), which autograd reaches only
after every iteration's cell node, computes each weight's gradient as one product over all
iterations' rows stacked (``cat(dgates).T @ cat(x)``).

The forward runs aten's CPU ops in aten's order (``lstm_cell``'s own decomposition), so its
values are eager's bit for bit; the gradients are eager's up to rounding (the sum over the
iterations is one product). ``config.templates == "exact"`` keeps the body as captured.
"""
from __future__ import annotations

import torch
import torch.fx

from .._torch_autograd import graph_task_id


class _Grads:
    """What one call's cell nodes left for the weight sinks: per cell site, the engine run
    that left them and the rows of every iteration's ``dgates``, input and hidden state."""

    def __init__(self, sites: int):
        self.rows: list = [(None, []) for _ in range(sites)]

    def add(self, site: int, row: tuple) -> None:
        task = graph_task_id()
        if self.rows[site][0] != task:  # left by a run that never reached the sink
            self.rows[site] = (task, [])
        self.rows[site][1].append(row)

    def take(self, site: int) -> list:
        task, rows = self.rows[site]
        self.rows[site] = (None, [])
        return rows if task == graph_task_id() else []


class _WeightSink(torch.autograd.Function):
    """Identity on a cell's weights; its backward, run after all the cell's iterations,
    turns their kept rows into the weights' gradients. The weights: ``w_ih, w_hh, b_ih,
    b_hh``, or ``w_hh, b_hh`` for a cell whose input projection ran before the loop."""

    @staticmethod
    def forward(ctx, grads, site, *weights):
        ctx.grads, ctx.site = grads, site
        ctx.set_materialize_grads(False)
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *incoming):
        # (under create_graph the cells left no rows: their weight gradients come in)
        rows = ctx.grads.take(ctx.site)
        if not rows:
            return (None, None, *incoming)
        dgates = torch.cat([r[0] for r in rows])
        hs = torch.cat([r[2] for r in rows])
        bias = dgates.sum(0)
        own = (dgates.t().mm(hs), bias)
        if len(incoming) == 4:
            xs = torch.cat([r[1] for r in rows])
            own = (dgates.t().mm(xs), own[0], bias, bias)
        return (None, None, *(o if g is None else g + o for o, g in zip(own, incoming)))


class _FusedCell(torch.autograd.Function):
    """``torch.lstm_cell`` as one autograd node that leaves its weight gradients to the
    call's ``_WeightSink``. With ``w_ih`` None, ``x`` is the input's projection
    ``x @ w_ih.T + b_ih``, computed for all iterations before the loop
    (``symbolic/rolled/project.py``): its gradient is ``dgates``."""

    @staticmethod
    def forward(ctx, grads, site, x, h, c, w_hh, b_hh, w_ih, b_ih):
        # aten's CPU lstm_cell: linear_hh(hx).add_(linear_ih(input)), gates chunked in place
        gates = torch.addmm(b_hh, h, w_hh.t())
        gates.add_(x if w_ih is None else torch.addmm(b_ih, x, w_ih.t()))
        i, f, g, o = gates.unsafe_chunk(4, 1)
        i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
        cy = (f * c).add_(i * g)
        tanh_cy = cy.tanh()
        hy = o * tanh_cy
        ctx.grads, ctx.site = grads, site
        ctx.save_for_backward(x, h, c, w_hh, b_hh, w_ih, b_ih, gates, tanh_cy)
        return hy, cy

    @staticmethod
    def backward(ctx, dhy, dcy):
        if torch.is_grad_enabled():  # create_graph=True
            return _differentiable_backward(ctx, dhy, dcy)
        x, h, c, w_hh, _, w_ih, _, gates, tanh_cy = ctx.saved_tensors
        dgates, dc, f = _dgates(gates, c, tanh_cy, dhy, dcy)
        needs = ctx.needs_input_grad
        if any(needs[5:]):
            ctx.grads.add(ctx.site, (dgates, x, h))
        dx = (dgates if w_ih is None else dgates.mm(w_ih)) if needs[2] else None
        dh = dgates.mm(w_hh) if needs[3] else None
        return None, None, dx, dh, dc * f if needs[4] else None, None, None, None, None


def _dgates(gates, c, tanh_cy, dhy, dcy) -> tuple:
    """The gradient of the cell's gates (before their activations) and of its new cell
    state, from the activated gates."""
    i, f, g, o = gates.chunk(4, 1)
    dho = dhy * o
    dc = torch.addcmul(dcy + dho, dho, tanh_cy * tanh_cy, value=-1)  # dcy + dho (1 - tanh²)
    # d activation: a (1 - a) for the sigmoid gates, 1 - a² for the tanh one
    slope = gates - gates * gates
    slope[:, g.shape[1] * 2:g.shape[1] * 3].add_(1).sub_(g)
    dgates = torch.cat([dc * g, dc * c, dc * i, dhy * tanh_cy], 1).mul_(slope)
    return dgates, dc, f


def _differentiable_backward(ctx, dhy, dcy) -> tuple:
    """The cell's backward as ops autograd records: the gates recomputed from the saved
    inputs (which keep their history), then the backward's formulas out of place. (Not a
    nested ``autograd.grad`` of a recomputed cell: that run would reach the earlier cells
    through the weights and add their weight gradients into this one's.)"""
    x, h, c, w_hh, b_hh, w_ih, b_ih = ctx.saved_tensors[:7]
    projected = w_ih is None
    gates = torch.addmm(b_hh, h, w_hh.t()) + (x if projected else torch.addmm(b_ih, x, w_ih.t()))
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    tanh_cy = (f * c + i * g).tanh()
    dc = dcy + dhy * o * (1 - tanh_cy * tanh_cy)
    dgates = torch.cat([dc * g * i * (1 - i), dc * c * f * (1 - f), dc * i * (1 - g * g),
                        dhy * tanh_cy * o * (1 - o)], 1)
    needs = ctx.needs_input_grad
    bias = dgates.sum(0) if any(needs[6::2]) else None
    grads = (dgates if projected else dgates.mm(w_ih), dgates.mm(w_hh), dc * f,
             dgates.t().mm(h), bias,
             None if projected else dgates.t().mm(x), None if projected else bias)
    return (None, None, *(d if need else None for d, need in zip(grads, needs[2:])))


class FusedCells:
    """The per-call part of a rewritten body: a fresh ``_Grads`` and the weight sinks, made
    from the loop's invariants before its first rolled iteration."""

    def __init__(self, sites: list):
        self.sites = sites  # per cell site: the positions of its weights among the invariants

    def __call__(self, invariants: tuple) -> tuple:
        weights = [invariants[p] for site in self.sites for p in site]
        if not torch.is_grad_enabled() or not any(w.requires_grad for w in weights):
            return (*invariants, None)
        grads = _Grads(len(self.sites))
        out = list(invariants)
        for k, site in enumerate(self.sites):
            for p, w in zip(site, _WeightSink.apply(grads, k, *[invariants[p] for p in site])):
                out[p] = w
        return (*out, grads)


def fused_lstm_cell(grads, site, x, hc, w_ih, w_hh, b_ih, b_hh):
    """The rewritten body's stand-in for ``torch.lstm_cell``."""
    if grads is None:
        return torch.lstm_cell(x, hc, w_ih, w_hh, b_ih, b_hh)
    return _FusedCell.apply(grads, site, x, hc[0], hc[1], w_hh, b_hh, w_ih, b_ih)


def projected_lstm_cell(xp, hc, w_hh, b_hh):
    """``torch.lstm_cell`` given its input's projection ``xp = x @ w_ih.T + b_ih``, in
    aten's order, as ops autograd records."""
    h, c = hc
    gates = torch.addmm(b_hh, h, w_hh.t()) + xp
    i, f, g, o = gates.chunk(4, 1)
    cy = f.sigmoid() * c + i.sigmoid() * g.tanh()
    return o.sigmoid() * cy.tanh(), cy


def fused_projected_cell(grads, site, xp, hc, w_hh, b_hh):
    """The rewritten body's stand-in for ``projected_lstm_cell``."""
    if grads is None:
        return projected_lstm_cell(xp, hc, w_hh, b_hh)
    return _FusedCell.apply(grads, site, xp, hc[0], hc[1], w_hh, b_hh, None, None)


_FUSED = {torch.lstm_cell: (6, fused_lstm_cell), projected_lstm_cell: (4, fused_projected_cell)}
UNFUSED = {fused: cell for cell, (_, fused) in _FUSED.items()}  # the cells as autograd ops


def fusable(node: torch.fx.Node, invariants: dict) -> bool:
    """An ``lstm_cell`` (or ``projected_lstm_cell``) on a 2-d input whose weights are loop
    invariants (the body's placeholders), all present."""
    if node.op != "call_function" or node.target not in _FUSED or node.kwargs \
            or len(node.args) != _FUSED[node.target][0]:
        return False
    x, hc, *weights = node.args
    example = x.meta.get("example") if isinstance(x, torch.fx.Node) else None
    return (isinstance(example, torch.Tensor) and example.dim() == 2
            and example.dtype in (torch.float32, torch.float64)
            and isinstance(hc, (tuple, list)) and len(hc) == 2
            and all(isinstance(w, torch.fx.Node) and w in invariants for w in weights))


def fuse(body: torch.fx.GraphModule, invariant_names: list) -> FusedCells | None:
    """Rewrite ``body``'s LSTM cells in place (an extra last input: the call's ``_Grads``);
    returns what makes that input per call, or None (nothing to fuse, body unchanged)."""
    graph = body.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    invariants = {n: invariant_names.index(n.name) for n in placeholders
                  if n.name in invariant_names}
    cells = [n for n in graph.nodes if fusable(n, invariants)]
    if not cells:
        return None
    with graph.inserting_after(placeholders[-1]):
        grads = graph.placeholder("cell_grads")
    for k, node in enumerate(cells):
        node.target = _FUSED[node.target][1]
        node.args = (grads, k, *node.args)
    body.recompile()
    return FusedCells([[invariants[w] for w in node.args[4:]] for node in cells])
