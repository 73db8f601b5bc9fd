"""Objects of torch's own classes created inside the optimized function.

* ``torch.finfo`` / ``torch.iinfo`` of a dtype: immutable facts about the dtype, constants.
* ``torch.distributions`` classes (distributions, constraints, transforms): plain Python
  classes, modelled like a user's class (``NewObjV``); their ``__init__`` and methods are
  inlined, so argument validation becomes in-graph assumptions (a violating call fails the
  assumption and runs eagerly, which raises eager's ValueError).
* ``torch.nn`` modules (``nn.ReLU()``, ``nn.Dropout(p)``, ``nn.Sequential`` of those): built
  for real at capture time from constant arguments and called like any module; only ones
  that own no parameters or buffers (creating those draws from the random-number generator
  each call) and that do not outlive the call (``FreshObjV``: a graph cannot hand out a new
  object each call).
"""
from __future__ import annotations

import dataclasses
import os
import types

import torch
import torch.nn as nn

from ...records import Unsupported
from ..values import ConstV, FreshObjV, Value, is_const
from ..models import provides
from .._torch_dispatch import MutationCheck
from ..op_args import concrete, holds_tensor, is_dynamic

_DISTRIBUTIONS_DIR = os.path.join(os.path.dirname(torch.__file__), "distributions") + os.sep


def construct(tracer, cls: type, args: list, kwargs: dict) -> Value | None:
    """The value of ``cls(*args, **kwargs)`` for the torch classes modelled here (None for
    other classes)."""
    if cls in (torch.finfo, torch.iinfo):
        cargs, ckwargs = _concrete_args(cls, args, kwargs)
        try:
            return ConstV(cls(*cargs, **ckwargs))
        except Exception as e:  # torch.iinfo(torch.float32): eager's TypeError
            raise Unsupported("exception_handling", f"torch.{cls.__name__}() raised "
                              f"{type(e).__name__}: {e}") from None
    if is_distributions_class(cls) or _is_plain_dataclass(cls):
        from .builtins import _construct
        return _construct(tracer, cls, args, kwargs)
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        return _fresh_module(tracer, cls, args, kwargs)
    return None


@provides("is_distributions_code")
def is_distributions_code(filename: str) -> bool:
    """Code of ``torch.distributions`` (inlined like user code: its helpers take and return
    distribution and constraint objects, not only tensors)."""
    return filename.startswith(_DISTRIBUTIONS_DIR)


def is_distributions_class(cls: type) -> bool:
    return (getattr(cls, "__module__", "") or "").startswith("torch.distributions.") \
        and isinstance(getattr(cls, "__init__", None), types.FunctionType)


def _is_plain_dataclass(cls) -> bool:
    """A torch dataclass (``nn.LinearCrossEntropyOptions``) whose ``__init__`` is the one
    ``@dataclass`` generates: making one stores its fields (and runs ``__post_init__``, whose
    validation is inlined like any torch Python code), so it is modelled like a user's class."""
    init = getattr(cls, "__init__", None)
    return (isinstance(cls, type) and dataclasses.is_dataclass(cls)
            and isinstance(init, types.FunctionType) and init.__code__.co_filename == "<string>")


def _concrete_args(cls, args, kwargs) -> tuple[list, dict]:
    if not all(is_const(a) for a in [*args, *kwargs.values()]):
        raise Unsupported("unsupported_call", f"torch.{cls.__name__}() of a value computed in "
                          "the call (only constant dtypes are modelled)")
    return [a.concrete() for a in args], {k: v.concrete() for k, v in kwargs.items()}


def _module_arg(v: Value):
    if isinstance(v, FreshObjV) or is_const(v):
        return v.concrete()
    raise Unsupported("unsupported_call", "creating a torch.nn module inside the optimized "
                      f"function from {v!r} (only constants and modules made in the call are "
                      "modelled)", "Create the module in __init__ and keep it as an attribute.")


def _fresh_module(tracer, cls: type, args: list, kwargs: dict) -> Value:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not cls.__module__.startswith("torch.nn."):  # (torch's other modules: quantization, ...)
        raise Unsupported("unsupported_call", f"creating a {name} inside the optimized function "
                          "(only torch.nn's own modules are modelled)", "Create the module in __init__.")
    cargs = [_module_arg(a) for a in args]
    ckwargs = {k: _module_arg(v) for k, v in kwargs.items()}
    rng = torch.get_rng_state()
    try:
        module = cls(*cargs, **ckwargs)
    except Exception as e:
        raise Unsupported("exception_handling", f"{name}() raised {type(e).__name__}: {e}") from None
    finally:
        torch.set_rng_state(rng)  # initialising parameters must not shift capture's draws
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        raise Unsupported("unsupported_call", f"{name}(...) made inside the optimized function "
                          "creates parameters or buffers (freshly initialised, from the random-"
                          "number generator, on every call); a graph cannot recreate them",
                          "Create the module in __init__ and keep it as an attribute.")
    return FreshObjV(module)


@provides("returns_metadata")
def returns_metadata(tracer, func, args: list, kwargs: dict) -> bool:
    """Whether torch Python helper ``func`` (``F._none_or_dtype``, ``F._mha_shape_check``), given
    a tensor whose sizes vary between calls, answers with a Python value rather than tensors.
    Recorded as one graph node, that value would be frozen at its capture-time answer (and is
    refused as ``data_dependent_value``); inlined, the helper's reads of dtypes and sizes are
    seen one by one (sizes stay symbolic, dtypes are guarded). Decided by a trial run on the
    capture's values (capture restores the RNG; a write into an outside tensor stops it)."""
    if not any(is_dynamic(a) for a in [*args, *kwargs.values()]):
        return False
    try:
        cargs = [concrete(a) for a in args]  # (sizes read without specialising them)
        ckwargs = {k: concrete(v) for k, v in kwargs.items()}
        with MutationCheck(set(tracer.fresh)):
            result = func(*cargs, **ckwargs)
    except Exception:  # (ExternalMutation, an error): the graph-node path reports it as before
        return False
    return not holds_tensor(result)
