"""The public entry points: ``optimize``, ``explain``, ``reset``."""
from __future__ import annotations

import copy
import functools
import types
import weakref
from typing import Any

import torch
import torch.nn as nn

from . import dispatch, frames
from . import eager_run as eager_run_module
from .eager_run import EagerRun, sync_limit
from .config import ConfigError, backend_error, config, load_environment
from .explain import Explanation, explain_state
from .fx_lower import get_backend, list_backends
from .fx_lower._torch_compilers import torch_compile_original
from .symbolic.calls import MODULE_FORWARD_ATTR, ORIGINAL_ATTR


def _wire_frames() -> None:
    """frames/ calls down into the dispatcher and the eager path; they reach the hook back only
    through what is installed here, so neither imports the layer above it."""
    frames.set_dispatcher(dispatch.dispatch)
    frames.set_run_here(EagerRun)
    eager_run_module.install_frame_hook(frames.hook_active, frames.auto_targeting)


_wire_frames()


def optimize(obj: Any = None, *, backend: str | None = None, exact: bool = False) -> Any:
    """Run ``obj`` as optimized graphs; results always equal eager PyTorch.

    * a function (or ``@specularch.optimize`` / ``@specularch.optimize(backend=...)``):
      returns a wrapper with the same signature;
    * a bound method: returns an optimized callable bound to the same object;
    * an ``nn.Module``: optimizes its ``forward`` *in place* and returns the same module
      (state_dict keys, ``isinstance`` and hooks are unchanged). ``torch.save(module)`` and
      ``pickle`` save it as the plain module (it loads where specularch is not installed,
      with ``weights_only=True`` under the same ``safe_globals`` as the plain module);
      ``copy.deepcopy`` returns a copy optimized too, with its own cache; ``copy.copy`` a
      plain one (see ``OptimizedForward``).

    ``backend`` names a registered backend (``specularch.list_backends()``); by default
    ``config.backend`` (``SPECULARCH_BACKEND``, default ``"auto"``: tiered, each graph starts
    on ``fx`` and a hot one moves to the fastest compiling backend, measured; equal to eager
    within float rounding). ``exact=True``: bit-identical to eager (``fx``, and recursion
    templates and rolled loops in eager's order); it cannot be combined with another backend.
    """
    if obj is None:
        return functools.partial(optimize, backend=backend, exact=exact)
    if exact:
        if backend not in (None, "fx"):
            raise ValueError(f"specularch.optimize(exact=True) runs with backend 'fx' (the "
                             f"same kernels as eager); backend={backend!r} cannot be exact")
        backend = "fx"
    try:
        _check_configuration(backend)
    except ConfigError as e:  # the user's line is what matters, not config.py's frames
        raise e.with_traceback(None) from None
    if backend is not None:
        get_backend(backend)
    refusal = _compiled_by_torch(obj)
    if refusal is not None:
        raise TypeError(refusal)
    if isinstance(obj, nn.Module):
        return _optimize_module(obj, backend, exact)
    if isinstance(obj, types.MethodType):
        wrapper = _optimize_function(obj.__func__, backend, exact)
        return types.MethodType(wrapper, obj.__self__)
    if isinstance(obj, types.FunctionType):
        return _optimize_function(obj, backend, exact)
    raise TypeError(f"specularch.optimize expects an nn.Module, a Python function or a bound "
                    f"method, got {type(obj).__qualname__}. Wrap the call in a Python function "
                    f"and optimize that.")


def _compiled_by_torch(obj: Any) -> str | None:
    """Why ``obj`` cannot be optimized when torch.jit or torch.compile made it (it runs
    TorchScript or Dynamo's code, not Python specularch can capture), saying what to pass."""
    name = type(obj).__qualname__
    if isinstance(obj, torch.jit.ScriptModule):
        maker = "torch.jit.trace" if isinstance(obj, torch.jit.TracedModule) else "torch.jit.script"
        return _refusal(f"a TorchScript module ({name}, made by {maker})", "TorchScript",
                        "nn.Module", "model", f"{maker}(model)")
    if isinstance(obj, torch.jit.ScriptFunction):
        return _refusal(f"a TorchScript function ({name}, made by torch.jit.script or "
                        f"torch.jit.trace)", "TorchScript", "Python function", "fn",
                        "torch.jit.script(fn)")
    if torch_compile_original(obj) is not None:
        module = isinstance(obj, nn.Module)
        arg = "model" if module else "fn"
        return _refusal(f"a {'module' if module else 'function'} made by torch.compile ({name})",
                        "torch.compile's compiled code", "nn.Module" if module else
                        "Python function", arg, f"torch.compile({arg})")
    return None


