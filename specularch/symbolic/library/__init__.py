"""Models of library callables and objects over values: builtins, methods of built-in kinds, the
standard library, nn.Module, optimizers, torch objects, grad mode, printing, training.

Importing the package imports every model module, so each registers its entry points in
``symbolic/models.py`` (the core looks them up there instead of importing these modules)."""
from . import (builtins, context_managers, deque, exit_stack, grad_mode, methods, nn_module, optim,  # noqa: F401
               optim_more, printing, python_random, stdlib, stdlib_iter, stdlib_objects, torch_objects, training,
               warnings)
