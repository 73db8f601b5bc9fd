"""A rolled loop whose body is a stack of LSTM cells (``stack_plan.py``), run as one
autograd node for all its iterations, outside exact mode.

Run per iteration, each fused cell (``rolled_cells._FusedCell``) is an autograd node: per
cell and iteration an ``autograd.Function`` call in the forward and one in the backward,
their Python, the saved tensors, and fresh small tensors for every gate and state. For the
LM (two cells of 200, batch 20) that was about a tenth of its step. Here the whole loop is
one node (``_StackFn``): its forward runs every iteration's cells with aten's CPU ops of
``lstm_cell`` in aten's order, writing each step's gates, states and ``tanh(c)`` into
buffers made once per call (so the forward's values are eager's bit for bit); its backward
walks the steps back, writing each step's gate gradient into one buffer, from which each
weight's gradient is one product over all steps (as the fused cells' ``_WeightSink`` did)
and a projected input's gradient is the buffer itself. Gradients are eager's within
rounding.

A backward under ``create_graph`` (double backward, a gradient penalty) replays the loop
with ``torch.lstm_cell`` on the saved inputs, which keep their history, and differentiates
that. A call whose inputs do not have the capture's sizes runs the body per iteration
(``RolledLoop``), which checks them.
"""
from __future__ import annotations

import torch

from . import cells as rolled_cells
from .stack_plan import Plan


