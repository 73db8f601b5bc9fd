"""Adadelta, RMSprop, Adagrad, Adamax, NAdam and RAdam inside a captured training step
(`zero_grad; loss; backward; step`): parameters, gradients and `opt.state_dict()` after
every step equal eager's bit for bit, with an LR scheduler stepping between calls that
causes no recompile; options the model does not capture fall back naming the option."""
import pytest
import torch
from torch import nn

import specularch

STEPS = 6
O = torch.optim

# name -> (optimizer class, options); several cases per optimizer cover its branches
CASES = {
    "adadelta": (O.Adadelta, dict(lr=1.0)),
    "adadelta_wd_maximize": (O.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=1e-2, maximize=True)),
    "rmsprop": (O.RMSprop, dict(lr=1e-2)),
    "rmsprop_momentum_centered": (O.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True,
                                                  weight_decay=1e-3, alpha=0.9)),
    "rmsprop_momentum_maximize": (O.RMSprop, dict(lr=1e-2, momentum=0.5, maximize=True)),
    "adagrad": (O.Adagrad, dict(lr=0.1)),
    "adagrad_decay_init": (O.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=1e-2,
                                           initial_accumulator_value=0.1, eps=1e-8)),
    "adamax": (O.Adamax, dict(lr=2e-2)),
    "adamax_wd_maximize": (O.Adamax, dict(lr=2e-2, betas=(0.8, 0.9), weight_decay=1e-2, maximize=True)),
    "nadam": (O.NAdam, dict(lr=2e-2)),
    "nadam_decoupled": (O.NAdam, dict(lr=2e-2, weight_decay=1e-2, decoupled_weight_decay=True,
                                      momentum_decay=8e-3)),
    "nadam_l2_maximize": (O.NAdam, dict(lr=2e-2, weight_decay=1e-2, maximize=True)),
    # large momentum_decay: mu_product's float32 rounding (eager reads the 0-d tensor back
    # with .item()) changes the update's bits; the model must round like eager
    "nadam_float32_mu_product": (O.NAdam, dict(lr=0.1, betas=(0.99, 0.999), momentum_decay=0.3)),
    "radam": (O.RAdam, dict(lr=1e-2)),
    "radam_decoupled": (O.RAdam, dict(lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True,
                                      betas=(0.9, 0.9))),
    "radam_l2": (O.RAdam, dict(lr=1e-2, weight_decay=1e-2, betas=(0.8, 0.6))),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)


def _make_step(model, opt, set_to_none=True):
    def train_step(x, y):
        opt.zero_grad(set_to_none=set_to_none)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


def _same_tensor(a, b, what):
    assert type(a) is type(b), what
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, what
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all(), what
    else:
        assert a == b, what


def _assert_same(m_fast, m_ref, o_fast, o_ref):
    for (name, p), q in zip(m_fast.named_parameters(), m_ref.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), f"grad of {name} differs"
    s_fast, s_ref = o_fast.state_dict(), o_ref.state_dict()
    assert s_fast["param_groups"] == s_ref["param_groups"]
    assert list(s_fast["state"]) == list(s_ref["state"])
    for index, entry in s_ref["state"].items():
        assert list(s_fast["state"][index]) == list(entry), "state keys or their order differ"
        for key, value in entry.items():
            _same_tensor(s_fast["state"][index][key], value, f"state[{index}][{key!r}]")


def _train(case, schedule=None, set_to_none=True, steps=STEPS):
    cls, options = CASES[case]
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = cls(m_fast.parameters(), **options), cls(m_ref.parameters(), **options)
    schedulers = [schedule(o) for o in (o_fast, o_ref)] if schedule else []
    fast = specularch.optimize(_make_step(m_fast, o_fast, set_to_none))
    slow = _make_step(m_ref, o_ref, set_to_none)
    with specularch.config.patch(profile_calls=0):
        for step in range(steps):
            x, y = _batch(step)
            assert fast(x, y) == slow(x, y), f"loss differs at step {step}"
            _assert_same(m_fast, m_ref, o_fast, o_ref)
            for s in schedulers:
                s.step()
    return specularch.explain(fast)


def _step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def _exponential_lr(opt):
    return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_step_matches_eager_bit_for_bit_under_a_scheduler(case):
    schedule = (_step_lr, _exponential_lr)[sorted(CASES).index(case) % 2]
    e = _train(case, schedule)
    assert e.fallbacks == [], str(e)
    assert e.stats.graph_hits >= STEPS - 3, str(e)
    assert any("lr" in i for g in e.graphs for i in g.inputs), "lr must be a graph input"
    # The learning rate changing every call costs no capture: the same steps without a
    # scheduler capture exactly as often (first step: state created; RAdam: rho_t > 5 flips).
    assert e.stats.captures == _train(case).stats.captures, str(e)


