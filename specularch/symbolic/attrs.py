"""Attribute reads (``obj.name``) over values, following Python's lookup rules.

nn.Module attributes resolve the way ``nn.Module.__getattr__`` would, but through sources
that read ``_parameters``/``_buffers``/``_modules`` directly, so parameters and buffers
become graph inputs read on every call (never constants baked into the graph).
"""
from __future__ import annotations

import inspect
import types

import torch
import torch.nn as nn

from .._torch_nn import registration_hooks
from ..guards import NoRegistrationHooksGuard
from ..guards.sources import AttrSource, ModuleDictSource
from ..records import Unsupported
from ..shadow_heap import DELETED
from .values.deque import DequeV
from .rolled import objects as rolled_objects
from .speculation.leaf_writes import metadata_of
from .lookup_guards import guard_lookup, guard_method_lookup, is_trusted_module
from .models import MODELS
from .values import ConstV, DictV, DictViewV, MethodV, NewObjV, ObjV, SuperV, TensorV, TupleV, UntrackedContainerV, Value
from .exceptions import missing_attribute
from .exceptions import exception_attr

_MISSING = object()

# Tensor attributes that are metadata (guarded through the tensor's own guard: the device
# kinds follow from its device, the layouts from its type, dtype and strides).
TENSOR_META = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout",
               "is_sparse", "is_sparse_csr", "is_quantized", "is_meta", "is_mkldnn", "is_nested",
               "is_cpu", "is_xpu", "is_mps", "is_ipu", "is_maia", "is_mtia", "is_vulkan", "is_xla",
               "is_leaf", "itemsize", "nbytes"}
# Tensor attributes that produce a tensor (recorded as ``getattr`` nodes).
TENSOR_VIEWS = {"T", "mT", "H", "mH", "real", "imag", "data"}


def load_attr(tracer, frame, v: Value, name: str) -> Value:
    if isinstance(v, rolled_objects.RowV):  # an item of a rolled loop over objects
        return rolled_objects.attr(tracer, v, name)
    if isinstance(v, TensorV):
        return _tensor_attr(tracer, v, name)
    if isinstance(v, ObjV) and isinstance(v.obj, BaseException) and v.source is None:
        return exception_attr(tracer, v, name)
    if isinstance(v, ObjV):
        return _object_attr(tracer, frame, v, name)
    if isinstance(v, SuperV):
        return _super_attr(tracer, v, name)
    if isinstance(v, NewObjV):
        return _new_object_attr(tracer, v, name)
    if isinstance(v, (UntrackedContainerV, DictViewV, MODELS.ExitStackV)):
        return MethodV(v, None, name)
    if name == "maxlen" and isinstance(v, DequeV):
        return ConstV(v.maxlen)
    if isinstance(v, TupleV) and v.cls is not tuple and not callable(getattr(v.cls, name, None)):
        return _tuple_field(v, name)
    if isinstance(v, ConstV):
        try:
            attr = getattr(v.value, name)
        except AttributeError as e:
            raise Unsupported("exception_handling", f"AttributeError: {e}") from None
        if callable(attr) and not isinstance(attr, type):
            return MethodV(v, None, name)
        return tracer.wrap_python(attr)
    if hasattr(v, "items") and not name.startswith("__"):
        return MethodV(v, None, name)
    raise Unsupported("unsupported_call", f"attribute {name!r} of {type(v).__name__}")


def _tensor_attr(tracer, v: TensorV, name: str) -> Value:
    if name == "shape":
        return tracer.sym_shape(v)
    if name in TENSOR_META:
        return tracer.wrap_python(getattr(metadata_of(v), name))
    if name in TENSOR_VIEWS:
        return tracer.call_op("call_function", getattr, [v, ConstV(name)], {}, name=name)
    if name == "grad":
        return MODELS.read_grad(tracer, v)
    attr = getattr(v.example, name, _MISSING)
    if attr is _MISSING:
        raise Unsupported("exception_handling", f"Tensor has no attribute {name!r}")
    if callable(attr):
        return MethodV(v, None, name)
    raise Unsupported("unsupported_call", f"tensor attribute {name!r}")


def _tuple_field(v: TupleV, name: str) -> Value:
    example = v.concrete()
    field = getattr(example, name, _MISSING)
    for item, concrete in zip(v.items, example):
        if concrete is field:
            return item
    raise Unsupported("exception_handling", f"{v.cls.__name__} has no field {name!r}")


