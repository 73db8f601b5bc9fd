"""``opt.zero_grad()`` and ``opt.step()`` of torch's SGD, Adam and AdamW (here) and of
Adadelta, RMSprop, Adagrad, Adamax, NAdam and RAdam (optim_more.py), captured into the
graph by replaying the same tensor operations torch's single-tensor (CPU default) update
runs, in the same order, so the result is bit-for-bit eager's. ``_table`` maps each
optimizer class to the param-group keys its ``step()`` reads and its per-group update.

Parameters, momentum buffers and Adam moments are updated in place through the shadow heap
(computed functionally in the graph, committed after the call succeeded); new optimizer
state entries are committed as ``opt.state[p] = {...}``. The learning rate, SGD's momentum,
Adam's betas and step count are graph inputs (read before the graph runs), so an LR
scheduler stepping between calls (OneCycleLR and CyclicLR cycle momentum / ``betas[0]``)
and the growing step count do not recompile; only decisions on them (``momentum != 0``)
are guarded. Unsupported options (fused, foreach, capturable, differentiable, tensor
hyperparameters, complex or sparse parameters, hooks) fall back.
"""
from __future__ import annotations

import numbers

import functools
import operator
from typing import Callable, NamedTuple

import torch

from ..._torch_nn import global_optimizer_hooks
from ...guards import ContainsGuard, NoStepHooksGuard
from ...guards.sources import AttrSource, ItemSource, KeyedSource, ScalarOfSource, Source
from ...records import Unsupported
from ..inputs import wrap_argument
from ..values.symint import SymV, arithmetic, compare
from ..values import ConstV, DictV, ObjV, TensorV, TupleV, Value
from ..models import provides
from ..attrs import store_attr
from ...guards import DictKeysGuard, LenGuard

SUPPORTED = (torch.optim.SGD, torch.optim.Adam)  # AdamW is an Adam subclass in torch 2.13


class Model(NamedTuple):
    reads: frozenset   # the param-group keys step() reads (see _READS)
    update: Callable   # (tracer, opt_v, hyper, params): one param group's update


@functools.cache
def _table() -> dict:
    """Optimizer class (exact type: a subclass may override step) -> its Model."""
    from .optim_more import MODELS
    adam = Model(_READS[torch.optim.Adam], _adam)
    return {torch.optim.SGD: Model(_READS[torch.optim.SGD], _sgd), torch.optim.Adam: adam,
            torch.optim.AdamW: adam, **MODELS}


@provides("optim_is_modelled")
def is_modelled(opt, name: str = "step") -> bool:
    """Whether ``opt.<name>()`` is captured: both methods of the optimizers in ``_table``;
    ``zero_grad`` of any torch optimizer that keeps ``Optimizer.zero_grad`` (the closure
    ``LBFGS.step`` calls zeroes the gradients; that ``step`` runs eagerly)."""
    if type(opt) in _table():
        return True
    return name == "zero_grad" and isinstance(opt, torch.optim.Optimizer) and \
        getattr(type(opt), "zero_grad", None) is torch.optim.Optimizer.zero_grad


@provides("captured_optimizer_names")
def captured_names() -> str:
    return ", ".join(cls.__name__ for cls in _table())


def call(tracer, opt_v: ObjV, name: str, args: list, kwargs: dict) -> Value:
    opt = opt_v.obj
    own = opt.__dict__.get(name)
    wrapped_by_scheduler = own is not None and getattr(own, "_wrapped_by_lr_sched", False)
    if own is not None and not wrapped_by_scheduler:
        raise Unsupported("unsupported_call", f"optimizer.{name} was replaced on the instance")
    if opt_v.source is None:
        raise Unsupported("unsupported_call", "an optimizer that cannot be addressed after the call")
    _guard_no_hooks(tracer, opt_v)
    groups = _groups(tracer, opt_v, read_hyper=name == "step")
    if name == "zero_grad":
        set_to_none = (args[0] if args else kwargs.get("set_to_none", ConstV(True))).concrete()
        from .nn_module import zero_grads
        zero_grads(tracer, [p for _, params in groups for p in params], bool(set_to_none))
        return ConstV(None)
    if name == "step":
        if args or any(not (isinstance(v, ConstV) and v.value is None) for v in kwargs.values()):
            raise Unsupported("unsupported_call", "optimizer.step(closure) is not captured")
        if wrapped_by_scheduler:  # what an LRScheduler's wrapper around step() records
            store_attr(tracer, opt_v, "_opt_called", ConstV(True))
        prior = torch.is_grad_enabled()
        _set_grad(tracer, False)
        try:
            update = _table()[type(opt)].update
            for group, params in groups:
                update(tracer, opt_v, group, params)
        finally:
            _set_grad(tracer, prior)
        return ConstV(None)
    raise Unsupported("unsupported_call", f"optimizer.{name}() is not captured")


