"""The public entry points: ``optimize``, ``explain``, ``reset``."""
from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import torch.nn as nn

from . import dispatcher, frames
from .explain import Explanation, explain_state
from .fx_lower import get_backend
from .symbolic.calls import MODULE_FORWARD_ATTR, ORIGINAL_ATTR


def optimize(obj: Any = None, *, backend: str | None = None) -> Any:
    """Run ``obj`` as optimized graphs; results always equal eager PyTorch.

    * a function (or ``@specularch.optimize`` / ``@specularch.optimize(backend=...)``):
      returns a wrapper with the same signature;
    * a bound method: returns an optimized callable bound to the same object;
    * an ``nn.Module``: optimizes its ``forward`` *in place* and returns the same module
      (state_dict keys, ``isinstance`` and hooks are unchanged).

    ``backend`` names a registered backend (``specularch.list_backends()``); by default
    ``config.backend`` (``SPECULARCH_BACKEND``, default ``"fx"``).
    """
    if obj is None:
        return functools.partial(optimize, backend=backend)
    if backend is not None:
        get_backend(backend)
    if isinstance(obj, nn.Module):
        return _optimize_module(obj, backend)
    if isinstance(obj, types.MethodType):
        wrapper = _optimize_function(obj.__func__, backend)
        return types.MethodType(wrapper, obj.__self__)
    if isinstance(obj, types.FunctionType):
        return _optimize_function(obj, backend)
    raise TypeError(f"specularch.optimize expects an nn.Module, a Python function or a bound "
                    f"method, got {type(obj).__qualname__}. Wrap the call in a Python function "
                    f"and optimize that.")


def _optimize_function(fn: types.FunctionType, backend: str | None):
    original = getattr(fn, ORIGINAL_ATTR, None)
    if original is not None:  # already optimized: re-target the backend only
        fn = original
    target = frames.register(fn)
    state = dispatcher.new_state(target, backend)
    binder = target.binder_for(fn) if not target.is_generator else None
    closure = fn.__closure__
    code = fn.__code__
    run = dispatcher.run

    if target.is_generator:
        @functools.wraps(fn)
        def generator_wrapper(*args, **kwargs):
            dispatcher.note_generator(state)
            return fn(*args, **kwargs)
        setattr(generator_wrapper, ORIGINAL_ATTR, fn)
        generator_wrapper.__specularch_state__ = state
        return generator_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # Python reads ``fn``'s defaults and code at each call: ``__defaults__``,
        # ``__kwdefaults__`` or ``__code__`` assigned after ``optimize`` must be seen.
        if (binder.__defaults__ is not fn.__defaults__ or fn.__code__ is not code
                or binder.__kwdefaults__ is not fn.__kwdefaults__):
            if fn.__code__ is not code:  # not the code that was optimized: run it as it is
                return fn(*args, **kwargs)
            target.binder_for(fn)  # copies the current defaults onto ``binder``
        # No hook on the hot path: a graph runs no user Python. The dispatcher turns the
        # hook on around the eager fallback, where nested optimized calls must be seen.
        return run(state, binder(*args, **kwargs), closure)

    setattr(wrapper, ORIGINAL_ATTR, fn)
    wrapper.__specularch_target__ = target
    wrapper.__specularch_state__ = state
    return wrapper


def _optimize_module(module: nn.Module, backend: str | None) -> nn.Module:
    forward = type(module).forward
    if not isinstance(forward, types.FunctionType):
        raise TypeError(f"{type(module).__qualname__}.forward is not a Python function; "
                        f"specularch can only optimize Python forward methods")
    target = frames.register(forward)
    _MODULE_STATES[module] = dispatcher.new_state(target, backend)
    dispatcher.per_instance(target, _instance_state)
    module.forward = OptimizedForward(module)
    return module


def _instance_state(obj):
    """The cache of ``obj`` if it is an optimized module instance (frames reached through
    the hook, e.g. a nested optimized module inside an eager fallback), else None."""
    return _MODULE_STATES.get(obj) if isinstance(obj, nn.Module) else None


# Each optimized module instance has its own cache (a deepcopy of one gets a fresh cache).
_MODULE_STATES: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _module_state(module: nn.Module):
    state = _MODULE_STATES.get(module)
    forward = type(module).forward
    if state is None or state.target.code is not forward.__code__:
        backend = state.backend if state is not None else None
        target = frames.register(forward)
        state = _MODULE_STATES[module] = dispatcher.new_state(target, backend)
        dispatcher.per_instance(target, _instance_state)  # (e.g. a module just unpickled)
    return state


def _module_forward(self, *args, **kwargs):
    state = _module_state(self)
    forward = type(self).forward
    return dispatcher.run(state, state.target.binder_for(forward)(self, *args, **kwargs),
                          forward.__closure__)


class OptimizedForward:
    """``module.forward`` of an optimized module instance. A small object rather than a
    bound method so that the module can still be pickled (``torch.save(model)``) and deep-
    copied: the copy is optimized too, with a fresh cache."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return _module_forward(self.module, *args, **kwargs)

    def __reduce__(self):
        return OptimizedForward, (self.module,)

    @property
    def __self__(self):  # like a bound method
        return self.module

    @property
    def __wrapped__(self):  # inspect.signature(module.forward) shows the real signature
        return type(self.module).forward.__get__(self.module)

    @property
    def __name__(self):
        return "forward"

    def __repr__(self):
        return f"<specularch-optimized forward of {type(self.module).__qualname__}>"


setattr(OptimizedForward, MODULE_FORWARD_ATTR, True)


def _shared_state(code):
    """The shared cache of ``code`` if the frame hook (``SPECULARCH=1``) ever reached it."""
    return next((s for s in list(dispatcher.states().values()) if s.target.code is code), None)


def _state_of(obj: Any):
    """The cache behind an optimized module or what ``optimize`` returned for a function
    (or, for code reached only through the frame hook, its code object's shared cache).
    Something never optimized is a ``TypeError`` (not an empty report)."""
    if isinstance(obj, nn.Module):
        if obj not in _MODULE_STATES:
            shared = _shared_state(getattr(type(obj).forward, "__code__", None))
            if shared is None:
                raise TypeError(f"specularch.explain: this {type(obj).__qualname__} was never "
                                f"optimized; call specularch.optimize(module) first")
            return shared
        return _module_state(obj)
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    state = getattr(obj, "__specularch_state__", None)
    if state is not None:
        return state
    if isinstance(obj, types.FunctionType):
        shared = _shared_state(obj.__code__)
        if shared is not None:
            return shared
        raise TypeError(f"specularch.explain: {obj.__qualname__} is not an optimized function; "
                        f"pass the function specularch.optimize() returned")
    raise TypeError(f"specularch.explain expects an optimized nn.Module or what optimize() "
                    f"returned, got {type(obj).__qualname__}")


def _target_of(obj: Any):
    return _state_of(obj).target


def explain(obj: Any) -> Explanation:
    """A report (dataclass) of the graphs, guards, fallbacks, recompiles and stats of ``obj``."""
    return explain_state(_state_of(obj))


def reset() -> None:
    """Forget every graph, guard, record and statistic (optimized objects stay optimized)."""
    dispatcher.reset()
