"""Flattened training steps that return or store tensors whose history their own backward
used up (``fx_lower/spent.py``): compiled by TorchScript, with eager's spent history."""
import pytest
import torch
from torch import nn

import specularch
from specularch.workloads import lstm_lm

from differential import lm_train_step

FREED = "Trying to backward through the graph a second time"


def _lm_pair(dropout):
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(lstm_lm.LSTMLM(50, 16, 2, dropout=dropout))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    return models, [lm_train_step(m, o) for m, o in zip(models, opts)], opts


def _batches(steps, length=4, batch=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 50, (length, batch), generator=g),
             torch.randint(0, 50, (length, batch), generator=g)) for _ in range(steps)]


def _backward_error(tensor):
    with pytest.raises(RuntimeError) as error:
        tensor.sum().backward()
    return str(error.value)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_lstm_lm_step_storing_its_state_runs_on_torchscript(dropout):
    """The whole step (its state stored on ``self``, its loss returned, both with history its
    backward used up) runs on TorchScript, not fx; values, gradients, parameters, optimizer
    state and the stored state's autograd behaviour as eager's."""
    (eager, fast), (slow_step, fast_step), opts = _lm_pair(dropout)
    fast_step = specularch.optimize(fast_step, backend="torchscript")
    tol = dict(rtol=1e-5, atol=1e-6)
    for i, (tokens, targets) in enumerate(_batches(6)):
        torch.manual_seed(100 + i)
        expected = slow_step(tokens, targets)
        torch.manual_seed(100 + i)
        loss = fast_step(tokens, targets)
        torch.testing.assert_close(loss, expected, **tol)
        assert (loss.requires_grad, loss.grad_fn is None) == (expected.requires_grad, False)
        for p, q in zip(fast.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, **tol)
            torch.testing.assert_close(p.grad, q.grad, **tol)
            for key in opts[0].state[q]:
                torch.testing.assert_close(opts[1].state[p][key], opts[0].state[q][key], **tol)
        for (h, c), (h0, c0) in zip(fast.state, eager.state):
            for t, t0 in ((h, h0), (c, c0)):
                torch.testing.assert_close(t, t0, **tol)
                assert (t.requires_grad, t.is_leaf, t.grad_fn is None) == \
                       (t0.requires_grad, t0.is_leaf, False)
    grads = [p.grad.clone() for p in fast.parameters()]
    for t, t0 in ((fast.state[-1][1], eager.state[-1][1]), (loss, expected)):
        assert FREED in _backward_error(t0)
        assert _backward_error(t) == _backward_error(t0)
        with pytest.raises(RuntimeError, match=FREED):
            torch.autograd.grad(t.sum(), list(fast.parameters()), allow_unused=True)
    assert all(torch.equal(p.grad, g) for p, g in zip(fast.parameters(), grads))
    e = specularch.explain(fast_step)
    assert e.fallbacks == [] and [g.backend for g in e.graphs] == ["torchscript"], str(e)


class Scaled(nn.Module):
    """Stores ``weight * 2``: its history (a product with a number saves no tensor) still
    reaches the weight after the step's backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kept = None

    def forward(self, x):
        self.kept = self.lin.weight * 2
        return self.lin(x).sum()


def test_stored_tensor_whose_history_can_still_run_keeps_autograd():
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Scaled())
    steps = []
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, m=m, opt=opt):
            opt.zero_grad()
            loss = m(x)
            loss.backward()
            opt.step()
            return loss.item()
        steps.append(step)
    fast_step = specularch.optimize(steps[1], backend="torchscript")
    for i in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        assert fast_step(x) == pytest.approx(steps[0](x), rel=1e-6)
    kept, kept0 = models[1].kept, models[0].kept
    kept0.sum().backward()  # eager: accumulates into the weight's .grad
    kept.sum().backward()
    torch.testing.assert_close(models[1].lin.weight.grad, models[0].lin.weight.grad)
    e = specularch.explain(fast_step)
    assert [g.backend for g in e.graphs] == ["fx"], str(e)
    assert "a later backward could still run" in e.graphs[0].note, str(e)