class Stack:
    """Runs a loop of ``plan`` for a call: its inputs gathered from the loop's carried values,
    invariants and the prelude's rows, its results as ``RolledLoop`` returns them."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.rows = sorted({c.x[1] for c in plan.cells if c.x[0] == "row"})
        self.weights = list(dict.fromkeys(p for c in plan.cells for p in c.weights))

    def __call__(self, steps: int, carried: tuple, invariants: tuple, rows: tuple) -> tuple | None:
        """The carried values after the loop, then each per-iteration output's list; None
        where the inputs' sizes are not the plan's (the body then runs per iteration)."""
        plan = self.plan
        xs = [rows[r] for r in self.rows]
        states = [carried[k] for cell in plan.cells for k in (cell.h, cell.c)]
        weights = [invariants[p] for p in self.weights]
        if not self._fits(steps, xs, states, weights):
            return None
        results = _StackFn.apply(self, steps, *xs, *states, *weights)
        at = {"h": 0, "c": 2}
        final = {(kind, j): results[4 * j + at[kind] + 1] for kind in at for j in range(len(plan.cells))}
        # (a list's last item is the carried value itself, as the body's per-iteration run gives)
        every = {source: (*results[4 * source[1] + at[source[0]]].unbind(0), final[source])
                 for source in set(plan.outputs)}
        out = [carried[j] if kind == "carried" else final[(kind, j)] for kind, j in plan.carried]
        return (*out, *[list(every[source]) for source in plan.outputs])

    def _fits(self, steps: int, xs: list, states: list, weights: list) -> bool:
        plan = self.plan
        wanted = [(steps, *plan.row_shapes[r]) for r in self.rows]
        wanted += [s for s in plan.state_shapes for _ in range(2)]
        wanted += [plan.weight_shapes[p] for p in self.weights]
        return all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape
                   and t.dtype == plan.dtype and t.device.type == "cpu"
                   and t.layout is torch.strided
                   for t, shape in zip([*xs, *states, *weights], wanted))

    def inputs(self, flat: tuple) -> tuple:
        """``flat`` (the node's inputs) as rows by prelude value, the cells' states, and
        each cell's weights ``(w_ih, w_hh, b_ih, b_hh)`` (``w_ih``, ``b_ih`` None for a
        projected cell)."""
        r, k = len(self.rows), 2 * len(self.plan.cells)
        rows = dict(zip(self.rows, flat[:r]))
        by_position = dict(zip(self.weights, flat[r + k:]))
        weights = []
        for cell in self.plan.cells:
            w = [by_position[p] for p in cell.weights]
            weights.append((None, w[0], None, w[1]) if cell.projected else tuple(w))
        return rows, flat[r:r + k], weights


class _Buffers:
    """One cell's values for every step of a call: ``hb``/``cb`` the states before each step
    (slot 0 the initial ones; the last new ones are ``h_fin``/``c_fin``, outside, so that
    nothing the backward saves aliases them), ``gb`` the activated gates, ``tb`` ``tanh(c)``.
    Per-step views of each are made once (``unbind``)."""

    def __init__(self, steps: int, h: torch.Tensor, c: torch.Tensor):
        hidden = h.shape[1]
        self.hb, self.cb = h.new_empty(steps, *h.shape), c.new_empty(steps, *c.shape)
        self.hb[0].copy_(h)
        self.cb[0].copy_(c)
        self.h_fin, self.c_fin = torch.empty_like(h), torch.empty_like(c)
        self.gb = h.new_empty(steps, h.shape[0], 4 * hidden)
        self.tb = h.new_empty(steps, *h.shape)
        self.H = (*self.hb.unbind(0), self.h_fin)
        self.views()

    def views(self) -> None:
        self.C = (*self.cb.unbind(0), self.c_fin)
        self.G, self.T = self.gb.unbind(0), self.tb.unbind(0)
        self.I, self.F, self.Gc, self.O = (g.unbind(0) for g in self.gb.unsafe_chunk(4, 2))

    @classmethod
    def saved(cls, hb, cb, gb, tb, h_fin) -> "_Buffers":
        b = cls.__new__(cls)
        b.hb, b.cb, b.gb, b.tb, b.h_fin, b.c_fin = hb, cb, gb, tb, h_fin, None
        b.views()
        return b


def _step(b: _Buffers, t: int, x, w_ih, w_hh, b_ih, b_hh) -> None:
    """One cell's step ``t``: aten's CPU ``lstm_cell`` (``linear_hh(h).add_(linear_ih(x))``,
    the gates activated in place), its results written into the buffers."""
    gates = torch.addmm(b_hh, b.H[t], w_hh.t(), out=b.G[t])
    gates.add_(x if w_ih is None else torch.addmm(b_ih, x, w_ih.t()))
    b.I[t].sigmoid_(), b.F[t].sigmoid_(), b.Gc[t].tanh_(), b.O[t].sigmoid_()
    torch.mul(b.F[t], b.C[t], out=b.C[t + 1]).add_(b.I[t] * b.Gc[t])
    torch.tanh(b.C[t + 1], out=b.T[t])
    torch.mul(b.O[t], b.T[t], out=b.H[t + 1])


def _step_back(b: _Buffers, t: int, dhy, dcy, dgates, slopes: tuple, one) -> torch.Tensor:
    """Step ``t``'s gate gradient (before the activations) into ``dgates``, from the
    gradients of its new ``h`` and ``c``; returns the gradient of ``c`` at the gates'
    product (``dc``; the old ``c``'s is ``dc * f``). ``slopes``: a gates-sized scratch
    tensor and its ``g`` columns."""
    tanh_c, g = b.T[t], b.Gc[t]
    slope, slope_g = slopes
    dho = dhy * b.O[t]
    dc = torch.addcmul(dcy, dho, tanh_c * tanh_c, value=-1).add_(dho)  # dcy + dho (1 - tanh²)
    # d activation: a (1 - a) for the sigmoid gates, 1 - g² for the tanh one
    torch.addcmul(b.G[t], b.G[t], b.G[t], value=-1, out=slope)
    torch.addcmul(one, g, g, value=-1, out=slope_g)
    torch.cat([dc * g, dc * b.C[t], dc * b.I[t], dhy * tanh_c], 1, out=dgates).mul_(slope)
    return dc


class _StackFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stack: Stack, steps: int, *flat):
        rows, states, weights = stack.inputs(flat)
        cells = stack.plan.cells
        bufs = [_Buffers(steps, states[2 * j], states[2 * j + 1]) for j in range(len(cells))]
        per_row = {r: x.unbind(0) for r, x in rows.items()}
        inputs = [per_row[c.x[1]] if c.x[0] == "row" else bufs[c.x[1]].H[1:] for c in cells]
        for t in range(steps):
            for b, x, w in zip(bufs, inputs, weights):
                _step(b, t, x[t], *w)
        feeds = {c.x[1] for c in cells if c.x[0] == "h"}  # cells whose h another one reads
        ctx.save_for_backward(*flat, *[v for j, b in enumerate(bufs) for v in (
            b.hb, b.cb, b.gb, b.tb, b.h_fin if j in feeds else None)])
        ctx.stack, ctx.steps = stack, steps
        return tuple(v for b in bufs for v in (b.hb[1:], b.h_fin, b.cb[1:], b.c_fin))

    @staticmethod
    def backward(ctx, *grads):
        stack, steps = ctx.stack, ctx.steps
        if torch.is_grad_enabled():  # create_graph=True
            return (None, None, *_replayed_grads(ctx, grads))
        saved = ctx.saved_tensors
        n = len(saved) - 5 * len(stack.plan.cells)
        rows, _, weights = stack.inputs(saved[:n])
        bufs = [_Buffers.saved(*saved[k:k + 5]) for k in range(n, len(saved), 5)]
        dgates = _walk_back(stack.plan.cells, steps, bufs, weights, grads)
        return (None, None, *_input_grads(stack, ctx.needs_input_grad[2:], rows, weights, bufs,
                                          dgates))


def _walk_back(cells, steps: int, bufs: list, weights: list, grads: tuple) -> list:
    """Every step's gate gradient per cell (``[steps, batch, 4 * hidden]``); the cells' initial
    states' gradients are left in ``bufs[j].dh`` / ``.dc``."""
    dgates, slopes, d_mid = [], [], []
    for j, b in enumerate(bufs):
        d_hs, d_h, d_cs, d_c = grads[4 * j:4 * j + 4]
        b.dh = torch.zeros_like(b.hb[0]) if d_h is None else d_h
        b.dc = torch.zeros_like(b.cb[0]) if d_c is None else d_c
        d_mid.append((None if d_hs is None else d_hs.unbind(0),
                      None if d_cs is None else d_cs.unbind(0)))
        dgates.append(torch.empty_like(b.gb))
        slope = torch.empty_like(b.gb[0])
        hidden = b.hb.shape[2]
        slopes.append((slope, slope[:, 2 * hidden:3 * hidden]))
    one = torch.ones((), dtype=bufs[0].gb.dtype)
    per_step = [d.unbind(0) for d in dgates]
    for t in reversed(range(steps)):
        for j in reversed(range(len(cells))):
            b, (d_hs, d_cs) = bufs[j], d_mid[j]
            last = t == steps - 1  # (its new h and c are h_fin, c_fin: their gradients are dh, dc)
            dhy = b.dh if last or d_hs is None else b.dh + d_hs[t]
            dcy = b.dc if last or d_cs is None else b.dc + d_cs[t]
            dg = per_step[j][t]
            dc = _step_back(b, t, dhy, dcy, dg, slopes[j], one)
            w_ih, w_hh, _, _ = weights[j]
            b.dc = dc * b.F[t]
            b.dh = dg.mm(w_hh)
            if cells[j].x[0] == "h":  # its input is an earlier cell's new h
                lower = bufs[cells[j].x[1]]
                lower.dh = dg.mm(w_ih).add_(lower.dh)
    return dgates


def _input_grads(stack: Stack, needs: tuple, rows: dict, weights: list, bufs: list,
                 dgates: list) -> list:
    """The gradients of the node's inputs (rows, states, weights), None where not needed."""
    r, k = len(stack.rows), 2 * len(bufs)
    need_row = dict(zip(stack.rows, needs[:r]))
    need_weight = dict(zip(stack.weights, needs[r + k:]))
    row_grads: dict = {}
    weight_grads: dict = {}

    def add(grads: dict, key, value) -> None:
        grads[key] = value if key not in grads else grads[key] + value
    for cell, b, dg, (w_ih, _, _, _) in zip(stack.plan.cells, bufs, dgates, weights):
        flat = dg.view(-1, dg.shape[2])
        if cell.x[0] == "row" and need_row[cell.x[1]]:
            x = rows[cell.x[1]]
            add(row_grads, cell.x[1], dg if cell.projected else flat.mm(w_ih).view(*x.shape))
        wanted = [need_weight[p] for p in cell.weights]
        if not any(wanted):
            continue
        bias = flat.sum(0)
        own = [lambda: flat.t().mm(b.hb.view(-1, b.hb.shape[2])), lambda: bias]
        if not cell.projected:
            own = [lambda: flat.t().mm(_inputs_of(cell, rows, bufs)), own[0], own[1], own[1]]
        for p, make, want in zip(cell.weights, own, wanted):
            if want:
                add(weight_grads, p, make())
    result = [row_grads.get(r) for r in stack.rows]
    result += [v for b in bufs for v in (b.dh, b.dc)]
    result += [weight_grads.get(p) for p in stack.weights]
    return [g if need else None for g, need in zip(result, needs)]


def _inputs_of(cell, rows: dict, bufs: list) -> torch.Tensor:
    """A cell's inputs of every step, one row each (``[steps * batch, in]``)."""
    if cell.x[0] == "row":
        x = rows[cell.x[1]]
        return x.reshape(-1, x.shape[2])
    lower = bufs[cell.x[1]]
    return torch.cat([lower.hb[1:].reshape(-1, lower.hb.shape[2]), lower.h_fin])


def _replayed_grads(ctx, grads: tuple) -> list:
    """The inputs' gradients under ``create_graph``: the loop replayed with ops autograd
    records, from the saved inputs (with their history), then differentiated."""
    stack, steps = ctx.stack, ctx.steps
    flat = ctx.saved_tensors[:len(ctx.needs_input_grad) - 2]
    with torch.enable_grad():
        outputs = _replay(stack, steps, flat)
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    wanted = [k for k, need in enumerate(ctx.needs_input_grad[2:]) if need]
    result: list = [None] * len(flat)
    if pairs and wanted:
        got = torch.autograd.grad([o for o, _ in pairs], [flat[k] for k in wanted],
                                  [g for _, g in pairs], create_graph=True, allow_unused=True)
        for k, g in zip(wanted, got):
            result[k] = g
    return result


def _replay(stack: Stack, steps: int, flat: tuple) -> list:
    """The node's outputs computed by ``torch.lstm_cell`` (or its projected form) per step."""
    rows, states, weights = stack.inputs(flat)
    hs, cs = [], []
    for j, cell in enumerate(stack.plan.cells):
        hs.append([states[2 * j]])
        cs.append([states[2 * j + 1]])
    for t in range(steps):
        for j, cell in enumerate(stack.plan.cells):
            x = rows[cell.x[1]][t] if cell.x[0] == "row" else hs[cell.x[1]][t + 1]
            w_ih, w_hh, b_ih, b_hh = weights[j]
            h, c = rolled_cells.projected_lstm_cell(x, (hs[j][t], cs[j][t]), w_hh, b_hh) \
                if cell.projected else torch.lstm_cell(x, (hs[j][t], cs[j][t]), w_ih, w_hh, b_ih, b_hh)
            hs[j].append(h)
            cs[j].append(c)
    outputs = []
    for h, c in zip(hs, cs):
        outputs += [_stacked(h[1:-1], h[0]), h[-1], _stacked(c[1:-1], c[0]), c[-1]]
    return outputs


def _stacked(items: list, like: torch.Tensor) -> torch.Tensor:
    return torch.stack(items) if items else like.new_empty(0, *like.shape)
