"""Compat: torch's private inference-mode guard and dispatch-mode keys, used by
``grad_mode.py``.

* ``inference_mode_guard`` enters inference mode the way ``torch.inference_mode()`` does
  inside, without the decorator machinery, so capture can hold it across bytecode
  instructions and leave it when the frame's ``with`` block ends.
* ``tracing_mode_active`` tells whether a backend is tracing the graph (``make_fx``,
  fake tensors, functionalization): an op that only the ``fx`` backend can run raises then.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_TRACING_MODES = [getattr(torch._C._TorchDispatchModeKey, k) for k in ("PROXY", "FAKE", "FUNCTIONAL")
                  if hasattr(torch._C._TorchDispatchModeKey, k)]


def inference_mode_guard():
    """A context manager object (not yet entered) that turns inference mode on."""
    return torch._C._InferenceMode(True)


def tracing_mode_active() -> bool:
    return _get_current_dispatch_mode() is not None \
        or any(torch._C._get_dispatch_mode(k) is not None for k in _TRACING_MODES)
