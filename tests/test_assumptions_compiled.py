"""Graphs that check an in-graph assumption (a speculated tensor branch) compiled by
TorchScript: the check reads the compiled graph's output; a failed one runs the original."""
import torch
from torch import nn

import specularch

from differential import A, T, check


def branchy(x, w):
    y = x @ w
    if y.sum() > 0:
        return y * 2
    return y * 3


def _args(i, flips=()):
    x, w = T(2, 3), T(3, 3)
    sign = -1 if i in flips else 1
    return A(sign * x.abs(), w.abs())


def test_speculated_branch_runs_on_torchscript():
    e = check(branchy, _args, calls=6, expect="graph", backend="torchscript")
    assert [g.backend for g in e.graphs] == ["torchscript"], str(e)


def test_failed_assumption_of_a_torchscript_graph_runs_the_original():
    e = check(branchy, lambda i: _args(i, flips=(4, 6)), calls=8, backend="torchscript")
    assert e.stats.assumption_failures >= 1, str(e)


def test_training_step_with_a_speculated_branch_on_torchscript():
    """A whole training step (flattened) that halves a large loss before its backward."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    steps = []
    for m in models:
        opt = torch.optim.Adam(m.parameters(), lr=0.05)

        def step(x, y, m=m, opt=opt):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            if loss > 1.0:
                loss = loss * 0.5
            loss.backward()
            opt.step()
            return loss.item()
        steps.append(step)
    fast = specularch.optimize(steps[1], backend="torchscript")
    g = torch.Generator().manual_seed(3)
    for i in range(10):
        x = torch.randn(16, 4, generator=g)
        y = torch.randn(16, 1, generator=g) * 4.0  # the loss stays above 1: no flip
        expected, got = steps[0](x, y), fast(x, y)
        assert abs(got - expected) <= 1e-5 * abs(expected) + 1e-7, (i, got, expected)
        for p, q in zip(models[1].parameters(), models[0].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    e = specularch.explain(fast)
    assert e.graphs and all(g.backend == "torchscript" for g in e.graphs), str(e)
