"""Compat: torch's ``_foreach_*`` ops (one call that applies an elementwise op to a list of
tensors, running the same per-tensor kernels in a C++ loop on CPU). They are underscored
(not part of torch's documented API) though optimizers and ``clip_grad_norm_`` rely on
them; every use in specularch goes through here.
"""
from __future__ import annotations

from typing import Callable

import torch


def foreach_op(name: str, inplace: bool) -> Callable:
    """``torch._foreach_<name>`` (``_foreach_<name>_`` when ``inplace``)."""
    return getattr(torch, f"_foreach_{name}{'_' if inplace else ''}")


# The ops themselves (not wrappers): a graph node calling ``foreach_norm`` is a node on
# torch's own op, which the backends trace and compile.
foreach_norm = torch._foreach_norm   # the norm of every tensor of a list (clip_grad_norm_)
foreach_copy_ = torch._foreach_copy_  # copy_ per (target, value) pair, in order