def _set_grad(tracer, enabled: bool) -> None:
    from .grad_mode import set_grad
    set_grad(tracer, enabled)


def _guard_no_hooks(tracer, opt_v: ObjV) -> None:
    opt = opt_v.obj
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or global_optimizer_hooks():
        raise Unsupported("module_hooks", "the optimizer has step hooks registered")
    # guards on the optimizer's source: the check reads it from the variable holding it
    tracer.add_guard(NoStepHooksGuard, opt_v.source)
    tracer.add_guard(ContainsGuard, AttrSource(opt_v.source, "__dict__"), key_value="step",
                     expected="step" in opt.__dict__)  # an LRScheduler wraps its step


# The param-group keys each modelled optimizer's step() reads (torch 2.13's ``step`` and
# ``_init_group``). Other keys never reach the update: an LR scheduler's bookkeeping
# (``initial_lr``, ``max_lr``, ``min_lr``, ``base_momentum``, ``max_momentum``, ...) or a
# user's ``"name"``; they are neither read nor guarded, so a scheduler may change them.
_READS = {
    torch.optim.SGD: frozenset({"params", "lr", "momentum", "dampening", "weight_decay", "nesterov",
                                "maximize", "foreach", "differentiable", "fused"}),
    torch.optim.Adam: frozenset({"params", "lr", "betas", "eps", "weight_decay", "amsgrad",
                                 "maximize", "foreach", "capturable", "differentiable", "fused",
                                 "decoupled_weight_decay"}),
}
# Values a scheduler changes between steps: graph inputs, not guarded constants.
_SYMBOLIC = {"lr", "momentum"}


def _reads(opt) -> frozenset:
    return _table()[type(opt)].reads


def _written_here(tracer, obj) -> bool:
    """Whether this capture already mutated the list/dict ``obj`` (its writes wait in the
    shadow heap, so the real object still holds the values from before the call)."""
    value = tracer._by_container_id.get(id(obj))  # one Value per container read in this capture
    return value is not None and tracer.heap.touched(value)


