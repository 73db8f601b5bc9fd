"""``nn.Module`` methods used inside forward and training steps, and the gradient utilities
that go with them, modelled over values instead of inlined:

* ``parameters()``, ``named_parameters()``, ``buffers()``, ``named_buffers()``,
  ``children()``, ``named_children()``, ``modules()``, ``named_modules()``: torch's versions
  are generators (which capture cannot run). The items are read through guarded sources
  (``L['self'].fc._parameters['weight']``) and the module tree's key sets are guarded, so a
  parameter added or replaced later is noticed;
* ``module.zero_grad(set_to_none=...)`` (also used by the optimizers' ``zero_grad``);
* ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``: the same ops torch runs on
  CPU and CUDA for one device and dtype (``_foreach_norm``, ``vector_norm`` of the stacked
  norms, the clamped coefficient), with the in-place scaling of each ``.grad`` deferred
  through the shadow heap like any in-place update.
"""
from __future__ import annotations

import operator

import torch
import torch.nn as nn

from ...fx_lower._torch_foreach import foreach_norm
from ...guards import NotNoneGuard
from ...guards.sources import AttrSource, ModuleDictSource
from ...records import Unsupported
from ..operators import _guard_keys, consume
from ..values import ConstV, IterV, ListV, ObjV, TensorV, TupleV, Value
from ..models import provides

_TABLES = {"parameters": "_parameters", "buffers": "_buffers"}
ITERATORS = {"parameters", "named_parameters", "buffers", "named_buffers", "children",
             "named_children", "modules", "named_modules"}
METHODS = ITERATORS | {"zero_grad"}


@provides("module_method_is_modelled")
def is_modelled(module: nn.Module, name: str) -> bool:
    """``module.name`` is nn.Module's own method (not overridden) that this file models."""
    return name in METHODS and getattr(type(module), name, None) is getattr(nn.Module, name)


def call(tracer, mod: ObjV, name: str, args: list, kwargs: dict) -> Value:
    if mod.source is None:
        raise Unsupported("unsupported_call", f"{name}() of a module that cannot be addressed "
                          "after the call")
    if name == "zero_grad":
        set_to_none = _flag(args[0] if args else kwargs.get("set_to_none"), True)
        zero_grads(tracer, [p for _, p in _named(tracer, mod, "parameters", True)], set_to_none)
        return ConstV(None)
    if args:
        raise Unsupported("unsupported_call", f"{name}() with positional arguments is not captured")
    options = {k: v.concrete() for k, v in kwargs.items()}
    recurse = options.pop("recurse", True)
    prefix = options.pop("prefix", "")
    if options.pop("remove_duplicate", True) is not True or options or prefix:
        raise Unsupported("unsupported_call", f"{name}() with these arguments is not captured")
    kind = name.removeprefix("named_")
    if kind in _TABLES:
        pairs = _named(tracer, mod, kind, recurse)
    elif kind == "children":
        _guard_keys(tracer, mod, "_modules")
        pairs = [(k, tracer.wrap(m, ModuleDictSource(mod.source, "_modules", k)))
                 for k, m in mod.obj._modules.items() if m is not None]
        pairs = _unique(pairs)
    else:  # modules
        pairs = _unique(_tree(tracer, mod, ""))
    if name.startswith("named_"):
        return IterV([TupleV([ConstV(k), v]) for k, v in pairs])
    return IterV([v for _, v in pairs])


def _tree(tracer, mod: ObjV, prefix: str) -> list[tuple[str, Value]]:
    """(qualified name, module value) of ``mod`` and every submodule, in torch's order."""
    _guard_keys(tracer, mod, "_modules")
    out = [(prefix, mod)]
    for key, child in mod.obj._modules.items():
        if child is not None:
            value = tracer.wrap(child, ModuleDictSource(mod.source, "_modules", key))
            out += _tree(tracer, value, f"{prefix}.{key}" if prefix else key)
    return out


def _named(tracer, mod: ObjV, kind: str, recurse: bool) -> list[tuple[str, Value]]:
    """What ``named_parameters()`` / ``named_buffers()`` yields, with guarded sources."""
    table = _TABLES[kind]
    owners = _unique(_tree(tracer, mod, "")) if recurse else [("", mod)]
    pairs = []
    for prefix, owner in owners:
        _guard_keys(tracer, owner, table)
        for key, t in getattr(owner.obj, table).items():
            if t is not None:
                name = f"{prefix}.{key}" if prefix else key
                pairs.append((name, tracer.wrap(t, ModuleDictSource(owner.source, table, key))))
    return _unique(pairs)


def _unique(pairs: list) -> list:
    """Drop repeats of one object, keeping the first name (torch's ``remove_duplicate``)."""
    seen, out = set(), []
    for name, value in pairs:
        key = id(value.concrete())
        if key not in seen:
            seen.add(key)
            out.append((name, value))
    return out


def _flag(value: Value | None, default: bool) -> bool:
    return default if value is None else bool(value.concrete())


