"""Every way a user can change a training step's model or optimizer between two cached calls
(issue 14 item 5: any cheaper guard scheme must still notice each one). An Adam step runs
until its steady-state graph is hit, then the same change is made to the eager and the
optimized copy, and both run on: losses, parameters, gradients and optimizer state must stay
equal to eager's, or both raise the same error."""
import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of
from differential import mse_train_step


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, mse_train_step(model, opt)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _no_grad(fn):
    def run(model, opt):
        with torch.no_grad():
            fn(model, opt)
    return run


def _replace_state(key, make):
    def run(model, opt):
        state = opt.state[model[0].weight]
        state[key] = make(state[key])
    return run


def _swap_data(model, opt):
    model[2].bias.data = torch.full_like(model[2].bias, 0.5)


def _alias_parameters(model, opt):
    # Two parameters now share memory: the step writes one through the other.
    model[2].bias.data = model[0].bias.data[:2]


def _transposed_weight(model, opt):
    w = model[0].weight
    w.data = w.data.t().contiguous().t()  # same values and shape, other strides


def _resize_bias(model, opt):
    b = model[2].bias  # resize_ refuses a tensor that requires grad
    b.requires_grad_(False).resize_(1, 2).requires_grad_(True)


def _new_param_group(model, opt):
    extra = nn.Parameter(torch.ones(3))
    extra.grad = torch.ones(3)
    opt.add_param_group({"params": [extra], "lr": 0.1})


def _replace_parameter(model, opt):
    # The model uses a new parameter the optimizer does not know: it is never updated.
    model[2].weight = nn.Parameter(model[2].weight.detach() * 2)


def _set_attribute(name, value):
    def run(model, opt):
        setattr(model[0], name, value)
    return run


MUTATIONS = {
    "replace a module parameter": _replace_parameter,
    "parameter .data = same shape": _swap_data,
    "parameter .data = a view of another": _alias_parameters,
    "parameter .data = other strides": _transposed_weight,
    "parameter .data = other dtype": lambda m, o: setattr(m[0].bias, "data", m[0].bias.data.double()),
    "parameter requires_grad_(False)": lambda m, o: m[0].bias.requires_grad_(False),
    "parameter set_ other storage": _no_grad(lambda m, o: m[2].bias.set_(torch.zeros(2))),
    "parameter set_ another's storage": _no_grad(lambda m, o: m[2].bias.set_(m[0].bias[:2])),
    "parameter resize_": _resize_bias,
    "state tensor replaced": _replace_state("exp_avg", lambda t: torch.ones_like(t)),
    "state tensor shares another's memory": lambda m, o: o.state[m[0].weight].__setitem__(
        "exp_avg", o.state[m[0].weight]["exp_avg_sq"]),
    "state tensor resized": _no_grad(lambda m, o: o.state[m[0].bias]["exp_avg"].resize_(3)),
    "state step changed": _replace_state("step", lambda t: torch.tensor(100.0)),
    "state of a parameter dropped": lambda m, o: o.state.pop(m[2].weight),
    "state dict gains a key": lambda m, o: o.state[m[0].weight].__setitem__("extra", 1),
    "lr changed": lambda m, o: o.param_groups[0].__setitem__("lr", 0.5),
    "betas changed": lambda m, o: o.param_groups[0].__setitem__("betas", (0.5, 0.9)),
    "amsgrad switched on": lambda m, o: o.param_groups[0].__setitem__("amsgrad", True),
    "params list item replaced": lambda m, o: o.param_groups[0]["params"].__setitem__(
        3, nn.Parameter(torch.zeros(2))),
    "params list shortened": lambda m, o: o.param_groups[0]["params"].pop(),
    "param group added": _new_param_group,
    "gradient hook registered": lambda m, o: m[0].weight.register_hook(lambda g: g * 3),
    "module forward hook registered": lambda m, o: m[1].register_forward_hook(
        lambda mod, args, out: out * 2),
    "module switched to eval": lambda m, o: m.eval(),
    "submodule replaced": lambda m, o: m.__setitem__(1, nn.Tanh()),
    "module attribute changed": _set_attribute("in_features", 4),
}


def _run(step, i):
    try:
        loss = step(*_batch(i))
        return ("ok", "nan" if loss != loss else loss)
    except Exception as e:  # both sides must raise the same error
        return ("raised", type(e).__name__, str(e))


def _equal(a, b) -> bool:
    """Equal values (nan equal to nan: an update through aliased state can make some)."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())


def _same_state(model, opt, ref_model, ref_opt):
    assert len(opt.param_groups) == len(ref_opt.param_groups)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.stride() == q.stride() and _equal(p, q)
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert _equal(p.grad, q.grad)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        for p, q in zip(group["params"], ref_group["params"]):
            assert _equal(p, q)
            state, ref_state = opt.state.get(p, {}), ref_opt.state.get(q, {})
            assert list(state) == list(ref_state)
            for key, value in state.items():
                assert _equal(value, ref_state[key]), key


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_change_between_cached_calls_runs_like_eager(no_profiling, mutation):
    model, opt, step = _setup()
    ref_model, ref_opt, ref_step = _setup()
    fast = specularch.optimize(step, backend="fx")
    for i in range(3):  # the second Adam step is the steady-state graph, hit by the third
        assert _run(fast, i) == _run(ref_step, i)
    assert max(e.hits for e in _state_of(fast).entries) >= 1
    MUTATIONS[mutation](model, opt)
    MUTATIONS[mutation](ref_model, ref_opt)
    for i in range(3, 6):
        assert _run(fast, i) == _run(ref_step, i)
        _same_state(model, opt, ref_model, ref_opt)