def _groups(tracer, opt_v: ObjV, read_hyper: bool = True) -> list[tuple[dict, list[TensorV]]]:
    """(hyperparameters, parameter values) per param group, with guards on each value the
    optimizer reads; ``lr``, SGD's ``momentum`` and Adam's betas are graph inputs so
    schedulers do not cause recompiles."""
    opt = opt_v.obj
    if tracer.heap.read_attr(opt, "param_groups") is not None:
        raise Unsupported("unsupported_call", "optimizer.param_groups was replaced in the captured "
                          "function before the optimizer call")
    groups_src = AttrSource(opt_v.source, "param_groups")
    raw_groups = opt.param_groups
    if _written_here(tracer, raw_groups) or any(
            _written_here(tracer, g) or _written_here(tracer, g.get("params")) for g in raw_groups):
        raise Unsupported("unsupported_call", "an optimizer param group is written in the captured "
                          "function before the optimizer call (set the learning rate between calls)")
    tracer.add_guard(LenGuard, groups_src, list, len(raw_groups))
    # (zero_grad reads only the parameters: of any optimizer, is_modelled)
    reads = _reads(opt) if read_hyper else frozenset({"params"})
    # a key the optimizer defines that the model does not know (a newer torch's option)
    unmodelled = (set(opt.defaults) - reads) & {k for g in raw_groups for k in g} if read_hyper else ()
    if unmodelled:
        raise Unsupported("unsupported_call", f"optimizer param group has options {sorted(unmodelled)}")
    result = []
    for gi, group in enumerate(raw_groups):
        g_src = ItemSource(groups_src, gi)
        tracer.add_guard(DictKeysGuard, g_src, dict, tuple(group))
        if not reads <= set(group):
            raise Unsupported("unsupported_call", f"optimizer param group lacks {sorted(reads - set(group))}")
        hyper = {}
        for key in sorted(reads - {"params"}) if read_hyper else ():
            if isinstance(group[key], torch.Tensor):
                raise Unsupported("unsupported_call", f"optimizer option {key} is a tensor "
                                  "(a tensor learning rate) and is not captured")
            hyper[key] = _hyper_value(tracer, key, group[key], ItemSource(g_src, key))
        for flag in ("foreach", "fused", "differentiable", "capturable"):
            if flag in hyper and hyper[flag].concrete():
                raise Unsupported("unsupported_call", f"optimizer option {flag}=True is not captured")
        params_src = ItemSource(g_src, "params")
        tracer.add_guard(LenGuard, params_src, list, len(group["params"]))
        params = []
        for pi, p in enumerate(group["params"]):
            v = tracer.wrap(p, ItemSource(params_src, pi))
            if not isinstance(v, TensorV) or p.is_sparse or p.is_complex():
                raise Unsupported("unsupported_call", "sparse or complex parameters")
            params.append(v)
        result.append((hyper, params))
    return result


def _hyper_value(tracer, key: str, raw, src: Source) -> Value:
    """A float that schedulers vary is a graph input; ``betas`` a tuple of two such inputs
    (OneCycleLR and CyclicLR replace ``betas[0]`` every step); anything else a guarded constant."""
    if key in _SYMBOLIC and type(raw) is float:
        return number_input(tracer, raw, src)
    if key == "betas" and type(raw) is tuple and len(raw) == 2:
        tracer.add_guard(LenGuard, src, tuple, 2)
        items = []
        for i, beta in enumerate(raw):
            if isinstance(beta, torch.Tensor):
                raise Unsupported("unsupported_call", "optimizer option betas holds tensors "
                                  "and is not captured")
            item_src = ItemSource(src, i)
            items.append(number_input(tracer, beta, item_src)
                         if type(beta) is float else _plain_number(tracer, key, beta, item_src))
        return TupleV(items, tuple, src)
    return _plain_number(tracer, key, raw, src)


def _plain_number(tracer, key: str, raw, src: Source) -> Value:
    """``raw`` as a guarded constant; a number of another type than Python's (``np.float64``
    from ``np.linspace``) is refused: the update's arithmetic is modelled on Python numbers."""
    if isinstance(raw, numbers.Number) and type(raw) not in (int, float, bool, complex):
        raise Unsupported("unsupported_call", f"optimizer option {key!r} is a "
                          f"{type(raw).__module__}.{type(raw).__name__}, not a Python number "
                          f"(pass float({key}) to the optimizer to capture its step)")
    return tracer.wrap(raw, src)


def number_input(tracer, raw, src: Source) -> Value:
    """A Python number read before the graph runs, as a graph input; one per source (a
    second ``step()`` in the call reads the same input, not a second placeholder)."""
    seen = tracer._by_source.get(src)
    return seen if seen is not None else wrap_argument(tracer, raw, src, frozenset(), True)


def state_number(tracer, items: dict, src: Source, key: str) -> Value:
    """The number in the 0-d state tensor ``items[key]`` as eager's ``_get_value`` reads it
    (``.item()``): a graph input read before the graph runs, so only while this call has
    not written the tensor (a second ``step()`` in one call would read the old count)."""
    t = items[key]
    if not isinstance(t, TensorV) or t.real is None or t.updated or t.example.numel() != 1:
        raise Unsupported("unsupported_call", f"optimizer state {key!r} written earlier in the "
                          "call (two step() calls in one optimized call) is not captured")
    return number_input(tracer, t.real.item(), ScalarOfSource(ItemSource(src, key)))