def _object_attr(tracer, frame, v: ObjV, name: str) -> Value:
    obj = v.obj
    written = tracer.heap.read_attr(obj, name)
    if written is DELETED:
        raise Unsupported("exception_handling", f"AttributeError: {name!r} was deleted in this call")
    if written is not None:
        return written
    if isinstance(obj, types.ModuleType):
        try:
            attr = getattr(obj, name)
        except AttributeError as e:
            raise Unsupported("exception_handling", f"AttributeError: {e}") from None
        trusted = is_trusted_module(obj)
        if trusted and callable(attr) and _root(obj) == "torch":  # F.linear, torch.relu
            guard_lookup(tracer, obj, name)
        return tracer.wrap(attr, None if trusted or v.source is None else AttrSource(v.source, name))
    if isinstance(obj, type):
        try:
            attr = getattr(obj, name)
        except AttributeError as e:
            raise Unsupported("exception_handling", f"AttributeError: {e}") from None
        source = _source(v, name, trusted_owner=obj)
        if source is None and callable(attr) and _root(obj) == "torch":  # nn.Linear.forward
            guard_lookup(tracer, obj, name)
        return tracer.wrap(attr, source)
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        if name in ("__name__", "__qualname__", "__module__", "__doc__"):
            return ConstV(getattr(obj, name))
        raise Unsupported("unsupported_call", f"reading {name!r} of a function")
    return _instance_attr(tracer, v, name)


def _root(owner) -> str:
    name = owner.__name__ if isinstance(owner, types.ModuleType) else getattr(owner, "__module__", "")
    return (name or "").split(".")[0]


def _source(v: ObjV, name: str, trusted_owner=None):
    if v.source is None:
        return None
    if trusted_owner is not None and getattr(trusted_owner, "__module__", "").split(".")[0] == "torch":
        return None
    return AttrSource(v.source, name)


def _instance_attr(tracer, v: ObjV, name: str) -> Value:
    obj = v.obj
    cls = type(obj)
    if name in ("step", "zero_grad"):
        if MODELS.optim_is_modelled(obj, name):
            return MethodV(v, None, name)  # captured by optim_model, not inlined
        if isinstance(obj, torch.optim.LBFGS) and name == "step":
            raise Unsupported("unsupported_call", "LBFGS.step(closure) is not captured: it calls "
                              "the closure (forward and backward) a number of times that depends "
                              "on the loss values (line search, convergence tests)")
        if isinstance(obj, torch.optim.Optimizer):
            raise Unsupported("unsupported_call", f"{cls.__name__}.{name}() is not captured "
                              f"(captured optimizers: {MODELS.captured_optimizer_names()})")
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and name == "step":
            raise Unsupported("unsupported_call", "an LR scheduler's step() inside the optimized "
                              "function is not captured; call it between calls (the learning "
                              "rate is a graph input: no recompile)")
    if "__getattribute__" in _own_dicts(cls) and cls.__getattribute__ is not object.__getattribute__ \
            and not isinstance(obj, nn.Module):
        raise Unsupported("unsupported_call", f"{cls.__name__} defines __getattribute__")
    static = inspect.getattr_static(cls, name, _MISSING)
    if isinstance(obj, nn.Module) and name not in obj.__dict__:
        if MODELS.module_method_is_modelled(obj, name):
            return MethodV(v, None, name)
    if static is not _MISSING and _is_data_descriptor(static):
        if isinstance(static, property) and static.fget is not None:
            from .calls import call
            return call(tracer, tracer.wrap(static.fget, None), [v], {})
        try:
            return tracer.wrap(getattr(obj, name), _source(v, name))
        except AttributeError as e:
            raise Unsupported("exception_handling", f"AttributeError: {e}") from None
    inst = getattr(obj, "__dict__", {})
    if name in inst:
        return tracer.wrap(inst[name], _source(v, name))
    if static is not _MISSING:
        if isinstance(static, staticmethod):
            return tracer.wrap(static.__func__, None)
        if isinstance(static, classmethod):
            return MethodV(ObjV(cls), tracer.wrap(static.__func__, None), name)
        if isinstance(static, types.FunctionType):
            # with its source, the method's code and defaults are guarded like a helper's
            return MethodV(v, tracer.wrap(static, guard_method_lookup(tracer, v, name)), name)
        if callable(static) and not isinstance(static, type):
            return MethodV(v, None, name)
        return tracer.wrap(static, _source(v, name))
    if isinstance(obj, nn.Module):  # what nn.Module.__getattr__ finds, read directly
        for table in ("_parameters", "_buffers", "_modules"):
            entries = inst.get(table)
            if entries is not None and name in entries:
                src = None if v.source is None else ModuleDictSource(v.source, table, name)
                return tracer.wrap(entries[name], src)
    if hasattr(cls, "__getattr__") and not isinstance(obj, nn.Module):
        raise Unsupported("unsupported_call", f"{cls.__name__}.__getattr__ for {name!r}")
    raise missing_attribute(tracer, v, name)


