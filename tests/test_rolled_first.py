"""A rolled loop's iteration 0 run by its body (symbolic/rolled/first.py) where it
is the body's own work: equal to eager within rounding (loss, parameters, gradients, the
model's carried state, every length including 1 and 2, with and without dropout), no copy
of iteration 0 left in the graph, and nothing of it where iteration 0 differs from the body
or with ``templates="exact"``."""
import copy

import pytest
import torch
from torch import nn

import specularch
from specularch.symbolic.rolled.loops import RolledLoop

from differential import assert_same
from test_rolled_fast import LENGTHS, RTOL, _train_both

FOLDED = "iteration 0 run by the body"


def _loop_of(opt_fn) -> RolledLoop:
    gm = specularch.api._state_of(opt_fn).entries[0].capture.graph_module
    (loop,) = [n.target for n in gm.graph.nodes if isinstance(n.target, RolledLoop)]
    return loop


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_lm_runs_its_first_step_in_the_body_and_trains_like_eager(dropout):
    report = _train_both([*LENGTHS, 1, 2, 3, 1], dropout=dropout, templates="batched",
                         rtol=RTOL, momentum=0.9)
    assert report.stats.captures == 1 and not report.fallbacks, report
    (loop,) = report.graphs[0].loops
    assert FOLDED in loop.faster, report
    code = report.graphs[0].code
    assert "lstm_cell" not in code and "embedding" not in code, code  # no peeled step 0


def test_exact_mode_keeps_iteration_0_in_the_graph():
    report = _train_both(LENGTHS, dropout=0.0, templates="exact", rtol=0.0)
    (loop,) = report.graphs[0].loops
    assert FOLDED not in str(loop), report
    assert "lstm_cell" in report.graphs[0].code


class _FirstDiffers(nn.Module):
    """Iteration 0 does other work than the rest (its own scale): it stays peeled."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)

    def forward(self, xs, h, c):
        outs, scale = [], 2.0
        for t in range(xs.shape[0]):
            h, c = self.cell(xs[t] * scale, (h, c))
            scale = 1.0
            outs.append(h)
        return torch.stack(outs), c


class _Accumulate(nn.Module):
    """A running sum and a cell from given states (inputs that need grads): the carried
    inputs at ``t = 0`` are the caller's tensors, with their gradients."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)

    def forward(self, xs, h, c):
        total = torch.zeros_like(h)
        for t in range(xs.shape[0]):
            h, c = self.cell(xs[t], (h, c))
            total = total + h * c
        return total, h, c


def _differential(module_cls, lengths):
    torch.manual_seed(0)
    eager = module_cls()
    model = copy.deepcopy(eager)
    opt = specularch.optimize(model, backend="fx")
    data = torch.Generator().manual_seed(3)
    for n in lengths:
        xs = torch.randn(n, 2, 3, generator=data)
        h0, c0 = torch.randn(2, 4, generator=data), torch.randn(2, 4, generator=data)
        ins_e = [v.clone().requires_grad_() for v in (xs, h0, c0)]
        ins_o = [v.clone().requires_grad_() for v in (xs, h0, c0)]
        expected, got = eager(*ins_e), opt(*ins_o)
        assert_same(expected, got, f"outputs (length {n})", rtol=1e-4, atol=1e-6)
        sum(o.sum() for o in expected).backward()
        sum(o.sum() for o in got).backward()
        for a, b, name in zip(ins_e, ins_o, ("xs", "h0", "c0")):
            assert_same(a.grad, b.grad, f"{name}.grad (length {n})", rtol=1e-4, atol=1e-6)
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert_same(p.grad, q.grad, f"{name}.grad (length {n})", rtol=1e-4, atol=1e-6)
    return opt


def test_carried_inputs_at_t0_are_the_callers_tensors_with_their_gradients():
    opt = _differential(_Accumulate, [3, 4, 5, 1, 2, 7])
    assert FOLDED in _loop_of(opt).report.faster, specularch.explain(opt)


def test_an_iteration_0_unlike_the_body_stays_in_the_graph():
    opt = _differential(_FirstDiffers, [3, 4, 5, 1, 2, 6])
    loop = _loop_of(opt)
    assert loop.first == 1 and FOLDED not in loop.report.faster, specularch.explain(opt)
