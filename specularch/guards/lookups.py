"""Guards on what a capture looked up in torch itself: a method of a torch class
(``nn.Linear.forward``, ``nn.Module.__call__``) or a function read through a module attribute
(``F.linear``, ``torch.relu``). Those objects are trusted (no source, no guard on the path to
them), yet libraries patch exactly them after a model is built (LoRA/PEFT adapters,
profilers, fp8 shims); a graph captured before the patch must not be reused after it.

One condition per (owner, name), de-duplicated across the capture: ``owner.name is f``. A
plain attribute read of a class or module object with the interpreter's attribute caches
(about 20 ns on CPython 3.11), resolved through the class's MRO exactly as the call does.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from .guard import Guard, const_name


def stable(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` yields the same object each time (a function, a builtin, a
    class), so that an identity check can tell a patch (not a classmethod bound anew)."""
    try:
        return getattr(owner, name) is getattr(owner, name)
    except AttributeError:
        return False


@dataclass(frozen=True, eq=False)
class AttrIsGuard(Guard):
    """``owner.name`` is still ``expected`` (owner: a class or module of torch's)."""

    owner: Any = None
    name: str = ""
    expected: Any = None

    def key(self):
        return ("AttrIs", id(self.owner), self.name)

    def conditions(self, v, consts):
        owner = const_name(consts, self.owner)
        read = f"{owner}.{self.name}" if self.name.isidentifier() else \
            f"getattr({owner}, {self.name!r})"
        return [f"{read} is {const_name(consts, self.expected)}"]

    def describe(self):
        return f"{_label(self.owner)}.{self.name} is {_label(self.expected)}"

    def reason(self, value):
        now = getattr(self.owner, self.name, None)
        if now is self.expected:
            return None
        return (f"{_label(self.owner)}.{self.name} was replaced since capture (now "
                f"{_label(now)}, was {_label(self.expected)}){self._at()}")


def _label(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None)
    return f"{module}.{name}" if module else name
