"""Ops known to act on each element independently: what may run on many rows (a batch of
template instances, a loop's iterations stacked) as it runs on one, up to rounding. Shared by
the recursion templates' batched form (``templates/rowwise.py``) and the rolled loops'
hoisting (``symbolic/speculation/rolled_hoist.py``)."""
from __future__ import annotations

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

