"""A cached graph keeps none of its capture's autograd history (``fx_lower/history.py``).

Autograd keeps one ``AccumulateGrad`` node per parameter for as long as a history refers to
it, and sums each gradient to the parameter's shape when that node was made. Eager's history
dies with the step; capture's, held by the examples of a cached graph, kept the node alive:
after ``bias.resize_(1, 2)`` the bias's gradient came out as ``(2,)`` instead of eager's
``(1, 2)``."""
import gc

import torch
from torch import nn

import specularch
from specularch.api import _state_of
from differential import expect_graph


def _resize(bias: nn.Parameter) -> None:
    bias.requires_grad_(False).resize_(1, 2).requires_grad_(True)  # resize_ refuses a leaf that requires grad


def _grad_step(model):
    def step(x):
        model.zero_grad()
        model(x).sum().backward()
        return model.bias.grad
    return step


def _models():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    torch.manual_seed(0)
    return model, nn.Linear(4, 2)


def test_a_gradient_after_a_resize_has_the_parameters_new_shape_as_in_eager(no_profiling):
    model, ref = _models()
    fast, eager = specularch.optimize(_grad_step(model), backend="fx"), _grad_step(ref)
    x = torch.randn(3, 4)
    for _ in range(2):
        assert torch.equal(fast(x), eager(x))
    assert max(e.hits for e in _state_of(fast).entries) >= 1
    _resize(model.bias)
    _resize(ref.bias)
    for _ in range(2):
        got, want = fast(x), eager(x)
        assert got.shape == want.shape == (1, 2) and torch.equal(got, want)
        assert torch.equal(model.weight.grad, ref.weight.grad)
    expect_graph(specularch.explain(fast))  # the recaptured graph ran: its gradient is eager's


def test_no_tensor_with_autograd_history_outlives_a_cached_training_step(no_profiling):
    model, _ = _models()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    fast = specularch.optimize(step, backend="fx")
    for _ in range(3):
        fast(torch.randn(3, 4))
    assert _state_of(fast).entries
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None]
    assert alive == []