def _refusal(what: str, runs: str, original: str, arg: str, call: str) -> str:
    return (f"specularch.optimize cannot optimize {what}: it runs {runs}, not Python that "
            f"specularch can capture. Pass the original {original} instead: "
            f"specularch.optimize({arg}), not specularch.optimize({call}).")


def _check_configuration(backend: str | None) -> None:
    """Every ``SPECULARCH_*`` variable is read at the first ``optimize()`` (a bad one is a
    ``ConfigError`` here, not in some later call), and ``SPECULARCH_BACKEND`` must name a
    registered backend (a name assigned from Python was checked when it was set)."""
    load_environment()
    if backend is None and config.backend not in list_backends():
        raise ConfigError(backend_error(config.backend, list_backends()))


def _optimize_function(fn: types.FunctionType, backend: str | None, exact: bool = False):
    original = getattr(fn, ORIGINAL_ATTR, None)
    if original is not None:  # already optimized: re-target the backend only
        fn = original
    target = frames.register(fn)
    state = dispatch.new_state(target, backend, exact)
    binder = target.binder_for(fn) if not target.is_generator else None
    closure = fn.__closure__
    code = fn.__code__
    start = dispatch.start

    if target.is_generator:
        @functools.wraps(fn)
        def generator_wrapper(*args, **kwargs):
            dispatch.note_generator(state)
            return fn(*args, **kwargs)
        setattr(generator_wrapper, ORIGINAL_ATTR, fn)
        generator_wrapper.__specularch_state__ = state
        return generator_wrapper

    shadow = target.shadow_for(fn)  # the original bytecode, not intercepted again
    eager_run, extra = EagerRun, eager_run_module.EXTRA

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # Python reads ``fn``'s defaults and code at each call: ``__defaults__``,
        # ``__kwdefaults__`` or ``__code__`` assigned after ``optimize`` must be seen.
        if (binder.__defaults__ is not fn.__defaults__ or fn.__code__ is not code
                or binder.__kwdefaults__ is not fn.__kwdefaults__):
            if fn.__code__ is not code:  # not the code that was optimized: run it as it is
                return fn(*args, **kwargs)
            target.binder_for(fn)  # copies the current defaults onto ``binder``
            shadow.__defaults__, shadow.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
        # No hook on the hot path: a graph runs no user Python. A call that runs eagerly
        # runs here, hook on (nested optimized calls are seen), one frame below this one:
        # a recursive function that runs eagerly nests two frames per level, not seven.
        result = start(state, binder(*args, **kwargs), closure)
        if type(result) is eager_run:  # written out: see EagerRun for why each step
            with result:
                extra[0] += 1
                try:
                    sync_limit()
                    return result.done(shadow(*args, **kwargs))
                finally:
                    extra[0] -= 1
        return result

    setattr(wrapper, ORIGINAL_ATTR, fn)
    wrapper.__specularch_target__ = target
    wrapper.__specularch_state__ = state
    return wrapper


def _optimize_module(module: nn.Module, backend: str | None, exact: bool = False) -> nn.Module:
    patched = module.__dict__.get("forward")
    if isinstance(patched, types.MethodType) and patched.__self__ is module \
            and isinstance(patched.__func__, types.FunctionType):
        # ``module.forward`` set on the instance (accelerate's hooks do): what eager calls
        module.__dict__["forward"] = types.MethodType(
            _optimize_function(patched.__func__, backend, exact), module)
        return module
    if patched is not None and not isinstance(patched, OptimizedForward):
        raise TypeError(f"{type(module).__qualname__}.forward was replaced on the instance by "
                        f"{patched!r}, which is not a method of it; optimize the module before "
                        "replacing forward, or optimize the function itself")
    forward = type(module).forward
    if not isinstance(forward, types.FunctionType):
        raise TypeError(f"{type(module).__qualname__}.forward is not a Python function; "
                        f"specularch can only optimize Python forward methods")
    target = frames.register(forward)
    _MODULE_STATES[module] = dispatch.new_state(target, backend, exact)
    dispatch.per_instance(target, _instance_state)
    OptimizedForward(module).install()
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
        exact = state.exact if state is not None else False
        target = frames.register(forward)
        state = _MODULE_STATES[module] = dispatch.new_state(target, backend, exact)
        dispatch.per_instance(target, _instance_state)  # (e.g. a module just unpickled)
    return state


