"""The commit is all-or-nothing: every write that could raise is checked before the first one.

The entry commits its writes one after another (``render.commit_lines``). A write that
raised half-way would leave the earlier ones done, and the dispatcher would then run the
call eagerly over that state: an optimizer update applied twice. So the entry first checks,
against the objects as they are now, that each write that can raise will not, and makes the
one kind it cannot cheaply check (``.grad``) first, undoing it on failure; either way it
raises ``CommitRefused`` with nothing written, and the call runs eagerly (raising eager's
own error where eager raises).

What can raise at commit, and what is checked (the conditions capture assumed when it
deferred the write, ``symbolic/attrs.py`` ``store_attr``, plus torch's rule for ``.grad``):

* ``SetAttr`` / ``DelAttr`` on an object: its class must still have no ``__setattr__`` /
  ``__delattr__`` of its own (a frozen dataclass has one) and no data descriptor for the
  name (a property, a ``__slots__`` member); an object without ``__dict__`` cannot take a
  new attribute; a deleted attribute must exist. On an ``nn.Module``: ``Module.__setattr__``'s
  type rules for parameters, buffers and submodules.
* ``SetGrad`` (``tensor.grad = g``): torch refuses a gradient of another shape, dtype, device
  or layout without writing it; the commit assigns all gradients first and puts the old ones
  back when torch refuses one (``set_grads``), which costs less than checking each.
* ``Print``: its stream must not be closed.

The others cannot raise once the guards passed: globals and cells are plain stores; list and
dict writes go to built-in containers whose type is guarded; tensor updates copy or replay
ops on tensors whose sizes are guarded; an ``Effect`` (a warning replayed under filters
guarded not to raise, an ``lru_cache`` hit) does not raise.
"""
from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch import nn

_MISSING = object()


class CommitRefused(RuntimeError):
    """A write of the commit would raise (nothing was written): the call runs eagerly.

    Example: ``self.count = n`` captured on a plain class that later became frozen
    (``Counter.__setattr__`` raising ``FrozenInstanceError``); the eager run raises that error
    itself, with eager's state."""


def _class_attr(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return _MISSING


def _data_descriptor(cls: type, name: str) -> bool:
    found = _class_attr(cls, name)
    kind = type(found)  # the test of symbolic/attrs.py's _is_data_descriptor
    return found is not _MISSING and hasattr(kind, "__get__") and (
        hasattr(kind, "__set__") or hasattr(kind, "__delete__"))


def _own_hook(obj: Any, hook: str) -> bool:
    """Whether ``type(obj)`` runs code of its own on ``hook`` (``__setattr__``/``__delattr__``)."""
    if isinstance(obj, (type, types.ModuleType)):
        return False
    base = nn.Module if isinstance(obj, nn.Module) else object
    return getattr(type(obj), hook) is not getattr(base, hook)


def _refuse(what: str) -> CommitRefused:
    return CommitRefused(f"the commit would fail: {what}; nothing was written")


def _grad_problem(t: torch.Tensor, g: Any) -> str | None:
    if g is None:
        return None
    if not isinstance(g, torch.Tensor):
        return f"assigning a {type(g).__name__} as .grad"
    if g.shape != t.shape or g.dtype != t.dtype or g.device != t.device or g.layout != t.layout:
        return (f"assigning a gradient of shape {tuple(g.shape)}, {g.dtype}, {g.device}, "
                f"{g.layout} to a tensor of shape {tuple(t.shape)}, {t.dtype}, {t.device}, {t.layout}")
    return None


def _module_problem(m: nn.Module, name: str, value: Any) -> str | None:
    """``Module.__setattr__``'s type rules (it raises TypeError on these)."""
    if name in m.__dict__.get("_parameters", ()) and not (value is None or isinstance(value, nn.Parameter)):
        return f"a {type(value).__name__} assigned to parameter {name!r}"
    if name in m.__dict__.get("_modules", ()) and not (value is None or isinstance(value, nn.Module)):
        return f"a {type(value).__name__} assigned to submodule {name!r}"
    if name in m.__dict__.get("_buffers", ()) and not (value is None or isinstance(value, torch.Tensor)):
        return f"a {type(value).__name__} assigned to buffer {name!r}"
    return None


def can_setattr(obj: Any, name: str, value: Any) -> None:
    """Raises ``CommitRefused`` unless ``setattr(obj, name, value)`` is the plain store capture
    deferred."""
    if isinstance(obj, torch.Tensor):
        problem = _grad_problem(obj, value) if name == "grad" else f"assigning tensor attribute .{name}"
    elif _own_hook(obj, "__setattr__"):
        problem = f"{type(obj).__name__} defines __setattr__"
    elif _data_descriptor(type(obj), name):
        problem = f"{type(obj).__name__}.{name} is a property/descriptor"
    elif isinstance(obj, nn.Module):
        problem = _module_problem(obj, name, value)
    elif not hasattr(obj, "__dict__"):
        problem = f"a {type(obj).__name__} has no __dict__ to store {name!r} in"
    else:
        problem = None
    if problem is not None:
        raise _refuse(f"setting {name!r}: {problem}")


def _has_own(obj: Any, name: str) -> bool:
    if isinstance(obj, nn.Module) and any(name in obj.__dict__.get(table, ()) for table in (
            "_parameters", "_buffers", "_modules")):
        return True
    return name in getattr(obj, "__dict__", {})


def can_delattr(obj: Any, name: str, set_before: bool) -> None:
    """Raises ``CommitRefused`` unless ``delattr(obj, name)`` removes a stored attribute
    (``set_before``: an earlier write of this commit stores it)."""
    if isinstance(obj, torch.Tensor):
        problem = f"deleting tensor attribute .{name}"
    elif _own_hook(obj, "__delattr__"):
        problem = f"{type(obj).__name__} defines __delattr__"
    elif _data_descriptor(type(obj), name):
        problem = f"{type(obj).__name__}.{name} is a property/descriptor"
    elif not (set_before or _has_own(obj, name)):
        problem = "it is not there"
    else:
        problem = None
    if problem is not None:
        raise _refuse(f"deleting {name!r}: {problem}")


def set_grads(targets: tuple, values: tuple) -> None:
    """``t.grad = v`` for each pair, in order; when torch refuses one (a gradient of another
    shape, dtype, device or layout) the ones made are undone and ``CommitRefused`` is raised."""
    old = [t.grad for t in targets]
    try:
        for t, v in zip(targets, values):
            t.grad = v
    except (RuntimeError, TypeError) as error:
        for t, g in zip(reversed(targets), reversed(old)):  # a tensor set twice ends as before
            t.grad = g
        raise _refuse(f"setting .grad: {error}") from error


def can_print(stream: Any) -> None:
    stream = sys.stdout if stream is None else stream
    if stream is not None and getattr(stream, "closed", False) is True:
        raise _refuse("printing to a closed stream")


NAMESPACE: dict[str, Any] = dict(CAN_SETATTR=can_setattr, CAN_DELATTR=can_delattr,
                                 CAN_PRINT=can_print, SET_GRADS=set_grads)
