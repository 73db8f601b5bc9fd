"""``t.item()`` during capture: a Python number the graph produces (its model: ``library/training.py``;
numbers computed from it: ``speculation/deferred.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx

from ...records import Unsupported
from . import Value


@dataclass(eq=False, repr=False)
class ScalarV(Value):
    """``t.item()``: a Python number the graph produces. It can be returned, stored, printed
    or formatted into a string (it is read from the graph's output after the run; see
    printing.py), but not computed on or branched on."""

    kind_text = "a `.item()` value"
    node: torch.fx.Node
    value: Any
    # the graph's last node when ``.item()`` was called (keyword: subclasses add positionals)
    read_after: torch.fx.Node | None = field(default=None, kw_only=True)

    def concrete(self):
        raise Unsupported("data_dependent_value",
                          "a value from `.item()` is used where Python needs the number itself "
                          "(a size, an index, a loop count, a string used as text); arithmetic, "
                          "passing it to a torch op, tests on it (speculated), returning, "
                          "storing, printing and formatting it are captured")

    def python_type(self):
        return type(self.value)

    def __repr__(self):
        return f"ScalarV({self.value})"
