"""Calls: what ``f(*args, **kwargs)`` means for each kind of callee value.

* Python functions, methods, lambdas, ``super()`` methods and ``nn.Module`` calls (forward)
  are *inlined*: their bytecode runs in a new symbolic frame.
* torch functions, ``torch.nn.functional`` and Tensor methods become graph nodes.
* builtins, ``math`` and constant methods are modelled in ``builtins_model.py``.
* everything else is ``Unsupported`` (the call runs eagerly).
"""
from __future__ import annotations

import functools
import os
import types
import weakref

import torch
import torch.nn as nn

from ..guards import DictKeysGuard, IdGuard, LenGuard, ValueGuard
from ..guards.sources import AttrSource, ClosureSource, DerefSource, ItemSource
from ..records import Unsupported
from . import hooks
from .bytecode import CO_VARARGS, CO_VARKEYWORDS
from ._torch_dispatch import is_tensor_class
from .exceptions import PyRaise, leaving_generator
from .library_files import is_torch_file
from .lookup_guards import guard_lookup, guard_method_lookup, guard_module_call
from .models import MODELS
from .tracer import FORBIDDEN_TENSOR_METHODS
from .values import (CellV, CtxExitV, DictV, FuncV, IterV, MethodV, ModuleSliceV, NewObjV, ObjV, PartialV, TupleV,
                     Value)
from .bytecode import analyse
from .frame import Frame
from ._torch_dispatch import custom_op_overload

# Set on wrappers made by specularch.optimize: the function they stand for.
ORIGINAL_ATTR = "__specularch_original__"
# Set on the forward that optimize(module) installs on the instance.
MODULE_FORWARD_ATTR = "__specularch_module_forward__"

_AUTOGRAD_ENTRY = {torch.autograd.backward, torch.autograd.grad}


def call(tracer, fn: Value, args: list[Value], kwargs: dict[str, Value]) -> Value:
    if isinstance(fn, MethodV):
        if fn.func is not None:
            return call(tracer, fn.func, [fn.self_value, *args], kwargs)
        return MODELS.call_method(tracer, fn.self_value, fn.name, args, kwargs)
    if isinstance(fn, FuncV):
        return inline(tracer, fn.code, fn.globals, args, kwargs, defaults=fn.defaults,
                      kwdefaults=fn.kwdefaults, closure=fn.closure, name=fn.name)
    if isinstance(fn, PartialV):
        return call(tracer, fn.func, [*fn.args, *args], {**fn.kwargs, **kwargs})
    if isinstance(fn, ModuleSliceV) and fn.callable and len(args) == 1 and not kwargs:
        out = args[0]
        for child in fn.items:  # Sequential.forward over the sliced children
            out = call(tracer, child, [out], {})
        return out
    if isinstance(fn, NewObjV):
        from .attrs import load_attr
        return call(tracer, load_attr(tracer, None, fn, "__call__"), args, kwargs)
    if isinstance(fn, CtxExitV):
        return MODELS.exit_context(tracer, fn.ctx)
    if isinstance(fn, ObjV):
        return _call_object(tracer, fn, args, kwargs)
    raise Unsupported("unsupported_call", f"calling {fn!r}")


def _call_object(tracer, fn: ObjV, args, kwargs) -> Value:
    obj = fn.obj
    original = getattr(obj, ORIGINAL_ATTR, None)
    if original is not None:
        return call(tracer, tracer.wrap(original, None), args, kwargs)
    if isinstance(obj, nn.Module):
        return call_module(tracer, fn, args, kwargs)
    handler = MODELS.BUILTINS.get(obj) if _hashable(obj) else None
    if handler is not None:
        return handler(tracer, obj, args, kwargs)
    if obj in _AUTOGRAD_ENTRY if _hashable(obj) else False:
        raise Unsupported("unsupported_call", "autograd (.backward()/autograd.grad) inside an "
                          "optimized function is not captured yet")
    if isinstance(obj, types.FunctionType):
        if is_torch_file(obj.__code__.co_filename) and not _is_module_code(obj):
            return _torch_python_function(tracer, fn, args, kwargs)
        return inline_function(tracer, fn, args, kwargs)
    if isinstance(obj, functools.partial):
        src = fn.source
        func = tracer.wrap(obj.func, None if src is None else AttrSource(src, "func"))
        bound = [tracer.wrap(a, None if src is None else ItemSource(AttrSource(src, "args"), i))
                 for i, a in enumerate(obj.args)]
        kw = {k: tracer.wrap(a, None if src is None else ItemSource(AttrSource(src, "keywords"), k))
              for k, a in obj.keywords.items()}
        return call(tracer, func, [*bound, *args], {**kw, **kwargs})
    if isinstance(obj, weakref.ReferenceType) and not args and not kwargs:
        referent = obj()
        return tracer.wrap(referent, None if fn.source is None else DerefSource(fn.source))
    overload = custom_op_overload(obj)
    if overload is not None:  # a custom_op: its operator is the graph node
        return torch_call(tracer, overload, args, kwargs)
    if _is_torch_callable(obj):
        return torch_call(tracer, obj, args, kwargs)
    if not isinstance(obj, type) and isinstance(getattr(type(obj), "__call__", None), types.FunctionType):
        return call(tracer, MethodV(fn, tracer.wrap(type(obj).__call__, None), "__call__"), args, kwargs)
    return MODELS.call_builtin_like(tracer, fn, args, kwargs)


