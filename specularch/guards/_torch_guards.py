"""Compat: torch's C++ tensor check (``torch._C._dynamo.guards.TensorGuards``) and its C++
global-state check (``GlobalStateGuard``).

One ``TensorGuards`` object checks type, dispatch keys, dtype, device, requires_grad, sizes
and strides of many tensors in one C++ call (~0.1 µs per tensor instead of ~0.6 µs in
Python). It also fails when two checked tensors alias, which only makes guards stricter.
If the class is missing or behaves differently (a torch upgrade), ``tensor_checker`` returns
None and the Python conditions of ``TensorGuard`` are used instead.
"""
from __future__ import annotations

from typing import Callable

import torch

try:  # private API: the only import of torch._C._dynamo.guards outside frames/
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # pragma: no cover - depends on the torch build
    _TensorGuards = None
try:
    from torch._C._dynamo.guards import GlobalStateGuard as _GlobalStateGuard
except Exception:  # pragma: no cover - depends on the torch build
    _GlobalStateGuard = None


def tensor_checker(guards: list) -> Callable | None:
    """A ``check(*tensors) -> bool`` for these ``TensorGuard``s, or None if unavailable."""
    if _TensorGuards is None or not guards:
        return None
    try:
        templates = [_template(g) for g in guards]
        tg = _TensorGuards(*templates,
                           dynamic_dims_sizes=[[None if d in g.dynamic else s
                                                for d, s in enumerate(g.shape)] for g in guards],
                           dynamic_dims_strides=[[None] * len(g.stride) if g.dynamic else list(g.stride)
                                                 for g in guards])
        if not tg.check(*templates):
            return None
    except Exception:
        return None
    return tg.check


def _template(g) -> torch.Tensor:
    t = torch.empty_strided(g.shape, g.stride, dtype=g.dtype, device=g.device)
    if g.tensor_type is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=g.requires_grad)
    if g.tensor_type is not torch.Tensor:
        raise TypeError("tensor subclasses are checked in Python")
    return t.requires_grad_(g.requires_grad)


def global_state_checker() -> Callable | None:
    """A ``check() -> bool`` answering, in one C++ call, whether the process state is as now:
    grad mode, autocast of every device, the default dtype, and more (torch-function mode,
    deterministic algorithms, TF32, the number of threads). Not inference mode. None if
    unavailable. It is stricter than our own global-state guard: where it says no, the
    caller checks in Python."""
    if _GlobalStateGuard is None:
        return None
    try:
        check = _GlobalStateGuard().check
        return check if check() is True else None
    except Exception:
        return None
