"""``step()`` of torch's Adadelta, RMSprop, Adagrad, Adamax, NAdam and RAdam, captured the
way optim_model.py captures SGD and Adam: each update below replays, op by op and in the
same order, torch 2.13's ``_single_tensor_<name>`` function (the path torch runs for CPU
parameters: ``_default_to_fused_or_foreach`` picks foreach only for cuda/xpu/mtia/
privateuseone, and none of these defaults to fused) and the state initialisation of the
optimizer's ``_init_group`` (same keys in the same order, same dtypes, ``step`` a 0-d
tensor of ``_get_scalar_dtype()``), so parameters and state are eager's bit for bit.

Why a model rather than inlining torch's own ``_single_tensor_<name>`` through the symbolic
executor: the functions turn state tensors into Python numbers (``_get_value(step_t)``,
NAdam's ``_get_value(mu_product)``: ``.item()``, which a graph must not do; here they are
graph inputs read before the graph runs, ``ScalarOfSource``, and NAdam's updated
``mu_product`` is recomputed from its input as a number by ``scaled_scalar``, rounding as
the 0-d tensor does), they are reached through
``step()``/``_init_group`` (a ``defaultdict`` state filled lazily, ``len(state) == 0``,
``torch.compiler.is_compiling()``, profiler hooks), and the hyperparameters must become
graph inputs rather than guarded constants (a scheduler changes ``lr`` every epoch). Each
update is 15-30 lines that read like torch's source, so checking one against the other is
direct; ``tests/test_more_optimizers.py`` compares them with eager bit for bit.

``lr`` (and RMSprop's ``momentum``, ``betas``) are graph inputs (optim_model._groups);
branches on them (``momentum > 0``, RAdam's ``rho_t > 5``) are guarded. Options with another
code path (foreach=True, fused, capturable, differentiable, a tensor ``lr``, complex or
sparse parameters, parameters off the CPU with foreach=None) fall back with the reason.
"""
from __future__ import annotations

import operator

import torch

from ...guards.sources import AttrSource, ItemSource, Source
from ...records import Unsupported
from .optim import Model, _compare, _grad, _m, _new_state, _num, _pair, _state, state_number
from ..values.symint import SymV
from ..values import ConstV, Value

_COMMON = frozenset({"params", "lr", "eps", "weight_decay", "maximize", "foreach", "differentiable"})


def _neg(tracer, x) -> Value:
    """``-x`` on a Python number (``-1 * x`` is exactly ``-x``, zeros' signs included)."""
    return _num(tracer, operator.mul, -1, x)


def _sub(tracer, a, b) -> Value:
    return _num(tracer, operator.sub, a, b)


def _mul(tracer, a, b) -> Value:
    return _num(tracer, operator.mul, a, b)


def _div(tracer, a, b) -> Value:
    return _num(tracer, operator.truediv, a, b)


def _fn(tracer, fn, *args, **kwargs) -> Value:
    return tracer.call_op("call_function", fn, list(args),
                          {k: (v if isinstance(v, Value) else ConstV(v)) for k, v in kwargs.items()},
                          name=getattr(fn, "__name__", str(fn)))


def _scalar_dtype() -> torch.dtype:
    """torch.optim.optimizer._get_scalar_dtype() for non-fused optimizers."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _zeros(tracer, p) -> Value:
    return _fn(tracer, torch.zeros_like, p, memory_format=torch.preserve_format)


def _zero_d(value: float):
    """``torch.tensor(value, dtype=_get_scalar_dtype())`` (``torch.zeros((), ...)`` for 0.0
    makes the same tensor)."""
    return lambda tracer, p: _fn(tracer, torch.tensor, ConstV(value), dtype=_scalar_dtype())


def _grads(tracer, hyper: dict, params: list, name: str):
    """(parameter, gradient) of the parameters with a gradient (``_init_group`` skips the
    others), after checking the group takes torch's single-tensor path."""
    if hyper["foreach"].concrete() is None:
        devices = {p.example.device.type for p in params} - {"cpu"}
        if devices:
            raise Unsupported("unsupported_call", f"{name} with foreach=None runs torch's foreach "
                              f"implementation for parameters on {sorted(devices)}; only the "
                              "single-tensor (CPU) update is captured")
    for p in params:
        grad = _grad(tracer, p)
        if isinstance(grad, ConstV):
            continue
        if grad.example.is_sparse:
            raise Unsupported("unsupported_call", f"{name} with a sparse gradient is not captured")
        yield p, grad