def _state(tracer, opt_v: ObjV, p: TensorV) -> tuple[DictV | None, Source]:
    """The optimizer's state entry for ``p`` (None when absent), read through a guarded source."""
    written = tracer.opt_state.get((id(opt_v.obj), id(p.real)))
    src = KeyedSource(AttrSource(opt_v.source, "state"), p.source)
    if written is not None:
        return written, src
    entry = tracer.wrap(opt_v.obj.state.get(p.real), src)
    if isinstance(entry, ConstV) and entry.value is None:
        return None, src
    if not isinstance(entry, DictV):
        raise Unsupported("unsupported_call", "unexpected optimizer state entry")
    return entry, src


def _new_state(tracer, opt_v: ObjV, p: TensorV, items: dict) -> DictV:
    entry = DictV(items)
    tracer.opt_state[(id(opt_v.obj), id(p.real))] = entry
    state_v = ObjV(opt_v.obj.state, AttrSource(opt_v.source, "state"))
    tracer.heap.write_item(state_v, p, entry, tracer.where())
    return entry


def _m(tracer, t: Value, name: str, *args, **kwargs) -> Value:
    args = [a if isinstance(a, Value) else ConstV(a) for a in args]
    return tracer.call_op("call_method", name, [t, *args],
                          {k: (v if isinstance(v, Value) else ConstV(v)) for k, v in kwargs.items()},
                          name=name)


def _num(tracer, op, a, b) -> Value:
    """Python-number arithmetic that stays symbolic when an operand is a graph input."""
    a = a if isinstance(a, Value) else ConstV(a)
    b = b if isinstance(b, Value) else ConstV(b)
    if isinstance(a, SymV) or isinstance(b, SymV):
        return arithmetic(tracer, op, a, b)
    return ConstV(op(a.value, b.value))


def _compare(tracer, op, a, b) -> bool:
    """A comparison that decides Python control flow: guarded when an operand is an input."""
    if isinstance(a, SymV) or isinstance(b, SymV):
        return compare(tracer, op, a if isinstance(a, Value) else ConstV(a),
                       b if isinstance(b, Value) else ConstV(b)).value
    return op(a.concrete() if isinstance(a, Value) else a, b.concrete() if isinstance(b, Value) else b)


def _pair(betas: Value) -> tuple:
    """``beta1, beta2 = group["betas"]``: graph inputs or constants."""
    if isinstance(betas, TupleV):
        return tuple(betas.items)
    beta1, beta2 = betas.concrete()
    return ConstV(beta1), ConstV(beta2)


def _grad(tracer, p: TensorV) -> Value:
    from .training import read_grad
    return read_grad(tracer, p)


def _sgd(tracer, opt_v, hyper, params) -> None:
    lr, momentum = hyper["lr"], hyper["momentum"]  # momentum: a number, maybe a graph input
    # whether a momentum buffer is kept is decided here: guarded, so momentum 0 later recaptures
    has_momentum = _compare(tracer, operator.ne, momentum, 0)
    dampening, wd = hyper["dampening"].concrete(), hyper["weight_decay"].concrete()
    nesterov, maximize = hyper["nesterov"].concrete(), hyper["maximize"].concrete()
    for p in params:
        grad = _grad(tracer, p)
        if isinstance(grad, ConstV):
            continue
        if maximize:
            grad = _m(tracer, grad, "neg")
        if wd != 0:
            grad = _m(tracer, grad, "add", p, alpha=wd)
        if has_momentum:
            state, _ = _state(tracer, opt_v, p)
            buf = None if state is None else state.items.get("momentum_buffer")
            if buf is None or (isinstance(buf, ConstV) and buf.value is None):
                buf = _m(tracer, _m(tracer, grad, "detach"), "clone")
                if state is None:
                    _new_state(tracer, opt_v, p, {"momentum_buffer": buf})
                else:
                    raise Unsupported("unsupported_call", "an SGD state entry without a momentum buffer")
            else:
                buf = _m(tracer, _m(tracer, buf, "mul_", momentum), "add_", grad,
                         alpha=1 - dampening)
            grad = _m(tracer, grad, "add", buf, alpha=momentum) if nesterov else buf
        _m(tracer, p, "add_", grad, alpha=_num(tracer, operator.sub, 0, lr))