_NN_MODULES_DIR = os.path.join(os.path.dirname(torch.__file__), "nn", "modules") + os.sep


def _is_module_code(func) -> bool:
    """Methods of torch.nn modules (forward, _conv_forward, ModuleDict.items, ...) and the
    code of torch.distributions are inlined like user code; other torch Python functions
    are graph nodes."""
    filename = func.__code__.co_filename
    return filename.startswith(_NN_MODULES_DIR) or MODELS.is_distributions_code(filename)


def _hashable(obj) -> bool:
    try:
        hash(obj)
        return True
    except TypeError:
        return False


def _is_torch_callable(obj) -> bool:
    module = getattr(obj, "__module__", None) or ""
    if module.split(".")[0] == "torch":
        return True
    owner = getattr(obj, "__objclass__", None)
    return owner is not None and is_tensor_class(owner)


def torch_call(tracer, obj, args, kwargs) -> Value:
    """A torch function (C or Python) applied to values: one graph node."""
    if isinstance(obj, type):
        return MODELS.construct_torch_class(tracer, obj, args, kwargs)
    name = getattr(obj, "__name__", "")
    if name in FORBIDDEN_TENSOR_METHODS:
        raise Unsupported("data_dependent_value" if name != "backward" else "unsupported_call",
                          f"torch.{name} reads tensor data or changes autograd state")
    effect = outside_effect(obj, name)
    if effect:
        raise Unsupported("unsupported_call", f"{getattr(obj, '__module__', 'torch')}.{name} "
                          f"{effect}; a graph cannot replay that, so the call runs eagerly")
    return tracer.call_op("call_function", obj, args, kwargs, name=name)


# torch functions that act outside the tensors they are given: captured, they would run once
# (during capture) instead of on every call. Checked before the call runs.
_EFFECT_MODULES = {"torch.random": "changes or reads the global random-number state",
                   "torch.cuda.random": "changes or reads the CUDA random-number state",
                   "torch.serialization": "reads or writes files",
                   "torch.hub": "downloads or reads files",
                   "torch.utils.data": "drives data loading",
                   "torch.distributed": "communicates with other processes",
                   "torch.profiler": "controls the profiler",
                   "torch.autograd.profiler": "controls the profiler"}
_EFFECT_NAMES = {"manual_seed": "changes the random-number state",
                 "seed": "changes the random-number state",
                 "initial_seed": "reads the random-number state",
                 "save": "writes a file", "load": "reads a file",
                 "use_deterministic_algorithms": "changes a global setting",
                 "synchronize": "waits for a device"}


def outside_effect(obj, name: str) -> str:
    """Why calling torch function ``obj`` acts outside its tensor arguments ('' if it does
    not, as far as we know)."""
    module = getattr(obj, "__module__", None) or ""
    for prefix, why in _EFFECT_MODULES.items():
        if module == prefix or module.startswith(prefix + "."):
            return why
    if name in _EFFECT_NAMES:
        return _EFFECT_NAMES[name]
    if name.startswith(("set_", "_set_")):
        return "changes a global setting"
    return ""


def _grad_mode_decorator(obj):
    """For a function decorated with ``@torch.no_grad()``, ``@torch.enable_grad()``,
    ``@torch.set_grad_enabled(b)`` or ``@torch.inference_mode(b)``: the context it runs its
    function in (a ``GradModeV``); None for anything else."""
    if obj.__code__.co_name != "decorate_context" or "ctx_factory" not in obj.__code__.co_freevars:
        return None
    factory = obj.__closure__[obj.__code__.co_freevars.index("ctx_factory")].cell_contents
    owner = getattr(factory, "__self__", None)  # ``no_grad().clone``: not called (no effects)
    return MODELS.grad_decorator_context(owner)