def _entry(tracer, opt_v, p, name: str, init: list, needed) -> tuple[dict, Source | None]:
    """(the state tensors of ``p``, their source); when ``p`` has no state, the entry
    ``_init_group`` creates (``init``: (key, maker) in eager's order) and None."""
    state, src = _state(tracer, opt_v, p)
    if state is None:
        items = {key: make(tracer, p) for key, make in init}
        _new_state(tracer, opt_v, p, items)
        return items, None
    missing = set(needed) - set(state.items)
    if missing:  # eager raises KeyError: let it
        raise Unsupported("unsupported_call", f"{name} state of a parameter lacks {sorted(missing)}")
    return state.items, src


def _before(tracer, items: dict, src, key: str, initial: float) -> Value:
    """The number in the 0-d state tensor ``key`` before this step: a graph input, or
    ``initial`` for a state entry this step creates."""
    return ConstV(initial) if src is None else state_number(tracer, items, src, key)


def _count(tracer, items, src) -> Value:
    """``step_t += 1; step = _get_value(step_t)``: the step tensor in the graph, the count a
    Python number (a graph input plus one, exact below 2**24)."""
    before = _before(tracer, items, src, "step", 0.0)
    _m(tracer, items["step"], "add_", ConstV(1))
    return _num(tracer, operator.add, before, 1)


def _decay(tracer, p, grad, wd):
    """``grad.add(param, alpha=weight_decay)`` when weight decay is on."""
    return _m(tracer, grad, "add", p, alpha=wd) if wd != 0 else grad


def _hyper(hyper: dict, *keys):
    return tuple(hyper[k].concrete() for k in keys)


def _adadelta(tracer, opt_v, hyper, params) -> None:
    lr = hyper["lr"]
    rho, eps, wd, maximize = _hyper(hyper, "rho", "eps", "weight_decay", "maximize")
    init = [("step", _zero_d(0.0)), ("square_avg", _zeros), ("acc_delta", _zeros)]
    for p, grad in _grads(tracer, hyper, params, "Adadelta"):
        items, _ = _entry(tracer, opt_v, p, "Adadelta", init, ("step", "square_avg", "acc_delta"))
        _m(tracer, items["step"], "add_", ConstV(1))
        grad = _m(tracer, grad, "neg") if maximize else grad
        grad = _decay(tracer, p, grad, wd)
        square_avg, acc_delta = items["square_avg"], items["acc_delta"]
        _m(tracer, _m(tracer, square_avg, "mul_", rho), "addcmul_", grad, grad, value=1 - rho)
        std = _m(tracer, _m(tracer, square_avg, "add", eps), "sqrt_")
        delta = _m(tracer, _m(tracer, acc_delta, "add", eps), "sqrt_")
        delta = _m(tracer, _m(tracer, delta, "div_", std), "mul_", grad)
        _m(tracer, _m(tracer, acc_delta, "mul_", rho), "addcmul_", delta, delta, value=1 - rho)
        _m(tracer, p, "add_", delta, alpha=_neg(tracer, lr))


