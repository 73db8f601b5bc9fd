"""Last step's gradients released before the graph runs (``shadow_heap/release.py``), as
eager's ``opt.zero_grad()`` releases them before its forward: the new gradients can reuse
their memory, and no extra set of gradients is alive at the step's peak (issue 14 item 6).

Differential: eager and optimized steps on identical models, interleaved; a probe op in the
forward (a custom op: a graph node, run when the graph runs) counts how many of the model's
gradients from before the call are still alive at that moment. Eager: none. Values,
gradients, optimizer state and version counters are compared bit for bit after every call,
including calls that raise in the middle of the step and calls whose in-graph assumption
fails (those keep the gradients until the commit)."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of
from tests.test_copy_tax import _Bumps, _batches, _model, _same

_LIVE: list = []     # weak references to the gradients the model had before the call
_ALIVE: list = []    # what the probe saw, one count per run of it


@torch.library.custom_op("specularch_tests::count_old_grads", mutates_args=())
def count_old_grads(y: torch.Tensor) -> torch.Tensor:
    """``y`` unchanged (a copy); notes how many old gradients are alive right now."""
    _ALIVE.append(sum(ref() is not None for ref in _LIVE))
    return y.clone()


@count_old_grads.register_fake
def _(y):
    return torch.empty_like(y)


_OPTS = [lambda ps: torch.optim.SGD(ps, lr=0.1),
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
         lambda ps: torch.optim.Adam(ps, lr=0.01),
         lambda ps: torch.optim.AdamW(ps, lr=0.01)]
_IDS = ["sgd", "momentum", "adam", "adamw"]


def _probe_step(model, opt):
    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), count_old_grads(y))
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _run(fn, model, *args):
    """``fn(*args)``, and how many of ``model``'s old gradients the graph's (or eager's)
    forward saw alive (the last probe run: capture runs it once more before)."""
    _LIVE[:] = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
    _ALIVE.clear()
    try:
        return fn(*args), (_ALIVE[-1] if _ALIVE else None)
    finally:
        _LIVE.clear()


def _pair(make_step, make_opt, wide=False):
    model = _model(wide=wide)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref_model.parameters())
    fast = specularch.optimize(make_step(model, opt))
    return (fast, model, opt), (make_step(ref_model, ref_opt), ref_model, ref_opt)


def _source(fast) -> str:
    """Every graph entry's source (a call after one that dropped the gradients may capture
    the path where they are None)."""
    return "\n".join(e.entry_source for e in _state_of(fast).entries)


@pytest.mark.parametrize("make_opt", _OPTS, ids=_IDS)
def test_old_gradients_are_freed_before_the_forward_as_in_eager(make_opt):
    (fast, model, opt), (ref, ref_model, ref_opt) = _pair(_probe_step, make_opt, wide=True)
    bumps = _Bumps((model, opt), (ref_model, ref_opt))
    for i, (x, y) in enumerate(_batches(8)):
        expected, eager_alive = _run(ref, ref_model, x, y)
        got, alive = _run(fast, model, x, y)
        assert got == expected
        assert alive == eager_alive == 0, f"call {i}: {alive} old gradients alive in the graph"
        _same(model, opt, ref_model, ref_opt)
        bumps.step()
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.stats.graph_hits >= 4, str(e)
    assert "RELEASE_GRADS((" in _source(fast)


def _lookup_step(zero_grad_first: bool):
    """A step whose forward raises on an index out of range (capture saw valid ones), with
    ``zero_grad()`` before the forward or after it."""
    def make(model, opt):
        table = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))

        def step(x, y, idx):
            if zero_grad_first:
                opt.zero_grad()
            loss = nn.functional.mse_loss(model(x) + nn.functional.embedding(idx, table), y)
            if not zero_grad_first:
                opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()
        return step
    return make


@pytest.mark.parametrize("zero_grad_first", [True, False], ids=["zero_grad-first", "forward-first"])
@pytest.mark.parametrize("make_opt", [_OPTS[0], _OPTS[2]], ids=["sgd", "adam"])
def test_a_step_that_raises_mid_way_leaves_the_state_eager_leaves(make_opt, zero_grad_first):
    """Zero_grad first: eager dropped the gradients before its forward raised, and so did
    the optimized step (released before the graph; the eager re-run found them dropped).
    Forward first: eager raised with last step's gradients still there; they are not
    released before the graph, which raised before any commit."""
    (fast, model, opt), (ref, ref_model, ref_opt) = _pair(_lookup_step(zero_grad_first), make_opt)
    bumps = _Bumps((model, opt), (ref_model, ref_opt))
    ok, bad = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), torch.tensor([0, 1, 2, 9, 4, 0, 1, 2])
    for i, (x, y) in enumerate(_batches(9)):
        if i == 7:
            with pytest.raises(IndexError):
                ref(x, y, bad)
            with pytest.raises(IndexError):
                fast(x, y, bad)
            assert all((p.grad is None) is zero_grad_first for p in model.parameters())
        else:
            assert fast(x, y, ok) == ref(x, y, ok)
        _same(model, opt, ref_model, ref_opt)
        bumps.step()
    assert ("RELEASE_GRADS((" in _source(fast)) is zero_grad_first
    assert specularch.explain(fast).stats.graph_hits >= 3


class _Box:
    big = 0
    prev = None


def test_a_failed_assumption_keeps_the_old_gradients_until_the_commit():
    """A branch on the loss (a Python write on one side) is checked after the graph: the
    gradients stay until the commit, and the eager re-run after the failed assumption starts
    from the state before the call."""
    def make(model, opt, box):
        def step(x, y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), count_old_grads(y))
            loss.backward()
            opt.step()
            if loss > 100.0:
                box.big += 1
            return loss.item()
        return step
    box, ref_box = _Box(), _Box()
    model = _model()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = _OPTS[2](model.parameters()), _OPTS[2](ref_model.parameters())
    fast, ref = specularch.optimize(make(model, opt, box)), make(ref_model, ref_opt, ref_box)
    bumps = _Bumps((model, opt), (ref_model, ref_opt))
    for i, (x, y) in enumerate(_batches(10)):
        scale = 100.0 if i == 7 else 0.1  # the loss crosses 100 after capture
        expected, _ = _run(ref, ref_model, x * scale, y * scale)
        got, alive = _run(fast, model, x * scale, y * scale)
        assert got == expected
        if i in (5, 6):  # graph hits: the graph ran with last step's gradients alive
            assert alive == len(list(model.parameters()))
        _same(model, opt, ref_model, ref_opt)
        assert box.big == ref_box.big
        bumps.step()
    assert "RELEASE_GRADS" not in _source(fast)
    assert specularch.explain(fast).stats.assumption_failures == 1


@pytest.mark.parametrize("keep", ["returned", "stored"])
def test_an_old_gradient_the_call_reads_is_not_released_early(keep):
    """The call keeps last step's gradient of the first layer (returns it, or stores it on
    an object) before ``zero_grad()``: the entry reads it after the graph, so it stays."""
    def make(model, opt, box):
        def step(x, y):
            prev = model[0].weight.grad
            if keep == "stored":
                box.prev = prev
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return (loss.item(), prev) if keep == "returned" else loss.item()
        return step
    box, ref_box = _Box(), _Box()
    model = _model()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = _OPTS[1](model.parameters()), _OPTS[1](ref_model.parameters())
    fast, ref = specularch.optimize(make(model, opt, box)), make(ref_model, ref_opt, ref_box)
    for x, y in _batches(8):
        got, expected = fast(x, y), ref(x, y)
        if keep == "returned":
            assert got[0] == expected[0]
            assert (got[1] is None) == (expected[1] is None)
            assert got[1] is None or torch.equal(got[1], expected[1])
        else:
            assert got == expected
            assert (box.prev is None) == (ref_box.prev is None)
            assert box.prev is None or torch.equal(box.prev, ref_box.prev)
        _same(model, opt, ref_model, ref_opt)
    assert specularch.explain(fast).stats.graph_hits >= 4
    assert "RELEASE_GRADS" not in _source(fast)


def test_a_gradient_set_before_zero_grad_through_another_path_ends_none():
    """``model[0].weight.grad = saved`` then ``opt.zero_grad()``: the same tensor's ``.grad``
    written through the module, then dropped through the optimizer. The drop is not done
    before the graph (the commit's earlier write would then bring ``saved`` back)."""
    def make(model, opt, box):
        def step(x):
            model[0].weight.grad = box.saved
            opt.zero_grad()
            return model(x).sum().item()
        return step
    box, ref_box = _Box(), _Box()
    model = _model()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = _OPTS[0](model.parameters()), _OPTS[0](ref_model.parameters())
    fast, ref = specularch.optimize(make(model, opt, box)), make(ref_model, ref_opt, ref_box)
    for i, (x, _) in enumerate(_batches(7)):
        box.saved, ref_box.saved = torch.full((16, 6), float(i)), torch.full((16, 6), float(i))
        assert fast(x) == ref(x)
        _same(model, opt, ref_model, ref_opt)
        assert model[0].weight.grad is None
    assert specularch.explain(fast).stats.graph_hits >= 3
    assert "RELEASE_GRADS" not in _source(fast)
