"""Whole training steps as one captured program: forward, `loss.backward()`, `opt.step()`,
`opt.zero_grad()`, `.item()` logging, LR schedulers stepping between calls, `torch.no_grad()`
blocks, gradient clipping, zero_grad variants, and all-or-nothing commits of parameters,
`.grad` and optimizer state — each differential against eager over many steps."""
import copy

import pytest
import torch
from torch import nn

import specularch
from differential import A, T, check, check_module

STEPS = 20


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, dampening=0.1)
    if name == "sgd_nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, maximize=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))
    if name == "adam_amsgrad":
        return torch.optim.Adam(params, lr=1e-2, amsgrad=True)
    if name == "adamw_amsgrad":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True)
    raise ValueError(name)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _make_step(model, opt, loss_fn):
    def train_step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


def _assert_same_training(m_fast, m_ref, o_fast, o_ref):
    for (name, p), q in zip(m_fast.named_parameters(), m_ref.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    for p, q in zip(m_fast.parameters(), m_ref.parameters()):
        s_fast, s_ref = o_fast.state.get(p, {}), o_ref.state.get(q, {})
        assert s_fast.keys() == s_ref.keys()
        for key in s_fast:
            assert torch.equal(s_fast[key], s_ref[key]), f"optimizer state {key} differs"


@pytest.mark.parametrize("opt_name", ["sgd", "sgd_momentum", "sgd_nesterov", "adam", "adamw",
                                      "adam_amsgrad", "adamw_amsgrad"])
@pytest.mark.parametrize("profile", [0, 3])
def test_training_step_matches_eager_bit_for_bit(opt_name, profile):
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = _optimizer(opt_name, m_fast.parameters()), _optimizer(opt_name, m_ref.parameters())
    loss_fn = nn.MSELoss()
    fast = specularch.optimize(_make_step(m_fast, o_fast, loss_fn))
    slow = _make_step(m_ref, o_ref, loss_fn)
    with specularch.config.patch(profile_calls=profile):
        for step in range(STEPS):
            x, y = _batch(step)
            assert fast(x, y) == slow(x, y), f"loss differs at step {step}"
            _assert_same_training(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.fallbacks == [], str(e)
    assert 1 <= len(e.graphs) <= 2, str(e)   # first step creates optimizer state: one more graph
    assert e.stats.graph_hits >= STEPS - profile - 2, str(e)
    params = {id(p) for p in m_fast.parameters()}
    assert all(id(p) in params for p in o_fast.param_groups[0]["params"])  # identity preserved


def test_lr_scheduler_between_calls_does_not_recompile():
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = _optimizer("adam", m_fast.parameters()), _optimizer("adam", m_ref.parameters())
    s_fast = torch.optim.lr_scheduler.StepLR(o_fast, step_size=2, gamma=0.5)
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, step_size=2, gamma=0.5)
    fast = specularch.optimize(_make_step(m_fast, o_fast, nn.MSELoss()))
    slow = _make_step(m_ref, o_ref, nn.MSELoss())
    for step in range(12):
        x, y = _batch(step)
        assert fast(x, y) == slow(x, y)
        s_fast.step()
        s_ref.step()
        _assert_same_training(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.stats.recompiles == 0, str(e)
    assert any("lr" in i for g in e.graphs for i in g.inputs), "lr must be a graph input"


def test_no_grad_block_and_logging_inside_the_step():
    model, ref = _model(), _model()
    opt, ref_opt = _optimizer("sgd_momentum", model.parameters()), _optimizer("sgd_momentum", ref.parameters())

    def make(m, o):
        def step(x, y, history):
            o.zero_grad()
            out = m(x)
            loss = ((out - y) ** 2).mean()
            loss.backward()
            o.step()
            with torch.no_grad():
                accuracy = (out.argmax(1) == y.argmax(1)).float().mean()
            history.append(loss.item())
            return accuracy
        return step

    fast, slow = specularch.optimize(make(model, opt)), make(ref, ref_opt)
    h_fast, h_ref = [], []
    for step in range(8):
        x, y = _batch(step)
        assert torch.equal(fast(x, y, h_fast), slow(x, y, h_ref))
        assert h_fast == h_ref
        _assert_same_training(model, ref, opt, ref_opt)
    assert specularch.explain(fast).fallbacks == []


def _variant_step(m, o, variant):
    def step(x, y):
        if variant == "module_zero_grad":
            m.zero_grad()
        else:
            o.zero_grad(set_to_none=variant != "zero_grad_keep")
        loss = ((m(x) - y) ** 2).mean()
        if variant == "l2_over_parameters":
            loss = loss + 1e-3 * sum(p.pow(2).sum() for p in m.parameters())
        loss.backward()
        norm = loss
        if variant in ("clip_norm", "zero_grad_keep", "module_zero_grad"):
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        elif variant == "clip_value":
            torch.nn.utils.clip_grad_value_(m.parameters(), 0.05)
        o.step()
        return loss.item(), norm.item()
    return step


@pytest.mark.parametrize("variant", ["clip_norm", "clip_value", "zero_grad_keep",
                                     "module_zero_grad", "l2_over_parameters"])
def test_common_training_step_extras_are_captured_bit_for_bit(variant):
    """Gradient clipping (norm and value), zero_grad(set_to_none=False), model.zero_grad()
    and a penalty over model.parameters(): one graph per step, exactly eager's training."""
    model, ref = _model(), _model()
    opt, ref_opt = _optimizer("sgd_momentum", model.parameters()), \
        _optimizer("sgd_momentum", ref.parameters())
    fast, slow = specularch.optimize(_variant_step(model, opt, variant)), \
        _variant_step(ref, ref_opt, variant)
    for step in range(8):
        x, y = _batch(step)
        assert fast(x, y) == slow(x, y)
        _assert_same_training(model, ref, opt, ref_opt)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.stats.graph_hits >= 3, str(e)


def test_failed_assumption_after_backward_and_step_commits_nothing(monkeypatch):
    """The step updates parameters, then branches on the loss value; when the branch flips,
    the eager re-run must start from exactly the pre-call parameters and optimizer state."""
    model, ref = _model(), _model()
    opt, ref_opt = _optimizer("adam", model.parameters()), _optimizer("adam", ref.parameters())

    def make(m, o):
        def step(x, y):
            o.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            o.step()
            if loss > 1.5:
                return loss * 2
            return loss
        return step

    fast, slow = specularch.optimize(make(model, opt)), make(ref, ref_opt)
    seen = []
    original = specularch.frames.Target.call_original

    def spy(self, slots, cells):
        seen.append([p.detach().clone() for p in model.parameters()])
        return original(self, slots, cells)

    monkeypatch.setattr(specularch.frames.Target, "call_original", spy)
    with specularch.config.patch(profile_calls=0):
        for step, scale in enumerate([0.1, 0.1, 0.1, 10.0, 0.1]):
            x, y = _batch(step)
            before = [p.detach().clone() for p in model.parameters()]
            seen.clear()
            torch.testing.assert_close(fast(x, y * scale), slow(x, y * scale), rtol=0, atol=0)
            for snapshot in seen:  # every eager fallback started from the untouched state
                assert all(torch.equal(a, b) for a, b in zip(snapshot, before))
            _assert_same_training(model, ref, opt, ref_opt)
    assert any(f.kind == "assumption_failed" for f in specularch.explain(fast).fallbacks)


def test_training_step_compiled_by_torchscript_matches_eager():
    """The whole step, flattened to ATen (forward, backward, SGD update), runs as one
    TorchScript graph; training matches eager within float rounding."""
    model, ref = _model(), _model()
    opt, ref_opt = _optimizer("sgd_momentum", model.parameters()), \
        _optimizer("sgd_momentum", ref.parameters())
    fast = specularch.optimize(_make_step(model, opt, nn.MSELoss()), backend="torchscript")
    slow = _make_step(ref, ref_opt, nn.MSELoss())
    with specularch.config.patch(profile_calls=0):
        for step in range(6):
            x, y = _batch(step)
            assert fast(x, y) == pytest.approx(slow(x, y), rel=1e-5, abs=1e-6)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and all(g.backend == "torchscript" for g in e.graphs), str(e)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_backward_accumulates_into_existing_grad_like_eager():
    model, ref = _model(), copy.deepcopy(_model())

    def accumulate(m, x):
        (m(x) ** 2).mean().backward()

    fast = specularch.optimize(accumulate)
    with specularch.config.patch(profile_calls=0):
        for step in range(4):  # no zero_grad: grads accumulate across calls
            x, _ = _batch(step)
            fast(model, x)
            accumulate(ref, x)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert specularch.explain(fast).fallbacks == []


@pytest.mark.slow
def test_training_step_compiled_by_inductor_matches_eager():
    """Inductor flattens the whole step (forward, backward, Adam) to one ATen graph; results
    match eager within float tolerance (fused kernels round differently)."""
    model, ref = _model(), _model()
    opt, ref_opt = _optimizer("adam", model.parameters()), _optimizer("adam", ref.parameters())
    fast = specularch.optimize(_make_step(model, opt, nn.MSELoss()), backend="inductor")
    slow = _make_step(ref, ref_opt, nn.MSELoss())
    with specularch.config.patch(profile_calls=1):
        for step in range(6):
            x, y = _batch(step)
            assert abs(fast(x, y) - slow(x, y)) < 1e-5
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.graphs[-1].backend == "inductor", str(e)


@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate"])
@pytest.mark.parametrize("when", ["before_capture", "after_capture"])
def test_gradient_hooks_on_parameters_run_exactly_as_eager(kind, when):
    """A captured backward computes gradients with autograd.grad, which would skip (or, while
    capturing, run once too often) hooks on the parameters: such steps run eagerly, and a
    hook registered after capture is noticed by a guard."""
    model, ref = _model(), _model()
    opt, ref_opt = _optimizer("sgd", model.parameters()), _optimizer("sgd", ref.parameters())
    fired = {"fast": 0, "ref": 0}

    def add_hook(m, side):
        def scale_grad(g):
            fired[side] += 1
            return g * 0.5

        def scale_accumulated(t):
            fired[side] += 1
            t.grad.mul_(0.5)

        p = m[0].weight
        if kind == "register_hook":
            p.register_hook(scale_grad)
        else:
            p.register_post_accumulate_grad_hook(scale_accumulated)

    if when == "before_capture":
        add_hook(model, "fast")
        add_hook(ref, "ref")
    fast, slow = specularch.optimize(_make_step(model, opt, nn.functional.mse_loss)), \
        _make_step(ref, ref_opt, nn.functional.mse_loss)
    with specularch.config.patch(profile_calls=0):
        for step in range(6):
            if when == "after_capture" and step == 3:
                add_hook(model, "fast")
                add_hook(ref, "ref")
            x, y = _batch(step)
            assert fast(x, y) == slow(x, y)
            _assert_same_training(model, ref, opt, ref_opt)
    assert fired["fast"] == fired["ref"] > 0
    e = specularch.explain(fast)
    assert {f.kind for f in e.fallbacks} == {"module_hooks"}, str(e)
    if when == "after_capture":  # graphs ran before the hook, a guard noticed the hook
        assert e.stats.graph_hits >= 1, str(e)
        assert any("has gradient hooks registered now" in str(r) for r in e.recompiles), str(e)


def _scheduled(case, params):
    """An optimizer and a scheduler that changes more than the learning rate every step."""
    sched = torch.optim.lr_scheduler
    if case == "sgd_onecycle":  # cycles SGD's momentum
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3)
        return opt, sched.OneCycleLR(opt, max_lr=0.1, total_steps=40)
    if case == "adam_onecycle":  # cycles betas[0]
        opt = torch.optim.Adam(params, lr=0.01)
        return opt, sched.OneCycleLR(opt, max_lr=0.1, total_steps=40)
    if case == "adamw_cyclic":  # cycle_momentum=True (the default) works with Adam: betas[0]
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, amsgrad=True)
        return opt, sched.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=4)
    if case == "named_groups":  # user keys beside the options, a scheduler over both groups
        params = list(params)
        opt = torch.optim.Adam([{"params": params[:2], "name": "first", "lr": 0.02},
                                {"params": params[2:], "name": "last"}], lr=0.01, betas=(0.8, 0.9))
        return opt, sched.OneCycleLR(opt, max_lr=[0.1, 0.05], total_steps=40)
    raise ValueError(case)