def zero_grads(tracer, params: list, set_to_none: bool) -> None:
    """``zero_grad()`` of a module or an optimizer over these parameter values."""
    from .training import read_grad, write_grad
    for p in params:
        if set_to_none and _drop_grad(tracer, p, write_grad):
            continue
        grad = read_grad(tracer, p)
        if isinstance(grad, ConstV):  # None: nothing to do either way
            continue
        if set_to_none:
            write_grad(tracer, p, ConstV(None))
        else:
            if grad.example.requires_grad or grad.example.grad_fn is not None:
                raise Unsupported("unsupported_call", "zero_grad(set_to_none=False) of a "
                                  "gradient that requires grad is not captured")
            tracer.call_op("call_method", "zero_", [grad], {}, name="zero_")


def _drop_grad(tracer, p, write_grad) -> bool:
    """``p.grad = None`` for a parameter whose gradient, from before the call, is not None:
    eager only asks whether it is None, so the guard says only that (the old gradient is no
    graph input: nothing checks its metadata or memory on each call). False where the
    gradient was written in this call or is None."""
    if p.real is None or p.source is None or p.real.grad is None \
            or tracer.heap.read_attr(p.real, "grad") is not None:
        return False
    tracer.add_guard(NotNoneGuard, AttrSource(p.source, "grad"))
    write_grad(tracer, p, ConstV(None))
    return True


def _grads(tracer, parameters: Value) -> list[Value]:
    from .training import read_grad
    params = [parameters] if isinstance(parameters, TensorV) else consume(tracer, parameters)
    if not all(isinstance(p, TensorV) for p in params):
        raise Unsupported("unsupported_call", "gradient clipping over something other than tensors")
    grads = [g for g in (read_grad(tracer, p) for p in params) if not isinstance(g, ConstV)]
    if len({(g.example.device, g.example.dtype) for g in grads}) > 1:
        raise Unsupported("unsupported_call", "gradient clipping over gradients of several "
                          "devices or dtypes is not captured")
    return grads


def _op(tracer, fn, *args, **kwargs) -> Value:
    def value(v):
        return v if isinstance(v, Value) else ConstV(v)
    return tracer.call_op("call_function", fn, [value(a) for a in args],
                          {k: value(v) for k, v in kwargs.items()})


def _method(tracer, t: Value, name: str, *args) -> Value:
    return tracer.call_op("call_method", name, [t, *args], {}, name=name)


def clip_grad_norm(tracer, fn, args, kwargs) -> Value:
    names = ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach")
    bound = dict(zip(names, args)) | kwargs
    if _flag(bound.get("error_if_nonfinite"), False) or _flag(bound.get("foreach"), False):
        raise Unsupported("unsupported_call", "clip_grad_norm_(error_if_nonfinite=True / "
                          "foreach=True) is not captured")
    max_norm = float(bound["max_norm"].concrete())
    norm_type = float(bound["norm_type"].concrete()) if "norm_type" in bound else 2.0
    grads = _grads(tracer, bound["parameters"])
    if not grads:
        return tracer.wrap_python(torch.tensor(0.0))
    with _no_grad(tracer):
        norms = _op(tracer, foreach_norm, ListV(grads), norm_type)
        total = _op(tracer, torch.linalg.vector_norm, _op(tracer, torch.stack, norms), norm_type)
        # max_norm / (total + 1e-6) with Python operators: Tensor.__rtruediv__, as in torch
        coef = _op(tracer, torch.clamp, _op(tracer, operator.truediv, ConstV(max_norm),
                                           _op(tracer, operator.add, total, ConstV(1e-6))), max=1.0)
        for g in grads:
            _method(tracer, g, "mul_", coef)
    return total


def clip_grad_value(tracer, fn, args, kwargs) -> Value:
    names = ("parameters", "clip_value", "foreach")
    bound = dict(zip(names, args)) | kwargs
    if _flag(bound.get("foreach"), False):
        raise Unsupported("unsupported_call", "clip_grad_value_(foreach=True) is not captured")
    clip = float(bound["clip_value"].concrete())
    # foreach=None: torch's foreach path (clamp_min_, clamp_max_); foreach=False: one clamp_
    # per gradient (one version bump, as eager's)
    foreach = bound.get("foreach")
    per_tensor = foreach is not None and foreach.concrete() is False
    with _no_grad(tracer):
        for g in _grads(tracer, bound["parameters"]):
            if per_tensor:
                _method(tracer, g, "clamp_", ConstV(-clip), ConstV(clip))
            else:
                _method(tracer, g, "clamp_min_", ConstV(-clip))
                _method(tracer, g, "clamp_max_", ConstV(clip))
    return ConstV(None)


class _no_grad:
    """Grad mode off while modelling a ``@torch.no_grad`` torch function (capture and graph)."""

    def __init__(self, tracer):
        self.tracer = tracer

    def __enter__(self):
        from .optim import _set_grad
        self.prior = torch.is_grad_enabled()
        _set_grad(self.tracer, False)

    def __exit__(self, *exc):
        from .optim import _set_grad
        _set_grad(self.tracer, self.prior)
        return False