def store_attr(tracer, owner: Value, name: str, value: Value | None) -> None:
    """``owner.name = value`` (``value`` None: ``del owner.name``). Objects created in this
    call are plain values; writes to objects that existed before go to the shadow heap."""
    if isinstance(owner, rolled_objects.RowV):  # unrolled, the write goes to the shadow heap
        owner.loop.refuse(f"its body writes `{name}` of an item of {owner.of.source}")
    if isinstance(owner, NewObjV):
        MODELS.refuse_frozen_write(owner, name)
        problem = MODELS.slot_write_problem(owner.cls, name)
        if problem:
            raise Unsupported("exception_handling", problem)
        if value is not None:
            owner.attrs[name] = value
        elif owner.attrs.pop(name, None) is None:
            raise Unsupported("exception_handling", f"AttributeError: {name}")
        return
    if isinstance(owner, TensorV) and name == "grad":
        MODELS.write_grad(tracer, owner, value)
        return
    if isinstance(owner, TensorV):
        raise Unsupported("side_effect", f"assigning tensor attribute `.{name}` (e.g. "
                          f"`x.{name} = ...`) is not captured",
                          "Use the method form (x.requires_grad_()) or assign it outside the "
                          "optimized function." if name == "requires_grad" else None)
    if not isinstance(owner, ObjV) or owner.source is None:
        raise Unsupported("side_effect", f"assigning attribute {name!r} on a "
                          f"{owner.python_type().__name__} object that cannot be addressed after "
                          "the call")
    obj = owner.obj
    cls = type(obj)
    static = inspect.getattr_static(cls, name, _MISSING)
    if isinstance(obj, nn.Module) and name not in obj.__dict__:
        if MODELS.module_method_is_modelled(obj, name):
            raise Unsupported("side_effect", f"assigning {name!r} on a {cls.__name__} hides "
                              f"nn.Module.{name}, which calls inside the optimized function "
                              "are modelled on", "Assign it outside the optimized function.")
    if static is not _MISSING and _is_data_descriptor(static):
        raise Unsupported("side_effect", f"{cls.__name__}.{name} is a property/descriptor; "
                          "assigning it runs code")
    # (shadow_heap/checks.py checks the same conditions again before the commit writes)
    if isinstance(obj, nn.Module) and (name in obj._buffers or name in obj._parameters):
        if registration_hooks():  # Module.__setattr__ runs them; they may replace the value
            raise Unsupported("module_hooks", "global buffer/parameter registration hooks are "
                              f"registered (assigning {name!r} of a {cls.__name__} runs them)")
        tracer.add_guard(NoRegistrationHooksGuard, None)
    if isinstance(obj, nn.Module):
        if cls.__setattr__ is not nn.Module.__setattr__ or cls.__delattr__ is not nn.Module.__delattr__:
            raise Unsupported("side_effect", f"{cls.__name__} defines __setattr__/__delattr__")
        if name in obj._modules or (isinstance(value, ObjV) and isinstance(value.obj, nn.Module)):
            raise Unsupported("side_effect", f"assigning submodule {name!r} inside forward")
        if name in obj._parameters and not (
                (isinstance(value, ConstV) and value.value is None)
                or (isinstance(value, (ObjV, TensorV)) and isinstance(value.concrete(), nn.Parameter))):
            raise Unsupported("exception_handling",
                              f"TypeError: cannot assign a non-Parameter to parameter {name!r}")
        if name in obj._buffers and value is not None and not isinstance(value, TensorV) \
                and not (isinstance(value, ConstV) and value.value is None):
            raise Unsupported("exception_handling",
                              f"TypeError: cannot assign a non-tensor to buffer {name!r}")
    elif not isinstance(obj, (type, types.ModuleType)) and (
            cls.__setattr__ is not object.__setattr__ or cls.__delattr__ is not object.__delattr__):
        raise Unsupported("side_effect", f"{cls.__name__} defines __setattr__/__delattr__")
    if not hasattr(obj, "__dict__"):  # (its slots are descriptors, refused above)
        raise Unsupported("exception_handling", f"AttributeError: {cls.__name__!r} object has "
                          f"no attribute {name!r} (it has no __dict__)")
    where = tracer.where()
    if value is None:
        if tracer.heap.read_attr(obj, name) is None and not _stored_on(obj, name):
            raise Unsupported("exception_handling", f"AttributeError: {name}")
        tracer.heap.delete_attr(owner, obj, name, where)
    else:
        tracer.heap.write_attr(owner, obj, name, value, where)


