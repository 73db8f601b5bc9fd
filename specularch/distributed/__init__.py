"""Data-parallel training inside captured graphs (``torch.distributed``).

* ``allreduce.py``: the averaged, bucketed gradient exchange a captured ``backward()`` becomes;
* ``agreement.py``: every rank runs a distributed step, or every rank raises;
* ``broadcast.py``: rank 0's parameters and buffers, at a step's first capture;
* ``eager.py``: eager fallbacks stop before an unaveraged ``backward()``;
* ``steps.py``: the dispatcher's hooks for distributed steps (``specularch.dispatch.hooks``),
  installed on import.
"""
from . import agreement, broadcast, eager, steps
from .agreement import DistributedStepError
from .allreduce import active, grad_and_allreduce

__all__ = ["DistributedStepError", "active", "agreement", "broadcast", "eager",
           "grad_and_allreduce", "steps"]
