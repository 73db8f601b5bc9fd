"""Ops known to act on each element independently: what may run on many rows (a batch of
template instances, a loop's iterations stacked) as it runs on one, up to rounding. Shared by
the recursion templates' batched form (``templates/rowwise.py``) and the rolled loops'
hoisting (``symbolic/rolled/hoist.py``)."""
from __future__ import annotations

import inspect
import operator

import torch
import torch.nn.functional as F

ELEMENTWISE_FUNCTIONS = frozenset({
    torch.tanh, torch.sigmoid, torch.relu, torch.exp, torch.log, torch.neg, torch.abs,
    torch.sin, torch.cos, torch.sqrt, torch.rsqrt, torch.add, torch.sub, torch.mul, torch.div,
    torch.clamp, torch.pow, torch.maximum, torch.minimum, torch.where, torch.erf,
    F.relu, F.gelu, F.silu, F.elu, F.leaky_relu, F.softplus, F.hardtanh, F.relu6, F.tanh,
    F.sigmoid, F.mish, operator.add, operator.sub, operator.mul, operator.truediv,
    operator.neg, operator.pow,
})
ELEMENTWISE_METHODS = frozenset({
    "tanh", "sigmoid", "relu", "exp", "log", "neg", "abs", "sqrt", "rsqrt", "add", "sub", "mul",
    "div", "clamp", "pow", "sin", "cos", "float", "double", "half", "contiguous", "clone", "erf",
})



# Python's in-place operators: on a tensor they write into it (``h += x``).
_OPERATOR_WRITES = frozenset({
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
    operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
})


# in-place ops that change a tensor's sizes, strides or what it views (not its data: the
# mutation check sees no write); ``METADATA_WRITES``: those and ``detach_`` (requires_grad)
LAYOUT_WRITES = frozenset({"t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_",
                           "unsqueeze_", "resize_", "resize_as_", "as_strided_", "set_"})
METADATA_WRITES = LAYOUT_WRITES | {"detach_"}


def op_name(node) -> str:
    """An FX node's op by name: a method's name, a function's ``__name__`` ("" if none)."""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def in_place_by_name(node) -> bool:
    """A function or method named as torch names an in-place op (``add_``, ``detach_``;
    not a dunder): it writes into its first argument, its data or its metadata."""
    name = op_name(node)
    return node.op in ("call_function", "call_method") and name.endswith("_") \
        and not name.endswith("__")


def wrote_an_input(node) -> bool:
    """Whether capture saw the op write into a tensor that existed before it
    (``meta["writes_input"]``: not a composite op's own temporaries, as ``lstm_cell``'s
    decomposition writes; an inner rolled loop: what its body's ops wrote)."""
    return bool(node.meta.get("writes_input"))


def writes_in_place(node) -> bool:
    """Whether an FX node may write into a tensor that exists before it runs: an in-place
    op (``add_``, ``h += x``, ``x[i] = v``), ``out=``, ``inplace=True``, ``embedding``'s
    ``max_norm`` (it renormalises the table's rows it looks up). Work that moves across
    iterations of a loop must not move across such a write. Unknown modules count as
    writing."""
    if node.op == "call_module":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if in_place_by_name(node) or target in _OPERATOR_WRITES:
        return True
    bound = _arguments(node)
    return bound.get("out") is not None or bound.get("inplace") is True \
        or target is F.embedding and bound.get("max_norm") is not None


def _arguments(node) -> dict:
    """The node's arguments by parameter name, where the target's signature is known (the
    ``F.*`` functions take ``inplace`` / ``max_norm`` positionally too); else its kwargs."""
    try:
        return dict(inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments)
    except (TypeError, ValueError):
        return dict(node.kwargs)
