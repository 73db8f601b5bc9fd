"""Values as the arguments of one torch op during capture: ``concrete`` gives what the real
op runs on now, ``fx_arg`` what its graph node is given (nodes for graph values, constants
otherwise); the ``dynamic`` helpers say whether a value's sizes or numbers vary between calls.
"""
from __future__ import annotations

from typing import Any

import torch

from ..records import Unsupported
from .speculation import item_args
from .values.rolled import RolledListV
from .values.symint import SymV
from .values import (ConstV, DictV, GeneratorV, ListV, ObjV, SetV, SliceV, TensorV, TupleV,
                     UntrackedContainerV, Value, leaves)


def is_dynamic(v: Value) -> bool:
    return any(isinstance(leaf, (SymV, RolledListV)) or (isinstance(leaf, TensorV) and leaf.dynamic)
               for leaf in leaves(v))


def specialize_all(v: Value) -> None:
    for leaf in leaves(v):
        if isinstance(leaf, SymV):
            leaf.concrete()


def mark_dynamic(v: Value) -> None:
    for leaf in leaves(v):
        if isinstance(leaf, TensorV):
            leaf.dynamic = True


def holds_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(isinstance(i, torch.Tensor) for i in x)
    return False


def concrete(v: Value) -> Any:
    if isinstance(v, (ConstV, TensorV, RolledListV)):
        return v.concrete()
    if isinstance(v, (SymV, item_args.ItemNumV)):
        return v.value  # the op stays symbolic: no specialisation
    if isinstance(v, TupleV):
        return v.build([concrete(i) for i in v.items])
    if isinstance(v, ListV):
        return [concrete(i) for i in v.items]
    if isinstance(v, SliceV):
        return slice(*[concrete(p) for p in v.parts])
    if isinstance(v, DictV):
        return {k: concrete(i) for k, i in v.items.items()}
    if isinstance(v, SetV):
        return set(v.items)
    if isinstance(v, ObjV) and isinstance(v.obj, (torch.Generator,)):
        return v.obj
    if type(v).__name__ in ("ScalarV", "NumV", "ClockV") or isinstance(v, UntrackedContainerV):
        return v.concrete()  # raises data_dependent_value / RelaxationRefused
    raise Unsupported("unsupported_call", f"passing {v!r} to a torch operation is not supported")


def fx_arg(v: Value) -> Any:
    """The FX argument for a value: a node for tensors, the constant otherwise."""
    if isinstance(v, (TensorV, SymV, GeneratorV, item_args.ItemNumV, RolledListV)):
        return v.node
    if isinstance(v, ConstV):
        return v.value
    if isinstance(v, TupleV):
        return tuple(fx_arg(i) for i in v.items)
    if isinstance(v, ListV):
        return [fx_arg(i) for i in v.items]
    if isinstance(v, SliceV):
        return slice(*[fx_arg(p) for p in v.parts])
    if isinstance(v, DictV):
        return {k: fx_arg(i) for k, i in v.items.items()}
    return concrete(v)