def _rmsprop(tracer, opt_v, hyper, params) -> None:
    lr, momentum = hyper["lr"], hyper["momentum"]  # graph inputs (OneCycleLR cycles momentum)
    alpha, eps, wd, centered, maximize = _hyper(hyper, "alpha", "eps", "weight_decay",
                                                "centered", "maximize")
    has_momentum = _compare(tracer, operator.gt, momentum, 0)  # guarded
    init = [("step", _zero_d(0.0)), ("square_avg", _zeros)]
    init += [("momentum_buffer", _zeros)] if has_momentum else []
    init += [("grad_avg", _zeros)] if centered else []
    for p, grad in _grads(tracer, hyper, params, "RMSprop"):
        items, _ = _entry(tracer, opt_v, p, "RMSprop", init, [key for key, _ in init])
        grad = _m(tracer, grad, "neg") if maximize else grad
        square_avg = items["square_avg"]
        _m(tracer, items["step"], "add_", ConstV(1))
        grad = _decay(tracer, p, grad, wd)
        _m(tracer, _m(tracer, square_avg, "mul_", alpha), "addcmul_", grad, grad, value=1 - alpha)
        if centered:
            grad_avg = _m(tracer, items["grad_avg"], "lerp_", grad, ConstV(1 - alpha))
            avg = _m(tracer, _m(tracer, square_avg, "addcmul", grad_avg, grad_avg, value=-1), "sqrt_")
        else:
            avg = _m(tracer, square_avg, "sqrt")
        avg = _m(tracer, avg, "add_", ConstV(eps))
        if has_momentum:
            buf = _m(tracer, _m(tracer, items["momentum_buffer"], "mul_", momentum), "addcdiv_", grad, avg)
            _m(tracer, p, "add_", buf, alpha=_neg(tracer, lr))
        else:
            _m(tracer, p, "addcdiv_", grad, avg, value=_neg(tracer, lr))


def _adagrad_sum(opt_v):
    """``_init_group``'s ``sum``: filled with ``self.defaults["initial_accumulator_value"]``
    (the defaults, not the group), read through a guarded source."""
    def make(tracer, p):
        src = ItemSource(AttrSource(opt_v.source, "defaults"), "initial_accumulator_value")
        value = tracer.wrap(opt_v.obj.defaults["initial_accumulator_value"], src).concrete()
        return _fn(tracer, torch.full_like, p, ConstV(value), memory_format=torch.preserve_format)
    return make


def _adagrad(tracer, opt_v, hyper, params) -> None:
    lr = hyper["lr"]
    wd, lr_decay, eps, maximize = _hyper(hyper, "weight_decay", "lr_decay", "eps", "maximize")
    init = [("step", _zero_d(0.0)), ("sum", _adagrad_sum(opt_v))]  # made in __init__ normally
    for p, grad in _grads(tracer, hyper, params, "Adagrad"):
        items, src = _entry(tracer, opt_v, p, "Adagrad", init, ("step", "sum"))
        step = _count(tracer, items, src)
        grad = _m(tracer, grad, "neg") if maximize else grad
        grad = _decay(tracer, p, grad, wd)
        # clr = lr / (1 + (step - 1) * lr_decay)
        clr = _div(tracer, lr, _num(tracer, operator.add, 1, _mul(tracer, _sub(tracer, step, 1), lr_decay)))
        state_sum = _m(tracer, items["sum"], "addcmul_", grad, grad, value=1)
        std = _m(tracer, _m(tracer, state_sum, "sqrt"), "add_", ConstV(eps))
        _m(tracer, p, "addcdiv_", grad, std, value=_neg(tracer, clr))


def _adamax(tracer, opt_v, hyper, params) -> None:
    lr = hyper["lr"]
    beta1, beta2 = _pair(hyper["betas"])
    eps, wd, maximize = _hyper(hyper, "eps", "weight_decay", "maximize")
    init = [("step", _zero_d(0.0)), ("exp_avg", _zeros), ("exp_inf", _zeros)]
    for p, grad in _grads(tracer, hyper, params, "Adamax"):
        grad = _m(tracer, grad, "neg") if maximize else grad
        items, src = _entry(tracer, opt_v, p, "Adamax", init, ("step", "exp_avg", "exp_inf"))
        step = _count(tracer, items, src)
        grad = _decay(tracer, p, grad, wd)
        exp_avg = _m(tracer, items["exp_avg"], "lerp_", grad, _sub(tracer, 1, beta1))
        # torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps), out=exp_inf)
        scaled = _m(tracer, items["exp_inf"], "mul_", beta2)
        larger = _fn(tracer, torch.maximum, scaled,
                     _m(tracer, _m(tracer, grad, "abs"), "add_", ConstV(eps)))
        exp_inf = _m(tracer, scaled, "copy_", larger)
        clr = _div(tracer, lr, _sub(tracer, 1, _num(tracer, operator.pow, beta1, step)))
        _m(tracer, p, "addcdiv_", exp_avg, exp_inf, value=_neg(tracer, clr))


