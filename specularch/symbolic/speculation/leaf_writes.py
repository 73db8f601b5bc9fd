"""Tensors that require grad written in place under ``no_grad`` (``w.clamp_(-1, 1)`` on a
parameter, a max-norm constraint), then read again with grad enabled.

In eager the parameter stays the same autograd leaf with new values: later ops send their
gradients to it. The graph computes the write on a copy (``Tracer._functionalize``), which is
not connected to the leaf; the copy keeps the leaf in ``TensorV.stale_leaf``. Each op that
reads the copy with grad enabled reads ``written_leaf(leaf, copy)`` instead: the copy's values
(bit for bit) with the gradient passed to the leaf unchanged, as autograd does for the eager
leaf. The copy itself stays a plain tensor, so later writes under ``no_grad`` still work on it,
and an optimizer update that is never read again (a training step) adds nothing to the graph.
"""
from __future__ import annotations

import dataclasses

import torch

from ..values import DictV, ListV, TensorV, TupleV, leaves


class _WrittenLeaf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, leaf, value):
        return value  # an input returned as is: autograd makes it a view (same values)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def written_leaf(leaf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, with gradients flowing to ``leaf`` (which ``value`` replaced in place)."""
    with torch.enable_grad():
        return _WrittenLeaf.apply(leaf, value)


def metadata_of(v: TensorV) -> torch.Tensor:
    """The tensor whose ``requires_grad``/``is_leaf`` eager would report for ``v``."""
    return v.example if v.stale_leaf is None else v.stale_leaf[1]


def connect_reads(tracer, args: list, kwargs: dict) -> tuple[list, dict]:
    """``args``/``kwargs`` of an op run with grad enabled, each copy of a written leaf replaced
    by a read connected to that leaf (see the module docstring)."""
    if not any(isinstance(x, TensorV) and x.stale_leaf is not None
               for a in [*args, *kwargs.values()] for x in leaves(a)):
        return args, kwargs
    return ([_connected(tracer, a) for a in args],
            {k: _connected(tracer, v) for k, v in kwargs.items()})


def _connected(tracer, v):
    if isinstance(v, TensorV) and v.stale_leaf is not None:
        leaf_node, leaf = v.stale_leaf
        node = tracer.graph.call_function(written_leaf, (leaf_node, v.node))
        node.meta["where"] = tracer.where()
        node.meta["example"] = example = written_leaf(leaf, v.example)
        return dataclasses.replace(v, node=node, example=example, source=None, updated=False,
                                   real=None, stale_leaf=None)
    if isinstance(v, (ListV, TupleV)):
        return dataclasses.replace(v, items=[_connected(tracer, i) for i in v.items])
    if isinstance(v, DictV):
        return dataclasses.replace(v, items={k: _connected(tracer, i) for k, i in v.items.items()})
    return v
