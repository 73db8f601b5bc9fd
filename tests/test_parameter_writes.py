"""In-place parameter updates that training scripts make inside a captured step.

* through ``.data`` (manual SGD: ``p.data.add_(p.grad, alpha=-lr)``): eager writes ``p``'s
  memory without autograd and without bumping ``p._version``;
* into a parameter that the same step read through views (GAT's ``self.a[:n]`` in forward,
  then Adam's update): safe while those views are not read after the write.

Each step is run eagerly and optimized on identical modules; besides what ``check_module``
compares (outputs, parameters, optimizer state, bit for bit), every parameter's ``.grad`` and
autograd version counter (``p._version``) must be eager's after every call. The unsafe cases
(a view, or a ``.data``, from before the write read after it; a backward after a ``.data``
write reading what autograd saved before it) must stay exact: they fall back.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from tests.differential import A, Pair, T, assert_same, check, expect_fallback, expect_graph

CALLS = 6


def _same_versions_and_grads(eager: nn.Module, opt: nn.Module, label: str) -> None:
    for (name, pe), (_, po) in zip(eager.named_parameters(), opt.named_parameters()):
        assert pe._version == po._version, (
            f"{label}: {name}._version: eager {pe._version}, optimized {po._version}")
        assert_same(pe.grad, po.grad, f"{label}: {name}.grad")
        if hasattr(eager, "_opt"):  # (the optimizer's state is keyed by the parameters)
            assert_same(eager._opt.state[pe], opt._opt.state[po], f"{label}: state of {name}")


def check_step(make_module, make_args, *, expect="graph", fallback_kind=None, calls=CALLS):
    """``check_module`` plus the parameters' ``.grad`` and version counters after each call."""
    pair = Pair.of_module(make_module)
    quiet = specularch.config.patch(strict=False) if expect == "fallback" else contextlib.nullcontext()
    with quiet:
        for i in range(calls):
            pair.step(make_args)
            _same_versions_and_grads(pair.eager_roots["self"], pair.opt_roots["self"], f"call #{i + 1}")
    explanation = pair.explain()
    assert not [f for f in explanation.fallbacks if f.kind == "internal_error"], str(explanation)
    if expect == "graph":
        expect_graph(explanation)
    else:
        expect_fallback(explanation, fallback_kind)
    return explanation


def _batch(i):
    return A(T(4, 3), T(4, 2))


# ---------------------------------------------------------------- writes through .data

class ManualSGD(nn.Module):
    """word_language_model / regression: backward, then ``p.data.add_(p.grad, alpha=-lr)``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        self.lr = 0.1

    def forward(self, x, y):
        self.net.zero_grad()
        loss = F.mse_loss(self.net(x), y)
        loss.backward()
        for p in self.net.parameters():
            p.data.add_(p.grad, alpha=-self.lr)
        return loss.detach()


def test_manual_sgd_through_data_is_captured_without_version_bumps():
    check_step(ManualSGD, _batch)


class DataOps(nn.Module):
    """``.data`` written by several ops, twice in one call, and mixed with a bumping write."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x, y):
        self.w.data.mul_(0.9)
        self.w.data.clamp_(-1.0, 1.0)          # a second write through a new `.data`
        d = self.b.data
        d.add_(y.sum(0))
        d.mul_(0.5)                            # through the same `.data` again
        with torch.no_grad():
            self.b.add_(1.0)                   # bumps b's version once, as eager
        return x @ self.w + self.b, d          # reads see every write; d is b's memory


def test_data_writes_compose_and_are_read_back():
    check_step(DataOps, lambda i: A(T(2, 4), T(2, 3)))


class CopyIntoData(nn.Module):
    """``p.data.copy_(src)``, e.g. loading averaged or target-network weights."""

    def __init__(self):
        super().__init__()
        self.online = nn.Linear(3, 2)
        self.target = nn.Linear(3, 2)

    def forward(self, x, y):
        loss = F.mse_loss(self.online(x), y) + F.mse_loss(self.target(x), y)
        for t, o in zip(self.target.parameters(), self.online.parameters()):
            t.data.copy_(0.5 * t.data + 0.5 * o.data)
        return loss, self.target(x)            # the second read sees the copied weights


def test_data_copy_from_a_tensor_is_captured_and_read_back():
    check_step(CopyIntoData, _batch)


def test_data_write_on_an_argument_then_read_with_grad():
    """The minimal reproduction, with the parameter read after the write (gradients to it)."""
    def step(w, x):
        w.data.add_(x)
        return w * x

    check(step, lambda: A(nn.Parameter(T(3)), T(3, requires_grad=True)), calls=CALLS,
          expect="graph", grad=True)