def _adam(tracer, opt_v, hyper, params) -> None:
    lr = hyper["lr"]
    beta1, beta2 = _pair(hyper["betas"])  # numbers, maybe graph inputs (a scheduler cycles beta1)
    eps, wd = hyper["eps"].concrete(), hyper["weight_decay"].concrete()
    maximize, amsgrad = hyper["maximize"].concrete(), hyper["amsgrad"].concrete()
    decoupled = hyper["decoupled_weight_decay"].concrete() if "decoupled_weight_decay" in hyper else False
    for p in params:
        grad = _grad(tracer, p)
        if isinstance(grad, ConstV):
            continue
        state, src = _state(tracer, opt_v, p)
        if state is None:
            step_t = tracer.call_op("call_function", torch.tensor, [ConstV(0.0)],
                                    {"dtype": ConstV(torch.get_default_dtype())}, name="tensor")
            exp_avg = tracer.call_op("call_function", torch.zeros_like, [p],
                                     {"memory_format": ConstV(torch.preserve_format)}, name="zeros_like")
            exp_avg_sq = tracer.call_op("call_function", torch.zeros_like, [p],
                                        {"memory_format": ConstV(torch.preserve_format)}, name="zeros_like")
            items = {"step": step_t, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
            if amsgrad:
                items["max_exp_avg_sq"] = tracer.call_op(
                    "call_function", torch.zeros_like, [p],
                    {"memory_format": ConstV(torch.preserve_format)}, name="zeros_like")
            _new_state(tracer, opt_v, p, items)
            steps_before: Value = ConstV(0.0)
        else:
            keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
            if set(state.items) != keys:
                raise Unsupported("unsupported_call", f"Adam state with keys {sorted(state.items)}")
            step_t, exp_avg, exp_avg_sq = (state.items[k] for k in ("step", "exp_avg", "exp_avg_sq"))
            steps_before = state_number(tracer, state.items, src, "step")
        if maximize:
            grad = _m(tracer, grad, "neg")
        step_t = _m(tracer, step_t, "add_", ConstV(1))
        if wd != 0:
            if decoupled:
                _m(tracer, p, "mul_", _num(tracer, operator.sub, 1, _num(tracer, operator.mul, lr, wd)))
            else:
                grad = _m(tracer, grad, "add", p, alpha=wd)
        exp_avg = _m(tracer, exp_avg, "lerp_", grad, _num(tracer, operator.sub, 1, beta1))
        exp_avg_sq = _m(tracer, _m(tracer, exp_avg_sq, "mul_", beta2), "addcmul_", grad, grad,
                        value=_num(tracer, operator.sub, 1, beta2))
        step = _num(tracer, operator.add, steps_before, 1.0)
        bias_correction1 = _num(tracer, operator.sub, 1, _num(tracer, operator.pow, beta1, step))
        bias_correction2 = _num(tracer, operator.sub, 1, _num(tracer, operator.pow, beta2, step))
        step_size = _num(tracer, operator.truediv, lr, bias_correction1)
        bc2_sqrt = _num(tracer, operator.pow, bias_correction2, 0.5)
        second_moment = exp_avg_sq
        if amsgrad:  # torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            max_sq = state.items["max_exp_avg_sq"] if state is not None else items["max_exp_avg_sq"]
            larger = tracer.call_op("call_function", torch.maximum, [max_sq, exp_avg_sq], {},
                                    name="maximum")
            second_moment = _m(tracer, max_sq, "copy_", larger)
        denom = _m(tracer, tracer.call_op("call_function", operator.truediv,
                                          [_m(tracer, second_moment, "sqrt"), bc2_sqrt], {}),
                   "add_", ConstV(eps))
        _m(tracer, p, "addcdiv_", exp_avg, denom,
           value=_num(tracer, operator.sub, 0, step_size))