def _torch_python_function(tracer, fn: ObjV, args, kwargs) -> Value:
    obj = fn.obj
    ctx = _grad_mode_decorator(obj) if hasattr(obj, "__wrapped__") else None
    if ctx is not None:
        MODELS.grad_mode_enter(tracer, ctx)
        inner = tracer.wrap(obj.__wrapped__, None if fn.source is None
                            else AttrSource(fn.source, "__wrapped__"))
        try:
            result = call(tracer, inner, args, kwargs)
        except Unsupported as e:
            # an inference block is left by the capture's own unwinding, unless the code
            # catches this exception (a Python-level raise) and goes on
            if not ctx.inference or isinstance(e, PyRaise):
                MODELS.grad_mode_exit(tracer, ctx)
            raise
        MODELS.grad_mode_exit(tracer, ctx)
        return result
    if hasattr(obj, "__wrapped__"):
        raise Unsupported("unsupported_call",
                          f"{obj.__qualname__} wraps another function (a decorator from torch)")
    held = [a for a in [*args, *kwargs.values()] if _graph_cannot_hold(a)]
    for a in held:  # torch's higher-order functions (checkpoint, vmap, jacobian, tree_map)
        if isinstance(a, (FuncV, MethodV)) or callable(a.obj):  # change how theirs runs
            raise Unsupported("unsupported_call",
                              f"{obj.__module__}.{obj.__qualname__} called with a {a!r} argument")
    if held:
        # a graph node's arguments must be graph values; given a plain data object (an
        # options object) the function runs as Python instead, like user code: the object's
        # attribute reads are guarded and what it calls is captured or refused one by one
        return inline_function(tracer, fn, args, kwargs)
    if MODELS.returns_metadata(tracer, obj, args, kwargs):
        return inline_function(tracer, fn, args, kwargs)
    return torch_call(tracer, obj, args, kwargs)


def _graph_cannot_hold(value: Value) -> bool:
    return (isinstance(value, (ObjV, FuncV, MethodV))
            and not isinstance(getattr(value, "obj", None), torch.Generator))


def call_module(tracer, mod: ObjV, args, kwargs) -> Value:
    m = mod.obj
    guard_module_call(tracer, mod)
    _guard_call_path(tracer, type(m))
    forward = m.__dict__.get("forward")
    if forward is not None and not getattr(forward, MODULE_FORWARD_ATTR, False):
        raise Unsupported("unsupported_call", f"{type(m).__name__} has an instance-level forward")
    func = type(m).forward
    if not isinstance(func, types.FunctionType):
        raise Unsupported("unsupported_call", f"{type(m).__name__}.forward is not a Python function")
    fn = ObjV(func)
    if forward is None:  # an instance-level forward patched in later must be seen
        source = guard_method_lookup(tracer, mod, "forward")
        if source is not None:  # its code and defaults are guarded too
            fn = ObjV(func, source)
    return inline_function(tracer, fn, [mod, *args], kwargs)


_MODULE_PY = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py")


def _guard_call_path(tracer, cls: type) -> None:
    """``m(x)`` is captured as ``forward`` (hooks are guarded apart) only while ``__call__``
    and ``_call_impl`` are nn.Module's own; a class overriding them, or a patch (a profiler
    wrapping ``nn.Module.__call__``) runs code of its own: the call runs eagerly."""
    for name in ("__call__", "_call_impl"):
        code = getattr(getattr(cls, name, None), "__code__", None)
        if code is None or code.co_filename != _MODULE_PY:
            raise Unsupported("unsupported_call", f"{cls.__name__}.{name} is not nn.Module's "
                              "own (overridden or patched): calling the module runs it")
        guard_lookup(tracer, cls, name)


def inline_function(tracer, fn: ObjV, args, kwargs, *, frame_only: bool = False) -> Value:
    func = fn.obj
    MODELS.refuse_inlining(func)  # (random.gauss: state the graph would write; python_random.py)
    closure = ()
    if func.__closure__:
        names = func.__code__.co_freevars
        closure = tuple(
            CellV(None, real=cell,
                  source=None if fn.source is None else ClosureSource(fn.source, i, names[i]))
            for i, cell in enumerate(func.__closure__))
        if fn.source is None and any(n != "__class__" for n in names):
            _check_trusted_closure(func)
    if fn.source is not None:
        _guard_code_and_signature(tracer, fn)
    defaults = tuple(tracer.wrap(d, _default_source(fn, "__defaults__", i))
                     for i, d in enumerate(func.__defaults__ or ()))
    kwdefaults = {k: tracer.wrap(d, _default_source(fn, "__kwdefaults__", k))
                  for k, d in (func.__kwdefaults__ or {}).items()}
    return inline(tracer, func.__code__, func.__globals__, args, kwargs, defaults=defaults,
                  kwdefaults=kwdefaults, closure=closure, name=func.__qualname__,
                  frame_only=frame_only)


def _check_trusted_closure(func) -> None:
    # A method found on a class (no source of its own): its closure cannot be re-read at run
    # time, so only cells whose contents are classes or functions (decorator plumbing) are
    # baked in; anything else is refused rather than silently frozen.
    for cell in func.__closure__:
        try:
            contents = cell.cell_contents
        except ValueError:
            continue
        if not isinstance(contents, (type, types.FunctionType, types.BuiltinFunctionType)):
            raise Unsupported("unsupported_call",
                              f"{func.__qualname__} is a closure over values that cannot be guarded")


