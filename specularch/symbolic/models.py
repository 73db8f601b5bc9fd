"""The table through which the core of capture (``calls.py``, ``attrs.py``, ``operators.py``)
reaches the models in ``library/`` and ``speculation/``.

A model module registers its entry points here when it is imported (``@provides``); the core
looks them up by name (``MODELS.call_method(...)``) instead of importing the module, so imports
run one way, from the models to the core. ``capture.py`` imports ``library/`` (all of it, see
``library/__init__.py``), so every model is registered before the first capture runs.

Names are declared below: registering or looking up an undeclared name is an error, a name
registered twice too (two models cannot silently shadow each other).
"""
from __future__ import annotations

from typing import Any

DECLARED = frozenset({
    # library/methods.py
    "call_method", "exit_context",
    # library/builtins.py
    "BUILTINS", "call_builtin_like", "construct_torch_class", "slot_write_problem",
    # library/torch_objects.py
    "is_distributions_code", "returns_metadata",
    # library/grad_mode.py
    "grad_decorator_context", "grad_mode_enter", "grad_mode_exit",
    # library/training.py
    "read_grad", "write_grad",
    # library/optim.py
    "optim_is_modelled", "captured_optimizer_names",
    # library/nn_module.py
    "module_method_is_modelled",
    # library/printing.py, speculation/deferred.py, library/stdlib*.py
    "format_binary", "deferred_binary", "deferred_unary", "stdlib_binary", "missing_item",
    "refuse_frozen_write", "deque_check_key",
    # library/exit_stack.py: the value class, whose attributes are all methods
    "ExitStackV",
    # library/python_random.py
    "refuse_inlining",
})


class _Models:
    """Attribute access to the registered models (``MODELS.call_method``)."""

    def __init__(self) -> None:
        self._table: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        table = self.__dict__["_table"]
        if name in table:
            return table[name]
        if name in DECLARED:
            raise LookupError(f"model {name!r} is declared but not registered: import "
                              "specularch.symbolic.library before capturing")
        raise AttributeError(f"{name!r} is not a declared model (symbolic/models.py DECLARED)")

    def register(self, name: str, value: Any) -> None:
        if name not in DECLARED:
            raise ValueError(f"model {name!r} is not declared in symbolic/models.py DECLARED")
        if name in self._table and self._table[name] is not value:
            raise ValueError(f"model {name!r} is registered twice")
        self._table[name] = value


MODELS = _Models()


def provides(name: str):
    """Decorator: register the function as the model ``name``."""
    def register(fn):
        MODELS.register(name, fn)
        return fn
    return register