def _module_forward(self, *args, **kwargs):
    state = _module_state(self)
    forward = type(self).forward
    return dispatch.run(state, state.target.binder_for(forward)(self, *args, **kwargs),
                          forward.__closure__)


class OptimizedForward:
    """``module.forward`` of an optimized module instance, set in the instance's ``__dict__``
    with two companions that keep specularch out of copies that leave the process:

    * ``module.__getstate__`` (what ``pickle``, ``torch.save`` and ``copy.copy`` use): the
      class's own state without these three entries, so the saved module is the plain
      module: its file names no specularch class and loads as a plain module;
    * ``module.__deepcopy__``: the copy is built from that plain state and optimized again
      (same backend, a fresh cache): an in-process copy (an EMA teacher, ``AveragedModel``)
      runs as fast as the original.
    """

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def install(self) -> None:
        d = self.module.__dict__
        d["forward"], d["__getstate__"], d["__deepcopy__"] = self, self.plain_state, self.deepcopy

    def _installed(self, value) -> bool:
        return value is self or getattr(value, "__self__", None) is self

    def plain_state(self):
        """The state the module's class pickles, without what ``optimize`` added."""
        state = type(self.module).__getstate__(self.module)
        if isinstance(state, dict):
            state = {k: v for k, v in state.items() if not self._installed(v)}
        return state

    def deepcopy(self, memo: dict) -> nn.Module:
        module, cls = self.module, type(self.module)
        state = _MODULE_STATES.get(module)
        if hasattr(cls, "__deepcopy__"):  # the class copies itself: let it, then re-optimize
            twin = cls.__deepcopy__(module, memo)
        else:  # what copy.deepcopy does for a plain module (``copyreg.__newobj__`` + state)
            twin = memo[id(module)] = cls.__new__(cls)
            plain = copy.deepcopy(self.plain_state(), memo)
            if hasattr(twin, "__setstate__"):
                twin.__setstate__(plain)
            else:
                twin.__dict__.update(plain)
        return _optimize_module(twin, state.backend if state is not None else None,
                                state is not None and state.exact)

    def __call__(self, *args, **kwargs):
        return _module_forward(self.module, *args, **kwargs)

    def __reduce__(self):
        # Reached only when a class pickles its ``__dict__`` without ``__getstate__``: the
        # plain bound forward, looked up again when the module is loaded.
        return getattr, (self.module, "forward")

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
    return next((s for s in list(dispatch.states().values()) if s.target.code is code), None)


def _state_of(obj: Any):
    """The cache behind an optimized module or what ``optimize`` returned for a function
    (or, for code reached only through the frame hook, its code object's shared cache).
    Something never optimized is a ``TypeError`` (not an empty report)."""
    if isinstance(obj, nn.Module):
        patched = getattr(obj.__dict__.get("forward"), "__func__", None)  # (_optimize_module)
        if obj not in _MODULE_STATES and hasattr(patched, "__specularch_state__"):
            return patched.__specularch_state__
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


def explain(obj: Any, *, verbose: bool = False) -> Explanation:
    """A report (dataclass) of the graphs, guards, fallbacks, recompiles and stats of ``obj``.

    ``print(explain(obj))`` is a short summary: per graph its backend, runs, capture and
    compile time and the *number* of inputs and guards, then every fallback and recompile with
    its reason and ``file:line``. ``print(explain(obj, verbose=True))`` also lists each graph's
    inputs, guards and generated code. Either way the report's attributes hold everything:
    ``report.graphs[i].guards``, ``.code``, ``.inputs``; ``report.fallbacks``, ``.recompiles``.
    """
    return explain_state(_state_of(obj), verbose)


def reset() -> None:
    """Forget every graph, guard, record and statistic (optimized objects stay optimized)."""
    dispatch.reset()
    from .templates import family
    family.reset()
