"""The guard of a list of tensors passed whole into a graph (a rolled ``for x in xs`` loop,
``symbolic/speculation/rolled_lists.py``): every item shares item 0's metadata; the length is
not guarded (the loop's trip count is a run-time value)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .guard import Guard, TensorGuard, _short, const_name


@dataclass(frozen=True, eq=False)
class TensorListGuard(Guard):
    """``type(v) is list`` and each item a tensor like ``item`` (a ``TensorGuard`` without a
    source: type, dtype, device, shape, strides, requires_grad, leaf state)."""

    item: TensorGuard = None

    def conditions(self, v, consts):
        each = " and ".join(self.item.conditions("x", consts))
        return [f"type({v}) is {const_name(consts, list)}", f"all({each} for x in {v})"]

    def describe(self):
        text = self.item.describe().split(": ", 1)[1]
        return f"{self.source}: a list of {text} (any length)"

    def mismatch(self, value):
        if type(value) is not list:
            return f"expected a list, got {type(value).__qualname__}"
        for k, x in enumerate(value):
            if not isinstance(x, torch.Tensor) or self.item.mismatch(x) != "did not match":
                return f"[{k}] {self.item.mismatch(x)} (got {_short(x)})"
        return "did not match"

    @staticmethod
    def of(source, t: torch.Tensor, leaf: bool | None, where: str = "") -> "TensorListGuard":
        item = TensorGuard(None, type(t), t.dtype, t.device, tuple(t.shape), tuple(t.stride()),
                           t.requires_grad, leaf=leaf)
        return TensorListGuard(source, item=item, where=where)