def _decoupled_or_l2(tracer, hyper, p, grad, lr, wd):
    """NAdam's and RAdam's weight decay: ``param.mul_(1 - lr * wd)`` or an L2 term."""
    if wd == 0:
        return grad
    if hyper["decoupled_weight_decay"].concrete():
        _m(tracer, p, "mul_", _sub(tracer, 1, _mul(tracer, lr, wd)))
        return grad
    return _m(tracer, grad, "add", p, alpha=wd)


def scaled_scalar(value: float, factor: float, dtype: torch.dtype) -> float:
    """NAdam's ``mu_product *= mu; _get_value(mu_product)``: the 0-d state tensor scaled in
    place and read back, computed as eager computes it (the product rounds to ``dtype``)."""
    return torch.tensor(value, dtype=dtype).mul_(factor).item()


def _mu_product(tracer, items, src, mu) -> Value:
    """Updates the ``mu_product`` state tensor in the graph and returns its new value as the
    Python number eager reads (a graph-computed number: no ``.item()`` in the graph)."""
    before = _before(tracer, items, src, "mu_product", 1.0)
    t = _m(tracer, items["mu_product"], "mul_", mu)
    dtype = t.example.dtype
    if isinstance(before, ConstV) and isinstance(mu, ConstV):
        return ConstV(scaled_scalar(before.value, mu.value, dtype))
    node = tracer.graph.call_function(scaled_scalar, tuple(
        v.node if isinstance(v, SymV) else v.value for v in (before, mu)) + (dtype,))
    return SymV(scaled_scalar(before.value, mu.value, dtype), node, None, tracer)


def _nadam(tracer, opt_v, hyper, params) -> None:
    lr = hyper["lr"]
    beta1, beta2 = _pair(hyper["betas"])
    wd, momentum_decay, eps, maximize = _hyper(hyper, "weight_decay", "momentum_decay", "eps", "maximize")
    init = [("step", _zero_d(0.0)), ("mu_product", _zero_d(1.0)), ("exp_avg", _zeros),
            ("exp_avg_sq", _zeros)]
    pow_, add = operator.pow, operator.add
    for p, grad in _grads(tracer, hyper, params, "NAdam"):
        grad = _m(tracer, grad, "neg") if maximize else grad
        items, src = _entry(tracer, opt_v, p, "NAdam", init, [key for key, _ in init])
        step = _count(tracer, items, src)
        bias_correction2 = _sub(tracer, 1, _num(tracer, pow_, beta2, step))
        grad = _decoupled_or_l2(tracer, hyper, p, grad, lr, wd)
        # mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay))), mu_next with step + 1
        mu, mu_next = (_mul(tracer, beta1, _sub(tracer, 1.0, _mul(tracer, 0.5, _num(
            tracer, pow_, 0.96, _mul(tracer, s, momentum_decay)))))
            for s in (step, _num(tracer, add, step, 1)))
        mu_product = _mu_product(tracer, items, src, mu)
        exp_avg = _m(tracer, items["exp_avg"], "lerp_", grad, _sub(tracer, 1, beta1))
        exp_avg_sq = _m(tracer, _m(tracer, items["exp_avg_sq"], "mul_", beta2), "addcmul_",
                        grad, grad, value=_sub(tracer, 1, beta2))
        denom = _m(tracer, _m(tracer, exp_avg_sq, "div", bias_correction2), "sqrt")
        mu_product_next = _mul(tracer, mu_product, mu_next)
        denom = _m(tracer, denom, "add_", ConstV(eps))
        neg_lr = _neg(tracer, lr)
        # value=(-lr * (1.0 - mu) / (1.0 - mu_product)), then (-lr * mu_next) / (1.0 - mu_product_next)
        _m(tracer, p, "addcdiv_", grad, denom, value=_div(
            tracer, _mul(tracer, neg_lr, _sub(tracer, 1.0, mu)), _sub(tracer, 1.0, mu_product)))
        _m(tracer, p, "addcdiv_", exp_avg, denom, value=_div(
            tracer, _mul(tracer, neg_lr, mu_next), _sub(tracer, 1.0, mu_product_next)))