@pytest.mark.parametrize("case", ["adadelta", "rmsprop_momentum_centered", "nadam"])
def test_zero_grad_keeping_tensors_matches_eager(case):
    e = _train(case, _step_lr, set_to_none=False)
    assert e.fallbacks == [] and e.stats.graph_hits >= STEPS - 3, str(e)


def test_captures_are_few_and_only_where_eager_branches():
    """The first call (no `.grad` yet, no optimizer state) is one capture; then one program
    serves every step, except RAdam's, whose `rho_t > 5` flips once as the step count grows
    (a guarded branch on the step count, a graph input)."""
    for case in ("adadelta", "adagrad", "nadam"):
        e = _train(case, _step_lr, steps=8)
        assert e.stats.captures == 2 and e.stats.graph_hits == 6, str(e)
    e = _train("radam", _step_lr, steps=8)
    assert e.stats.captures == 3 and e.stats.graph_hits == 5, str(e)
    assert "> 5.0" in str(e.recompiles[-1]) and "['step'].item()" in str(e.recompiles[-1]), str(e)


def _outcome(f, *args):
    try:
        return f(*args)
    except Exception as e:  # eager's own error (e.g. capturable=True on the CPU)
        return type(e), str(e)


@pytest.mark.parametrize("cls", [O.Adadelta, O.RMSprop, O.Adamax, O.NAdam, O.RAdam])
@pytest.mark.parametrize("option", ["foreach", "differentiable", "capturable", "lr"])
def test_unsupported_options_fall_back_naming_the_option(cls, option):
    """Options with another code path in torch (the foreach implementation, a tensor
    learning rate, ...) run eagerly, with the same results or errors as eager."""
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = (cls(m.parameters(), **{option: torch.tensor(0.01) if option == "lr" else True})
                     for m in (m_fast, m_ref))
    fast, slow = specularch.optimize(_make_step(m_fast, o_fast)), _make_step(m_ref, o_ref)
    with specularch.config.patch(profile_calls=0):
        for step in range(3):
            assert _outcome(fast, *_batch(step)) == _outcome(slow, *_batch(step))
            _assert_same(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.fallbacks and all(option in f.explanation for f in e.fallbacks), str(e)


def test_adagrad_fused_falls_back_and_matches_eager():
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = (O.Adagrad(m.parameters(), lr=0.1, fused=True) for m in (m_fast, m_ref))
    fast, slow = specularch.optimize(_make_step(m_fast, o_fast)), _make_step(m_ref, o_ref)
    with specularch.config.patch(profile_calls=0):
        for step in range(3):
            assert fast(*_batch(step)) == slow(*_batch(step))
            _assert_same(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.fallbacks and all("fused" in f.explanation for f in e.fallbacks), str(e)


def test_rmsprop_momentum_turned_on_after_state_exists_runs_eagerly():
    """State made with momentum 0 has no momentum buffer; eager then raises KeyError when
    momentum becomes positive, and so does the optimized step (it runs eagerly)."""
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = (O.RMSprop(m.parameters(), lr=1e-2) for m in (m_fast, m_ref))
    fast, slow = specularch.optimize(_make_step(m_fast, o_fast)), _make_step(m_ref, o_ref)
    with specularch.config.patch(profile_calls=0):
        for step in range(2):
            assert fast(*_batch(step)) == slow(*_batch(step))
        for o in (o_fast, o_ref):
            o.param_groups[0]["momentum"] = 0.9
        for f in (fast, slow):
            with pytest.raises(KeyError, match="momentum_buffer"):
                f(*_batch(3))
    _assert_same(m_fast, m_ref, o_fast, o_ref)


def test_adagrad_group_added_later_initialises_state_from_the_defaults():
    """Adagrad makes state in __init__; a group added later gets it lazily in step(), its
    `sum` filled with `defaults["initial_accumulator_value"]` (not the group's value)."""
    def make():
        model = _model()
        opt = O.Adagrad(model[0].parameters(), lr=0.1, initial_accumulator_value=0.3)
        opt.add_param_group({"params": model[2].parameters(), "initial_accumulator_value": 2.0})
        return model, opt
    (m_fast, o_fast), (m_ref, o_ref) = make(), make()
    fast, slow = specularch.optimize(_make_step(m_fast, o_fast)), _make_step(m_ref, o_ref)
    with specularch.config.patch(profile_calls=0):
        for step in range(4):
            assert fast(*_batch(step)) == slow(*_batch(step))
            _assert_same(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.stats.graph_hits >= 2, str(e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parameters_with_default_foreach_fall_back():
    """On CUDA, foreach=None means torch's foreach implementation: not what is modelled."""
    m_fast, m_ref = _model().cuda(), _model().cuda()
    o_fast, o_ref = (O.RMSprop(m.parameters(), lr=1e-2) for m in (m_fast, m_ref))
    fast, slow = specularch.optimize(_make_step(m_fast, o_fast)), _make_step(m_ref, o_ref)
    with specularch.config.patch(profile_calls=0):
        for step in range(3):
            x, y = (t.cuda() for t in _batch(step))
            assert fast(x, y) == slow(x, y)
            _assert_same(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert e.fallbacks and all("foreach=None" in f.explanation for f in e.fallbacks), str(e)


@pytest.mark.parametrize("case", ["adadelta", "nadam", "rmsprop_momentum_centered", "adam"])
def test_two_steps_in_one_call_match_eager(case):
    """The second step() reads state the first wrote in this call (graph values, not yet
    committed) and the same learning rate (one graph input): captured where the update
    needs no Python number from that state, else eager (Adam's and NAdam's step count)."""
    cls, options = (O.Adam, dict(lr=1e-2)) if case == "adam" else CASES[case]
    m_fast, m_ref = _model(), _model()
    o_fast, o_ref = cls(m_fast.parameters(), **options), cls(m_ref.parameters(), **options)

    def make(m, o):
        def two_steps(x, y):
            for _ in range(2):
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
        return two_steps

    fast, slow = specularch.optimize(make(m_fast, o_fast)), make(m_ref, o_ref)
    with specularch.config.patch(profile_calls=0):
        for step in range(4):
            fast(*_batch(step))
            slow(*_batch(step))
            _assert_same(m_fast, m_ref, o_fast, o_ref)
    e = specularch.explain(fast)
    assert all(f.kind == "unsupported_call" and "two step() calls" in f.explanation
               for f in e.fallbacks), str(e)
    assert (e.fallbacks == []) == (case in ("adadelta", "rmsprop_momentum_centered")), str(e)


def _lbfgs_run(optimize, set_to_none, steps=3):
    """``LBFGS.step(closure)`` with the closure optimized by ``optimize``: the closure's
    losses, the parameters and the optimizer's state after ``steps`` steps."""
    model = _model().double()
    opt = O.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = (t.double() for t in _batch(0))
    losses = []

    def closure():
        opt.zero_grad(set_to_none=set_to_none)
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        return loss
    closure = optimize(closure)
    for _ in range(steps):
        opt.step(closure)
    return closure, losses, model.state_dict(), opt.state_dict()["state"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_lbfgs_closure_with_zero_grad_is_captured_and_matches_eager(no_profiling, set_to_none):
    """``zero_grad`` of an optimizer whose ``step`` is not captured (LBFGS keeps torch's
    ``Optimizer.zero_grad``): the closure ``step`` calls is one graph, bit for bit eager's
    (it fell back before: "LBFGS.zero_grad() is not captured")."""
    _, losses, params, state = _lbfgs_run(lambda f: f, set_to_none)
    closure, got_losses, got_params, got_state = _lbfgs_run(specularch.optimize, set_to_none)
    assert got_losses == losses and len(losses) > 3
    for name in params:
        assert torch.equal(params[name], got_params[name]), name
    for key in ("d", "t", "old_dirs", "prev_flat_grad", "n_iter"):
        a, b = state[0][key], got_state[0][key]
        assert all(map(torch.equal, a, b)) if isinstance(a, list) else \
            (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), key
    e = specularch.explain(closure)
    assert e.fallbacks == [] and e.stats.graph_hits >= len(losses) - 2, str(e)


class _OwnZeroGrad(O.SGD):
    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self.zeroed = getattr(self, "zeroed", 0) + 1


def test_an_optimizer_overriding_zero_grad_is_not_captured(no_profiling):
    """Its own ``zero_grad`` may do anything (here: count): the step runs eagerly, saying so."""
    models = _model(), _model()
    opts = [_OwnZeroGrad(m.parameters(), lr=0.1) for m in models]
    fast = specularch.optimize(_make_step(models[0], opts[0]))
    slow = _make_step(models[1], opts[1])
    for step in range(3):
        x, y = _batch(step)
        assert fast(x, y) == slow(x, y)
    assert opts[0].zeroed == opts[1].zeroed == 3
    e = specularch.explain(fast)
    assert e.fallbacks and "_OwnZeroGrad.zero_grad() is not captured" in e.fallbacks[0].explanation, str(e)
