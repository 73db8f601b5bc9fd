"""Guards on lookups: what capture found by looking a name up (a module's ``forward``, a
method on an object's class, an attribute of torch's own classes and modules) is guarded to
be found again, so a hook registered or a method patched after capture is seen by the next
call (it recaptures or runs eagerly instead of running a stale graph).
"""
from __future__ import annotations

import types

from .._torch_nn import global_module_hooks
from ..guards import (AttrSource, ContainsGuard, IdGuard, ItemSource, NoGlobalHooksGuard,
                      NoHooksGuard, ObjectSource, pin)
from ..guards.lookups import AttrIsGuard, stable
from ..guards.sources import Source
from ..records import Unsupported
from .values import ObjV

# Attributes of these modules are trusted not to be rebound: reading ``torch.relu`` or
# ``math.pi`` installs no guard (the global ``torch`` itself is id-guarded).
TRUSTED_MODULE_ROOTS = {"torch", "math", "operator", "builtins", "functools", "itertools",
                        "collections", "typing", "numbers", "abc", "enum", "types", "warnings",
                        "numpy", "dataclasses", "copy", "inspect"}


def is_trusted_module(mod: types.ModuleType) -> bool:
    return mod.__name__.split(".")[0] in TRUSTED_MODULE_ROOTS


def guard_lookup(tracer, owner, name: str) -> None:
    """``owner.name`` (a class or module whose attributes have no guarded source: torch's
    own) was looked up: guard that it is still that object, so a patch after capture
    (``nn.Linear.forward = ...``, ``F.linear = ...``) is seen by the next call."""
    if stable(owner, name):
        tracer.guards.add(AttrIsGuard(None, owner=owner, name=name,
                                      expected=getattr(owner, name), where=tracer.where()))


def guard_module_call(tracer, module_value: ObjV) -> None:
    """``module(...)`` is captured as its ``forward``: a hook (the module's own or a global
    one) would run around it in eager, so none may be set now or at a later call."""
    m = module_value.obj
    if any(getattr(m, d) for d in NoHooksGuard.HOOK_DICTS) or global_module_hooks():
        raise Unsupported("module_hooks", f"{type(m).__name__} has hooks registered")
    tracer.add_guard(NoGlobalHooksGuard, None)
    if module_value.source is not None:
        tracer.add_guard(NoHooksGuard, module_value.source, cls=type(m))


def guard_method_lookup(tracer, v: ObjV, name: str) -> Source | None:
    """``v.name`` found a function on ``v``'s class (or nothing on the instance): guard
    that the instance still does not shadow it and, for classes outside torch, that the
    class attribute is still that function (a method swapped after capture is seen).
    Returns the source of that class attribute (None for torch's classes, whose
    attribute is guarded as a library lookup instead: ``guard_lookup``)."""
    cls = type(v.obj)
    if cls.__module__.split(".")[0] in TRUSTED_MODULE_ROOTS:
        guard_lookup(tracer, cls, name)
    if v.source is None:
        return None
    obj = v.obj
    inst = getattr(obj, "__dict__", None)
    if isinstance(inst, dict):
        tracer.add_guard(ContainsGuard, AttrSource(v.source, "__dict__"), key_value=name,
                         expected=name in inst)
    cls = type(obj)
    if cls.__module__.split(".")[0] in TRUSTED_MODULE_ROOTS:
        return None
    for klass in cls.__mro__:
        table = AttrSource(ObjectSource(pin(klass), f"{klass.__module__}.{klass.__qualname__}"),
                           "__dict__")
        if name in klass.__dict__:
            tracer.add_guard(IdGuard, ItemSource(table, name), klass.__dict__[name])
            return ItemSource(table, name)
        tracer.add_guard(ContainsGuard, table, key_value=name, expected=False)
    return None