def _guard_code_and_signature(tracer, fn: ObjV) -> None:
    """Python reads a function's code and defaults at each call: a ``__code__``,
    ``__defaults__`` or ``__kwdefaults__`` assigned after capture must fail a guard (the
    default values themselves are guarded where they are read, by ``_default_source``)."""
    func = fn.obj
    tracer.add_guard(IdGuard, AttrSource(fn.source, "__code__"), func.__code__)
    defaults, kwdefaults = func.__defaults__, func.__kwdefaults__
    if defaults is None:
        tracer.add_guard(ValueGuard, AttrSource(fn.source, "__defaults__"), None)
    else:
        tracer.add_guard(LenGuard, AttrSource(fn.source, "__defaults__"), tuple, len(defaults))
    if kwdefaults is None:
        tracer.add_guard(ValueGuard, AttrSource(fn.source, "__kwdefaults__"), None)
    else:
        tracer.add_guard(DictKeysGuard, AttrSource(fn.source, "__kwdefaults__"), dict,
                         tuple(kwdefaults))


def _default_source(fn: ObjV, table: str, key):
    return None if fn.source is None else ItemSource(AttrSource(fn.source, table), key)


def inline(tracer, code: types.CodeType, globals_: dict, args: list[Value], kwargs: dict[str, Value],
           *, defaults=(), kwdefaults=None, closure=(), name="", frame_only=False) -> Value:
    """Run ``code`` in a new frame; ``frame_only``: the generator frame, not run yet (a
    ``contextmanager`` drives it: ``context_managers.py``)."""
    bound = bind_arguments(code, args, kwargs, defaults, kwdefaults or {}, name)
    if not frame_only and hooks.recursion is not None:
        templated = hooks.recursion(tracer, code, globals_, bound)
        if templated is not None:
            return templated
    cells = {n: c for n, c in zip(code.co_freevars, closure)}
    info = analyse(code)
    if frame_only:
        return Frame(tracer, code, globals_, bound, cells, generator=True)
    if info.is_generator:
        if code.co_name != "<genexpr>":
            raise Unsupported("generator", f"calling generator function {name} inside capture")
        return IterV([], source=_lazily(Frame(tracer, code, globals_, bound, cells, generator=True)))
    return Frame(tracer, code, globals_, bound, cells).run()


def _lazily(frame: Frame):
    """The items of a generator expression, each run when it is asked for, as eager's are:
    names its body reads are read then (late binding), ``any()`` stops pulling at the first
    true one (the rest never runs), and an exception raises where the item is pulled."""
    def resume() -> bool:
        before = len(frame.yielded)
        while frame.result is None and len(frame.yielded) == before:
            frame._step()
        return len(frame.yielded) > before
    while frame.result is None and frame.on_stack(resume, leaving=leaving_generator):
        yield frame.yielded[-1]


def bind_arguments(code, args, kwargs, defaults, kwdefaults, name) -> dict[str, Value]:
    """Python's argument binding, on values. A binding error means eager raises TypeError."""
    def fail(msg):
        raise Unsupported("exception_handling", f"TypeError during capture: {name}() {msg}")
    npos = code.co_argcount
    names = code.co_varnames
    bound: dict[str, Value] = {}
    has_va, has_vk = code.co_flags & CO_VARARGS, code.co_flags & CO_VARKEYWORDS
    if len(args) > npos and not has_va:
        fail(f"takes {npos} positional arguments but {len(args)} were given")
    for n, value in zip(names[:npos], args):
        bound[n] = value
    kwonly = names[npos:npos + code.co_kwonlyargcount]
    extra_kw: dict[str, Value] = {}
    posonly = set(names[:code.co_posonlyargcount])
    for k, value in kwargs.items():
        if k in bound and k not in posonly:
            fail(f"got multiple values for argument {k!r}")
        if (k in names[:npos] and k not in posonly) or k in kwonly:
            bound[k] = value
        elif has_vk:
            extra_kw[k] = value
        else:
            fail(f"got an unexpected keyword argument {k!r}")
    first_default = npos - len(defaults)
    for i, n in enumerate(names[:npos]):
        if n not in bound:
            if i >= first_default:
                bound[n] = defaults[i - first_default]
            else:
                fail(f"missing required positional argument {n!r}")
    for n in kwonly:
        if n not in bound:
            if n in kwdefaults:
                bound[n] = kwdefaults[n]
            else:
                fail(f"missing required keyword-only argument {n!r}")
    idx = npos + code.co_kwonlyargcount
    if has_va:
        bound[names[idx]] = TupleV(list(args[npos:]))
        idx += 1
    if has_vk:
        bound[names[idx]] = DictV(extra_kw)
    return bound