@pytest.mark.parametrize("case", ["sgd_onecycle", "adam_onecycle", "adamw_cyclic", "named_groups"])
def test_schedulers_cycling_momentum_and_named_groups_do_not_recompile(case):
    """OneCycleLR/CyclicLR change lr and SGD's momentum or Adam's betas[0] every step and
    keep bookkeeping keys (max_lr, initial_lr, base_momentum, ...) in the param groups: the
    numbers are graph inputs and the keys are ignored, so one program serves every step."""
    m_fast, m_ref = _model(), _model()
    (o_fast, s_fast), (o_ref, s_ref) = _scheduled(case, m_fast.parameters()), \
        _scheduled(case, m_ref.parameters())
    fast = specularch.optimize(_make_step(m_fast, o_fast, nn.MSELoss()))
    slow = _make_step(m_ref, o_ref, nn.MSELoss())
    with specularch.config.patch(profile_calls=0):
        for step in range(24):
            x, y = _batch(step)
            assert fast(x, y) == slow(x, y), f"loss differs at step {step}"
            _assert_same_training(m_fast, m_ref, o_fast, o_ref)
            s_fast.step()
            s_ref.step()
    e = specularch.explain(fast)
    assert e.fallbacks == [], str(e)
    assert 1 <= len(e.graphs) <= 2, str(e)   # the first step creates optimizer state
    assert e.stats.graph_hits >= 24 - 2, str(e)
    cycled = "momentum" if case.startswith("sgd") else "betas"
    assert any(cycled in i for g in e.graphs for i in g.inputs), str(e)