def test_data_write_returns_a_tensor_sharing_the_parameters_memory():
    class Ret(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return self.w.data.add_(x)

    eager, opt = Ret(), specularch.optimize(Ret())
    for i in range(CALLS):
        x = torch.full((3,), float(i))
        re, ro = eager(x), opt(x)
        assert_same(re, ro)
        assert ro.untyped_storage().data_ptr() == opt.w.untyped_storage().data_ptr()
        assert not ro.requires_grad and opt.w._version == eager.w._version == 0
    expect_graph(specularch.explain(opt))


class WriteBeforeBackward(nn.Module):
    """``w`` written between forward and backward, through ``.data`` or under no_grad. Eager's
    backward gives ``w`` its gradient (it is still the leaf). Where autograd saved ``w``, a
    write through ``.data`` (no version bump, no error) leaves eager's backward reading the
    new ``w``, the graph's would read the old one: refused; a bumping write makes eager raise."""

    def __init__(self, how, saved):
        super().__init__()
        self.v = nn.Parameter(torch.randn(3, 2))
        self.w = nn.Parameter(torch.randn(2))
        self.how, self.saved = how, saved

    def forward(self, x, y):
        self.v.grad = self.w.grad = None
        h = x @ self.v
        loss = F.mse_loss(h * self.w if self.saved else h + self.w, y)
        if self.how == "data":
            self.w.data.mul_(0.5)
        else:
            with torch.no_grad():
                self.w.mul_(0.5)
        loss.backward()
        return loss.detach()


@pytest.mark.parametrize("how", ["data", "no_grad"])
def test_write_between_forward_and_backward_keeps_the_leaf_gradient(how):
    check_step(lambda: WriteBeforeBackward(how, saved=False), _batch)


@pytest.mark.parametrize("how, kind", [("data", "input_mutation"),
                                       ("no_grad", "exception_handling")])
def test_write_of_a_tensor_saved_for_a_later_backward_falls_back(how, kind):
    check_step(lambda: WriteBeforeBackward(how, saved=True), _batch, expect="fallback",
               fallback_kind=kind)


class StaleData(nn.Module):
    """A ``.data`` taken before a write through another ``.data``, read after it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        d = self.w.data
        self.w.data.add_(x)
        return d * 2                           # eager: the new values


def test_stale_data_read_after_the_write_falls_back():
    check_step(StaleData, lambda i: A(T(3)), expect="fallback", fallback_kind="input_mutation")


# ---------------------------------------------------------------- views, then the update

class GATLike(nn.Module):
    """``self.a`` sliced in forward, then updated by Adam after backward in the same step."""

    def __init__(self):
        super().__init__()
        self.W = nn.Linear(3, 4, bias=False)
        self.a = nn.Parameter(torch.randn(8, 1))
        self._opt = torch.optim.Adam(self.parameters(), lr=0.05)

    def forward(self, x, y):
        self._opt.zero_grad()
        h = self.W(x)
        e = h @ self.a[:4, :] + (h @ self.a[4:, :]).T
        loss = F.mse_loss(torch.softmax(F.leaky_relu(e), dim=1) @ h[:, :2], y)
        loss.backward()
        self._opt.step()
        return loss.detach()


def test_views_of_a_parameter_dead_before_adam_update_are_captured():
    check_step(GATLike, _batch)


class ViewThenUpdate(nn.Module):
    """Views of ``w`` taken before a no_grad update; ``mode`` says how they are used."""

    def __init__(self, mode):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 2))
        self.mode = mode

    def forward(self, x):
        top = self.w[:2]
        out = x @ top.T                        # read before the write: fine
        with torch.no_grad():
            self.w.mul_(0.9)
        if self.mode == "returned":
            return out, top                    # eager: `top` shows the new values
        if self.mode == "read":
            return out + top.sum()             # eager: reads the new values
        if self.mode == "item":
            return out, top[0, 0].item()       # eager: the new value
        return out + self.w[:2].sum()          # a view taken after the write: fine


def test_view_read_before_the_update_only_is_captured():
    check_step(lambda: ViewThenUpdate("fresh"), lambda i: A(T(3, 2)))


def test_view_returned_after_the_update_falls_back():
    check_step(lambda: ViewThenUpdate("returned"), lambda i: A(T(3, 2)), expect="fallback",
               fallback_kind="input_mutation")


@pytest.mark.parametrize("mode", ["read", "item"])
def test_view_read_after_the_update_falls_back(mode):
    check_step(lambda: ViewThenUpdate(mode), lambda i: A(T(3, 2)), expect="fallback",
               fallback_kind="input_mutation")


class SavedViewThenUpdate(nn.Module):
    """A view saved by autograd, the parameter updated, then backward: eager raises."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 2))

    def forward(self, x):
        loss = (x @ self.w[:2].T).sum() + self.w[2:].square().sum()  # saves w[2:]
        with torch.no_grad():
            self.w.mul_(0.9)
        loss.backward()
        return loss.detach()


def test_backward_through_a_view_after_the_update_raises_as_eager():
    pair = Pair.of_module(SavedViewThenUpdate)
    with specularch.config.patch(strict=False):
        for i in range(CALLS):
            pair.step(lambda: A(T(3, 2)))  # both sides raise the same RuntimeError
            _same_versions_and_grads(pair.eager_roots["self"], pair.opt_roots["self"], f"call #{i}")
    explanation = specularch.explain(pair.target)
    assert not explanation.graphs and explanation.stats.fallback_calls == CALLS - 3, str(explanation)
    assert {f.kind for f in explanation.fallbacks} == {"exception_handling"}, str(explanation)