def _radam(tracer, opt_v, hyper, params) -> None:
    lr = hyper["lr"]
    beta1, beta2 = _pair(hyper["betas"])
    wd, eps, maximize = _hyper(hyper, "weight_decay", "eps", "maximize")
    init = [("step", _zero_d(0.0)), ("exp_avg", _zeros), ("exp_avg_sq", _zeros)]
    pow_ = operator.pow
    for p, grad in _grads(tracer, hyper, params, "RAdam"):
        grad = _m(tracer, grad, "neg") if maximize else grad
        items, src = _entry(tracer, opt_v, p, "RAdam", init, [key for key, _ in init])
        step = _count(tracer, items, src)
        grad = _decoupled_or_l2(tracer, hyper, p, grad, lr, wd)
        exp_avg = _m(tracer, items["exp_avg"], "lerp_", grad, _sub(tracer, 1, beta1))
        exp_avg_sq = _m(tracer, _m(tracer, items["exp_avg_sq"], "mul_", beta2), "addcmul_",
                        grad, grad, value=_sub(tracer, 1, beta2))
        bias_correction1 = _sub(tracer, 1, _num(tracer, pow_, beta1, step))
        bias_correction2 = _sub(tracer, 1, _num(tracer, pow_, beta2, step))
        corrected = _fn(tracer, operator.truediv, exp_avg, bias_correction1)
        rho_inf = _sub(tracer, _div(tracer, 2, _sub(tracer, 1, beta2)), 1)
        # rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        rho_t = _sub(tracer, rho_inf, _div(tracer, _mul(tracer, _mul(tracer, 2, step), _num(
            tracer, pow_, beta2, step)), bias_correction2))
        update = _fn(tracer, operator.mul, corrected, lr)
        if _compare(tracer, operator.gt, rho_t, 5.0):  # guarded: flips once as steps grow
            sq_sqrt = _m(tracer, _m(tracer, exp_avg_sq, "sqrt"), "add_", ConstV(eps))
            adaptive = _fn(tracer, operator.truediv, _num(tracer, pow_, bias_correction2, 0.5), sq_sqrt)
            rect = _num(tracer, pow_, _div(
                tracer, _mul(tracer, _mul(tracer, _sub(tracer, rho_t, 4), _sub(tracer, rho_t, 2)), rho_inf),
                _mul(tracer, _mul(tracer, _sub(tracer, rho_inf, 4), _sub(tracer, rho_inf, 2)), rho_t)), 0.5)
            update = _fn(tracer, operator.mul, _fn(tracer, operator.mul, update, adaptive), rect)
        _m(tracer, p, "add_", update, alpha=-1.0)


_BETAS = frozenset({"betas", "capturable"})
MODELS = {
    torch.optim.Adadelta: Model(_COMMON | {"rho", "capturable"}, _adadelta),
    torch.optim.RMSprop: Model(_COMMON | {"alpha", "momentum", "centered", "capturable"}, _rmsprop),
    torch.optim.Adagrad: Model(_COMMON | {"lr_decay", "initial_accumulator_value", "fused"}, _adagrad),
    torch.optim.Adamax: Model(_COMMON | _BETAS, _adamax),
    torch.optim.NAdam: Model(_COMMON | _BETAS | {"momentum_decay", "decoupled_weight_decay"}, _nadam),
    torch.optim.RAdam: Model(_COMMON | _BETAS | {"decoupled_weight_decay"}, _radam),
}