def test_momentum_varied_between_calls_and_set_to_zero_matches_eager():
    """SGD's momentum is a graph input, but whether a momentum buffer is used is guarded:
    momentum 0 skips the buffer (eager's `if momentum != 0`), a nonzero value uses it again."""
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (m_fast, m_ref))
    fast = specularch.optimize(_make_step(m_fast, o_fast, nn.MSELoss()))
    slow = _make_step(m_ref, o_ref, nn.MSELoss())
    schedule = [0.9 - 0.02 * i for i in range(8)] + [0.0] * 4 + [0.5, 0.6, 0.7, 0.8]
    with specularch.config.patch(profile_calls=0):
        for step, momentum in enumerate(schedule):
            for o in (o_fast, o_ref):
                o.param_groups[0]["momentum"] = momentum
            x, y = _batch(step)
            assert fast(x, y) == slow(x, y), f"loss differs at step {step}"
            _assert_same_training(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and len(e.graphs) <= 3, str(e)
    assert any("momentum" in str(r) for r in e.recompiles), str(e)


def test_param_group_written_inside_the_step_is_not_read_stale():
    """A warm-up that sets the learning rate inside the optimized function, before step():
    the write waits in the shadow heap, so the step must not read the old value from the
    real group (it runs eagerly)."""
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (m_fast, m_ref))

    def make(m, o):
        def step(x, y, it):
            for group in o.param_groups:
                group["lr"] = 0.01 * (it + 1)
            o.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            o.step()
            return loss.item()
        return step

    fast, slow = specularch.optimize(make(m_fast, o_fast)), make(m_ref, o_ref)
    with specularch.config.patch(profile_calls=0):
        for step in range(6):
            x, y = _batch(step)
            assert fast(x, y, step) == slow(x, y, step), f"loss differs at step {step}"
            _assert_same_training(m_fast, m_ref, o_fast, o_ref)
            assert o_fast.param_groups[0]["lr"] == o_ref.param_groups[0]["lr"]


