"""Eager fallbacks in distributed mode: stop at an unaveraged ``backward()``.

A captured ``loss.backward()`` averages gradients over ranks; the original Python does not.
So when an optimized function runs eagerly while ``torch.distributed`` is active and calls
``backward()``, it stops right before that backward (``DistributedStepError``) after telling
the other ranks (``agreement.refuse``) — unless a ``DistributedDataParallel`` module ran its
forward in the same call: then DDP averages the gradients, exactly as in the original program.

Functions that never call ``backward()`` (an evaluation step, a model's forward) run eagerly
as usual; the watch costs a few microseconds per torch call while they do.
"""
from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

from . import agreement

_BACKWARD = frozenset({torch.Tensor.backward, torch.autograd.backward})
_CAPTURE = threading.local()


def note_backward_captured() -> None:
    """Called when a capture turns ``backward()`` into the averaged gradient exchange: if that
    capture then fails, this path of the step is known to reach ``backward()``."""
    _CAPTURE.reached = True


def start_capture() -> None:
    _CAPTURE.reached = False


def capture_reached_backward() -> bool:
    return getattr(_CAPTURE, "reached", False)


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


class WatchBackward(TorchFunctionMode):
    """Active while an optimized function runs eagerly in distributed mode."""

    def __init__(self, step: str, kind: str, why: str):
        super().__init__()
        self.step, self.kind, self.why = step, kind, why
        self.ddp = _ddp_class()
        self.ddp_ran = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.ddp_ran and self.ddp._active_ddp_module is not None:
            self.ddp_ran = True  # inside DDP's forward: its reducer averages this backward
        if func in _BACKWARD and not self.ddp_ran:
            raise agreement.refuse(self.step, self.kind, self.why)
        return func(*args, **(kwargs or {}))
