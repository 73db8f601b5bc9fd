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


#: Where the global module hook tables live, and their names.
GLOBAL_HOOKS_OWNER = _module
GLOBAL_HOOK_TABLES = ("_global_forward_hooks", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")


def global_module_hooks_expr(owner: str) -> str:
    """A Python expression, true when a global ``nn.Module`` hook is set, over ``owner`` (the
    name under which ``GLOBAL_HOOKS_OWNER`` is visible): a generated check reads the four
    tables without a Python call."""
    return "(" + " or ".join(f"{owner}.{name}" for name in GLOBAL_HOOK_TABLES) + ")"


def global_module_hooks() -> bool:
    """Whether any global ``nn.Module`` hook (``register_module_forward_hook`` ...) is set."""
    return bool(any(getattr(_module, name) for name in GLOBAL_HOOK_TABLES))


def global_optimizer_hooks() -> bool:
    """Whether a global optimizer step hook (``register_optimizer_step_pre_hook`` ...) is set."""
    return bool(_optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks)


#: Where the global optimizer step hook tables live, and their names.
GLOBAL_OPTIMIZER_HOOKS_OWNER = _optimizer
GLOBAL_OPTIMIZER_HOOK_TABLES = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")

#: The global hooks ``Module.__setattr__`` runs when a buffer, parameter or submodule is
#: assigned (``register_module_buffer_registration_hook`` ...): they may replace the value.
REGISTRATION_HOOK_TABLES = ("_global_buffer_registration_hooks",
                            "_global_parameter_registration_hooks",
                            "_global_module_registration_hooks")


def registration_hooks() -> bool:
    """Whether a global buffer/parameter/module registration hook is set."""
    return bool(any(getattr(_module, name) for name in REGISTRATION_HOOK_TABLES))
