"""Compat: which run of the autograd engine (a ``backward()`` or ``autograd.grad()`` call,
a *graph task*) is executing the current backward. torch exposes it only as an underscored
binding; every use in specularch goes through here.
"""
from __future__ import annotations

import torch


def graph_task_id() -> int:
    """The id of the engine run executing this backward (-1 outside one): unique per run."""
    return torch._C._current_graph_task_id()


def at_end_of_backward(fn) -> None:
    """Call ``fn()`` when the engine run executing this backward ends (call it from a hook
    inside one): ``Variable._execution_engine.queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