def test_unmodelled_optimizer_option_still_falls_back():
    """Keys the optimizer never reads are ignored; an option it defines but the model does
    not know (as a newer torch would add) runs eagerly."""
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = (torch.optim.Adam([{"params": m.parameters(), "name": "all"}], lr=0.01)
                     for m in (m_fast, m_ref))
    fast = specularch.optimize(_make_step(m_fast, o_fast, nn.MSELoss()))
    slow = _make_step(m_ref, o_ref, nn.MSELoss())
    with specularch.config.patch(profile_calls=0):
        for step in range(6):
            if step == 3:
                for o in (o_fast, o_ref):
                    o.defaults["new_option"] = True
                    o.param_groups[0]["new_option"] = True
            x, y = _batch(step)
            assert fast(x, y) == slow(x, y)
            _assert_same_training(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.stats.graph_hits >= 1, str(e)
    assert [f.kind for f in e.fallbacks] and all(f.kind == "unsupported_call" for f in e.fallbacks), str(e)
    assert any("new_option" in f.explanation for f in e.fallbacks), str(e)


def test_cycled_momentum_step_compiled_by_torchscript_matches_eager():
    """Python-number inputs (lr, momentum, betas[0]) become 0-d tensor inputs of the
    flattened graph; training matches eager within float rounding, with no recompiles."""
    for case in ("sgd_onecycle", "adam_onecycle"):
        m_fast, m_ref = _model(), _model()
        (o_fast, s_fast), (o_ref, s_ref) = _scheduled(case, m_fast.parameters()), \
            _scheduled(case, m_ref.parameters())
        fast = specularch.optimize(_make_step(m_fast, o_fast, nn.MSELoss()), backend="torchscript")
        slow = _make_step(m_ref, o_ref, nn.MSELoss())
        with specularch.config.patch(profile_calls=0):
            for step in range(8):
                x, y = _batch(step)
                assert fast(x, y) == pytest.approx(slow(x, y), rel=1e-5, abs=1e-6)
                s_fast.step()
                s_ref.step()
        e = specularch.explain(fast)
        assert e.fallbacks == [] and len(e.graphs) <= 2, str(e)
        assert all(g.backend == "torchscript" for g in e.graphs), str(e)
        for p, q in zip(m_fast.parameters(), m_ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# `.item()` is read from the graph's output after the run: a tensor written in place later in
# the call (or by the commit, for a buffer) must be read as it was when `.item()` was called.
def item_then_written_in_place(x):
    y = x * 2
    first, total = y[0].item(), y.sum().item()
    y.add_(1)
    return first, total, y


class ItemOfBufferThenUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x):
        before = self.steps.item()
        self.steps.add_(x.sum())
        return before


def written_in_place_then_item(x):
    y = x.sum() * 2
    y.add_(1)  # before .item(): counts
    middle = y.item()
    y.mul_(3)  # after it: does not
    return middle, y.item(), y


def test_item_reads_the_value_at_the_call_not_after_later_writes():
    check(item_then_written_in_place, lambda: A(T(4)), calls=5, expect="graph")
    check_module(ItemOfBufferThenUpdate, lambda: A(T(3)), calls=5, expect="graph")


def test_item_sees_in_place_writes_made_before_it():
    """The copy for a value read later is taken where ``.item()`` was called, not where the
    tensor was made (it once missed ``y.add_(1)`` between the two)."""
    check(written_in_place_then_item, lambda: A(T(4)), calls=5, expect="graph")