def _stored_on(obj, name: str) -> bool:
    """Whether ``del obj.name`` finds ``name`` on the object itself (not its class)."""
    if isinstance(obj, nn.Module) and any(name in obj.__dict__.get(t, ()) for t in (
            "_parameters", "_buffers", "_modules")):
        return True
    return name in getattr(obj, "__dict__", {})


def _super_attr(tracer, v: SuperV, name: str) -> Value:
    mro = v.self_value.python_type().__mro__  # (an object made in the call has no concrete one)
    start = mro.index(v.cls) + 1
    if start < len(mro) and mro[start].__mro__ == mro[start:]:  # resolved as the class would
        guard_lookup(tracer, mro[start], name)
    for klass in mro[start:]:
        if name in klass.__dict__:
            attr = klass.__dict__[name]
            if isinstance(attr, staticmethod):
                return tracer.wrap(attr.__func__, None)
            if isinstance(attr, classmethod):
                return MethodV(ObjV(v.self_value.python_type()), tracer.wrap(attr.__func__, None), name)
            if isinstance(attr, types.FunctionType):
                return MethodV(v.self_value, tracer.wrap(attr, None), name)
            if callable(attr):
                return MethodV(v.self_value, ObjV(attr), name)
            return tracer.wrap(attr, None)
    raise Unsupported("exception_handling", f"super() has no attribute {name!r}")


def _new_object_attr(tracer, v: NewObjV, name: str) -> Value:
    static = inspect.getattr_static(v.cls, name, _MISSING)
    if name == "__class__":
        return ObjV(v.cls)
    if name == "__dict__" and "__dict__" not in v.attrs:  # the very attribute table
        return DictV(v.attrs)
    if isinstance(static, types.MemberDescriptorType) and name not in v.attrs:
        raise Unsupported("exception_handling", f"AttributeError: {name}")  # an unset slot
    if static is not _MISSING and _is_data_descriptor(static) and not isinstance(
            static, types.MemberDescriptorType):  # (a slot's value is in attrs)
        if isinstance(static, property) and static.fget is not None:
            from .calls import call
            return call(tracer, tracer.wrap(static.fget, None), [v], {})
        raise Unsupported("unsupported_call", f"descriptor {name!r} of {v.cls.__name__}")
    if name in v.attrs:
        return v.attrs[name]
    if static is _MISSING:
        raise Unsupported("exception_handling", f"{v.cls.__name__!r} object has no attribute {name!r}")
    if isinstance(static, staticmethod):
        return tracer.wrap(static.__func__, None)
    if isinstance(static, classmethod):
        return MethodV(ObjV(v.cls), tracer.wrap(static.__func__, None), name)
    if isinstance(static, types.FunctionType):
        return MethodV(v, tracer.wrap(static, None), name)
    getter = getattr(type(static), "__get__", None)
    if isinstance(getter, types.FunctionType):  # a Python descriptor (torch's lazy_property)
        from .calls import call
        return call(tracer, tracer.wrap(getter, None), [ObjV(static), v, ObjV(v.cls)], {})
    if v.cls_source is None and _root(v.cls) == "torch":  # Distribution._validate_args
        guard_lookup(tracer, v.cls, name)
    source = None if v.cls_source is None else AttrSource(v.cls_source, name)
    return tracer.wrap(static, source)


def _own_dicts(cls) -> set:
    names = set()
    for klass in cls.__mro__[:-1]:
        names.update(klass.__dict__)
    return names


def _is_data_descriptor(attr) -> bool:
    t = type(attr)
    return hasattr(t, "__get__") and (hasattr(t, "__set__") or hasattr(t, "__delete__"))
