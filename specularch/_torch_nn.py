"""Compat: the private parts of ``nn.Module`` and ``torch.optim`` that specularch reads.

* the global hook tables (``register_module_forward_hook``, ...,
  ``register_optimizer_step_pre_hook``): a hook set there runs around every module call or
  optimizer step, which a graph would skip;
* the code object of ``Module._wrapped_call_impl``: the frame every ``module(...)`` call
  starts with, which the frame policy recognises.
"""
from __future__ import annotations

from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer

#: The frame every ``module(...)`` call starts with (``nn.Module.__call__``).
MODULE_CALL_CODE = _module.Module._wrapped_call_impl.__code__


def global_module_hooks() -> bool:
    """Whether any global ``nn.Module`` hook (``register_module_forward_hook`` ...) is set."""
    m = _module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or
                m._global_backward_hooks or m._global_backward_pre_hooks)


def global_optimizer_hooks() -> bool:
    """Whether a global optimizer step hook (``register_optimizer_step_pre_hook`` ...) is set."""
    return bool(_optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks)
