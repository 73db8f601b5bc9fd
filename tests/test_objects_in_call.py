"""Differential programs: objects created inside the optimized function and the small causes
that kept real training steps out of graphs — tensor device/layout properties, torch.finfo /
iinfo, torch.distributions made in the call (validated arguments become in-graph assumptions),
torch.nn modules made in forward, torch helpers that read a dtype of a tensor whose sizes
vary, grad-mode context managers used as values, and builtins called as unbound methods."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, Distribution, Normal

import specularch
from differential import A, T, check, check_module

GRAD_TOL = dict(atol=1e-6, rtol=1e-5)


@pytest.fixture(autouse=True)
def validate_default():
    """Every test starts with torch.distributions' default argument validation on (Python's
    default; torch.compile, used by other tests, turns it off for the process) and leaves it
    as it found it."""
    before = Distribution._validate_args
    Distribution.set_default_validate_args(True)
    yield
    Distribution.set_default_validate_args(before)


# ---- tensor metadata -------------------------------------------------------------------------

def dcgan_step(x, w):
    # DCGAN's example picks its device path from these properties on every step
    if x.is_xpu or x.is_cuda or x.is_mps or x.is_meta or x.is_sparse_csr:
        x = x.contiguous()
    h = F.leaky_relu(x @ w, 0.2)
    if h.is_floating_point() and not h.is_complex() and h.layout == torch.strided:
        h = h * 2
    return h, x.is_quantized, x.is_nested, x.is_mkldnn, x.is_cpu, x.device.type


def test_tensor_device_properties_are_guarded_constants(no_profiling):
    check(dcgan_step, lambda: A(T(4, 3, requires_grad=True), T(3, 5, requires_grad=True)),
          expect="graph", grad=True)


def dtype_facts(x):
    eps = torch.finfo(x.dtype).eps
    big = torch.finfo(torch.float16).max
    low = torch.iinfo(torch.int32).min
    half = x.dtype == torch.float16
    return x.clamp(min=eps) + big + low + torch.finfo().tiny, torch.get_default_dtype(), half, \
        torch.finfo(x.dtype).bits, torch.float32


def test_finfo_iinfo_and_dtypes_are_constants(no_profiling):
    check(dtype_facts, lambda: A(T(3)), expect="graph")


# ---- torch.distributions made in the call ------------------------------------------------------

def gaussian_policy(mu, log_sigma, action):
    dist = Normal(mu, log_sigma.exp())
    sample = dist.rsample()
    return sample, dist.log_prob(action).sum(), dist.entropy().mean(), dist.sample(), dist.mean


def test_normal_made_in_call(no_profiling):
    check(gaussian_policy, lambda: A(T(2, 3, requires_grad=True), T(2, 3, requires_grad=True), T(2, 3)),
          expect="graph", grad=True, **GRAD_TOL)


def unvalidated(mu, sigma, x):
    dist = Normal(mu, sigma, validate_args=False)
    return dist.log_prob(x), dist.rsample((2,))


def test_normal_without_validation(no_profiling):
    check(unvalidated, lambda: A(T(3), T(3).abs() + 0.1, T(3)), expect="graph")


def scale_of(i):
    scale = torch.rand(3) + 0.1
    return A(T(3), -scale if i == 2 else scale, T(3))


def test_invalid_argument_raises_like_eager_and_graph_stays(no_profiling):
    # call 2 violates scale > 0: the graph's assumption fails, eager raises ValueError; call 3
    # (valid again) runs a graph: the validation site is not given up as a two-way branch
    report = check(gaussian_log_prob, scale_of, calls=4,
                   expect="fallback", fallback_kind="assumption_failed")
    assert len(report.fallbacks) == 1, report
    assert report.stats.graph_hits >= 1, report


def gaussian_log_prob(mu, sigma, x):
    return Normal(mu, sigma).log_prob(x)


def test_validation_default_switched_on_after_capture(no_profiling, validate_default):
    # captured without validation; switching the default on must be seen (eager raises)
    Distribution.set_default_validate_args(False)
    opt = specularch.optimize(gaussian_log_prob)
    for _ in range(2):
        opt(T(3), T(3).abs() + 0.1, T(3))
    Distribution.set_default_validate_args(True)
    with pytest.raises(ValueError, match="scale"):
        gaussian_log_prob(T(3), -T(3).abs() - 0.1, T(3))
    with pytest.raises(ValueError, match="scale"):
        opt(T(3), -T(3).abs() - 0.1, T(3))


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.actor = nn.Linear(8, 3)
        self.critic = nn.Linear(8, 1)

    def forward(self, state):
        h = torch.relu(self.body(state))
        dist = Categorical(logits=self.actor(h))
        action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(h), dist.probs


def test_categorical_actor_critic(no_profiling):
    check_module(ActorCritic, lambda: A(T(5, 4)), expect="graph", grad=True, **GRAD_TOL)


# ---- torch.nn modules made in forward ----------------------------------------------------------

class MakesActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        act = nn.Sequential(nn.Tanh(), nn.Softplus(beta=2.0))
        return nn.Dropout(0.5)(nn.ReLU()(self.fc(x))) + act(x)


def test_parameter_free_modules_made_in_forward(no_profiling):
    check_module(MakesActivations, lambda: A(T(3, 4)), expect="graph", grad=True, **GRAD_TOL)


def fresh_linear(x):
    return nn.Linear(3, 2)(x)


def test_module_with_parameters_made_in_call_falls_back(no_profiling):
    # each eager call draws new weights from the RNG: the harness compares the RNG state too
    report = check(fresh_linear, lambda: A(T(4, 3)), expect="fallback", fallback_kind="unsupported_call")
    assert "creates parameters" in report.fallbacks[0].explanation


def fresh_relu(x):
    return nn.ReLU(), x * 2


def test_module_made_in_call_and_returned_falls_back(no_profiling):
    report = check(fresh_relu, lambda: A(T(3)), expect="fallback", fallback_kind="unsupported_call")
    assert "made in the call is returned or stored" in report.fallbacks[0].explanation


# ---- torch helpers on tensors whose sizes vary -------------------------------------------------

def canonical_mask(x, mask):
    dtype = F._none_or_dtype(mask)
    mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=dtype, other_name="x",
                             target_type=x.dtype)
    return x.sum(-1) + mask


def varying_length(i):
    mask = torch.zeros(2, 3 + i, dtype=torch.bool)
    mask[:, -1] = True
    return A(T(2, 3 + i, 4), mask)


def test_dtype_helper_on_dynamic_sizes_is_not_data_dependent():
    # profiling sees the length vary: sizes become dynamic; `_none_or_dtype` reads only a dtype
    check(canonical_mask, varying_length, calls=7, expect="graph")


# ---- grad-mode context managers as values ------------------------------------------------------

def grad_ctx_facts(x):
    ctx = torch.no_grad()
    with ctx or contextlib.nullcontext():
        y = x * 2
    return y, isinstance(ctx, torch.no_grad), type(ctx).__name__


def test_grad_mode_context_as_value(no_profiling):
    check(grad_ctx_facts, lambda: A(T(3, requires_grad=True)), expect="graph")


def returns_grad_ctx(x):
    return x * 2, torch.enable_grad()


def test_grad_mode_context_returned_falls_back(no_profiling):
    check(returns_grad_ctx, lambda: A(T(3)), expect="fallback", fallback_kind="unsupported_call")


# ---- objects made in the call, builtins as unbound methods ------------------------------------

CONFIG = {"scale": 2.0, "shift": 1.0}


def unbound_methods(x, log):
    opts = {}
    dict.update(opts, CONFIG)
    list.append(log, opts["shift"])
    return x * opts["scale"] + opts["shift"]


def test_dict_and_list_methods_called_unbound(no_profiling):
    check(unbound_methods, lambda: A(T(3), [0.0]), expect="graph")


class Box:
    pass


def set_by_name(x, box):
    setattr(box, "value", x.sum())
    return x + 1


def test_setattr_builtin(no_profiling):
    check(set_by_name, lambda: A(T(3), Box()), expect="graph")


class cached:
    """A non-data descriptor written in Python (like torch's lazy_property)."""

    def __init__(self, func):
        self.func = func

    def __get__(self, obj, owner=None):
        value = self.func(obj)
        setattr(obj, self.func.__name__, value)
        return value


class Scaled:
    def __init__(self, x):
        super().__init__()
        self.x = x

    @cached
    def doubled(self):
        return self.x * 2


def descriptor_on_new_object(x):
    s = Scaled(x)
    return s.doubled + s.doubled, "doubled" in s.__dict__


def test_python_descriptor_on_object_made_in_call(no_profiling):
    check(descriptor_on_new_object, lambda: A(T(3)), expect="graph")


class UserBlock(nn.Module):
    def forward(self, x):
        return x * 2


def makes_user_module(x):
    return UserBlock()(x)


def test_user_module_made_in_call_falls_back_with_reason(no_profiling):
    report = check(makes_user_module, lambda: A(T(3)), expect="fallback", fallback_kind="unsupported_call")
    assert "only torch.nn's own modules" in report.fallbacks[0].explanation
