"""The autograd graph of a rolled loop's fused LSTM cells (fx_lower/rolled/cells.py) outlives
the optimized call: whatever the caller does with it afterwards must give eager's results.
Double backward (``create_graph=True`` then a second backward, a gradient penalty), an
``autograd.grad`` that reaches the cells but not the weights before a full ``backward()``,
and ``torch.func`` grad-of-grad: all equal to eager, with the fused cells running."""
import copy

import pytest
import torch
from torch import nn

import specularch

from differential import T, assert_same

TOL = {"rtol": 1e-5, "atol": 1e-6}
LENGTHS = [3, 5, 4, 6, 2, 7, 9, 8, 10]


class _Cells(nn.Module):
    """Two stacked cells over a sequence; the second's weights frozen when ``frozen``."""

    def __init__(self, frozen=False):
        super().__init__()
        self.a, self.b = nn.LSTMCell(4, 5), nn.LSTMCell(5, 5)
        self.b.requires_grad_(not frozen)

    def forward(self, x, h, c, hb, cb):
        for t in range(x.shape[0]):
            h, c = self.a(x[t], (h, c))
            hb, cb = self.b(torch.tanh(h), (hb, cb))
        return hb.pow(2).sum() + c.sum()


def _args(i, requires_grad=True):
    n = LENGTHS[i]
    return (T(n, 3, 4, requires_grad=requires_grad, seed=i),
            T(3, 5, requires_grad=requires_grad, seed=100 + i), T(3, 5, seed=200 + i),
            T(3, 5, seed=300 + i), T(3, 5, seed=400 + i))


def _compare_all(eager, opt, args_e, args_o, what):
    for k, (a, b) in enumerate(zip(args_e, args_o)):
        assert_same(a.grad, b.grad, f"{what}: arg {k} grad", **TOL)
    for (name, p), q in zip(eager.named_parameters(), opt.parameters()):
        assert_same(p.grad, q.grad, f"{what}: {name}.grad", **TOL)


def _each_length_like_eager(eager, opt, use):
    """``use(model, args)`` on eager and optimized twins for every length: equal results
    (where ``use`` returns one) and gradients, and the fused cells ran."""
    for i in range(len(LENGTHS)):
        args_e, args_o = _args(i), _args(i)
        expected, got = use(eager, args_e), use(opt, args_o)
        if expected is not None:
            assert_same(expected, got, f"call {i}", **TOL)
        _compare_all(eager, opt, args_e, args_o, f"call {i} (length {LENGTHS[i]})")
    _fused(opt)


def _fused(opt):
    report = specularch.explain(opt)
    assert report.stats.graph_hits >= 3, report
    assert "2 LSTM cells fused" in report.graphs[-1].loops[0].faster, report


@pytest.mark.parametrize("frozen", [False, True])
def test_double_backward_outside_the_call_matches_eager(frozen):
    # forward captured; the caller differentiates twice through the rolled cells
    torch.manual_seed(0)
    eager = _Cells(frozen)
    opt = specularch.optimize(copy.deepcopy(eager))
    def twice(model, args):
        model.zero_grad()
        loss = model(*args)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, [*params, args[0], args[1]], create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()
    _each_length_like_eager(eager, opt, twice)


def test_a_gradient_penalty_on_the_optimized_model_matches_eager():
    # (autograd.grad inside an optimized function runs eagerly: the model is what is optimized)
    torch.manual_seed(0)
    eager = _Cells()
    opt_model = specularch.optimize(copy.deepcopy(eager))

    def penalised(model, args):
        model.zero_grad()
        loss = model(*args)
        (gx,) = torch.autograd.grad(loss, args[0], create_graph=True)
        total = loss + gx.pow(2).sum() * 10
        total.backward()
        return total
    _each_length_like_eager(eager, opt_model, penalised)


def test_a_grad_that_skips_the_weights_adds_nothing_to_a_later_backward():
    # autograd.grad(loss, x) runs the cells' backward but not the weights': what the cells
    # kept for the weight gradients must not leak into the next backward()
    torch.manual_seed(0)
    eager = _Cells()
    opt = specularch.optimize(copy.deepcopy(eager))
    def input_grad_then_backward(model, args):
        model.zero_grad()
        loss = model(*args)
        (gx,) = torch.autograd.grad(loss, args[0], retain_graph=True)
        args[0].grad = gx
        loss.backward()
    _each_length_like_eager(eager, opt, input_grad_then_backward)


def test_torch_func_grad_of_grad_matches_eager():
    torch.manual_seed(0)
    eager = _Cells()
    opt = specularch.optimize(copy.deepcopy(eager))
    for i in range(4):  # a graph with fused cells exists before torch.func calls it
        opt(*_args(i)).backward()
    for i in range(4, 7):
        x, h, c, hb, cb = _args(i, requires_grad=False)
        results = []
        for model in (eager, opt):
            def first(h0, model=model):
                return torch.func.grad(lambda h1: model(x, h1, c, hb, cb))(h0).pow(2).sum()
            results.append(torch.func.grad(first)(h))
        assert_same(results[0], results[1], f"call {i}", **TOL)
