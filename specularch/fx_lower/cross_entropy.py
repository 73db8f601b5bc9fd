"""``F.cross_entropy`` on class indices as one autograd node whose backward writes the
gradient once, outside exact mode (the ``fx`` backend's graphs; ``passes.CHEAPER_LOSS``).

Eager's ``cross_entropy(x, t)`` is ``nll_loss(log_softmax(x), t)``: two autograd nodes. Its
backward makes a zero-filled ``[N, C]`` tensor with one entry per row (``nll_loss``'s
gradient), then ``log_softmax``'s backward reads it and the saved ``log_softmax`` and writes a
third ``[N, C]`` tensor: ``g_in = g - exp(logp) * g.sum(1)``. With one entry per row that
is ``(softmax - onehot(t)) * s``, ``s`` the loss's gradient over the count of rows:

    grad = exp(logp) * s;  grad[i, t_i] -= s

written here over the saved ``logp`` itself (no fresh ``[N, C]`` memory, no zeros, one
pass fewer). For the LM's ``[400, 2000]`` logits, eager's backward took more time than the
decoder's forward product, mostly in touching fresh memory.

The forward runs eager's ops (``log_softmax`` then ``nll_loss``): the loss and its errors
(a target out of range) are eager's. The gradient is eager's within rounding (each entry
is the same product, the target's one subtraction in another order). Rows whose target is
``ignore_index`` get no gradient and the mean is over the others, as in eager. A backward
under ``create_graph`` (double backward), or a second backward through a retained graph,
runs eager's formula on the saved logits instead.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx
import torch.nn.functional as F

_SIGNATURE = inspect.signature(F.cross_entropy)
# Below this many logits the node's Python costs more than the passes it saves: measured on
# CPU, 1 thread, forward and backward, [32, 10] 2.1x eager's time, [256, 256] 1.2x,
# [128, 1000] 0.9x, the LM's [400, 2000] 0.5x.
MIN_LOGITS = 1 << 17


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, mean):
        logp = torch.log_softmax(logits, 1)
        loss = F.nll_loss(logp, target, ignore_index=ignore_index,
                          reduction="mean" if mean else "sum")
        ctx.save_for_backward(logits, target)
        ctx.logp, ctx.ignore_index, ctx.mean = logp, ignore_index, mean
        return loss

    @staticmethod
    def backward(ctx, g):
        logits, target = ctx.saved_tensors  # after the graph was freed: eager's error
        logp, ctx.logp = ctx.logp, None     # the first backward takes it over
        if logp is None or torch.is_grad_enabled():
            return _eager_gradient(ctx, logits, target, g), None, None, None
        ignored = target == ctx.ignore_index
        grad = logp.exp_()
        if not bool(ignored.any()):
            scale = g / target.shape[0] if ctx.mean else g
            grad.mul_(scale)
            rows = scale.neg().expand(target.shape[0], 1)
            return grad.scatter_add_(1, target.unsqueeze(1), rows), None, None, None
        # (the ignored rows' entries are written below; with every row ignored, scale is
        # inf and they are all of them)
        scale = g / (~ignored).sum() if ctx.mean else g
        grad.mul_(scale)
        rows = scale.neg().expand(target.shape[0], 1)
        grad.scatter_add_(1, target.masked_fill(ignored, 0).unsqueeze(1), rows)
        return grad.masked_fill_(ignored.unsqueeze(1), 0), None, None, None


def _eager_gradient(ctx, logits, target, g):
    """Eager's gradient, recorded by autograd under ``create_graph`` (the saved logits keep
    their history), else from the logits alone."""
    create_graph = torch.is_grad_enabled()
    x = logits if create_graph else logits.detach().requires_grad_()
    with torch.enable_grad():
        loss = F.cross_entropy(x, target, ignore_index=ctx.ignore_index,
                               reduction="mean" if ctx.mean else "sum")
        (grad,) = torch.autograd.grad(loss, x, g, create_graph=create_graph)
    return grad


def cross_entropy(logits, target, ignore_index: int, mean: bool):
    """The rewritten graph's stand-in for ``F.cross_entropy(logits, target, ignore_index=,
    reduction=)``; eager's op where no gradient is recorded or the logits are few."""
    if not logits.requires_grad or not torch.is_grad_enabled() or logits.numel() < MIN_LOGITS:
        return F.cross_entropy(logits, target, ignore_index=ignore_index,
                               reduction="mean" if mean else "sum")
    return _CrossEntropy.apply(logits, target, ignore_index, mean)


# Ops through which the logits may be a view of a tensor the graph computed (the LM's
# ``stack(outputs).flatten(0, 1)``).
_VIEWS = {"flatten", "view", "reshape"}


def _private_logits(node: torch.fx.Node, outside: set) -> bool:
    """Whether nothing but the loss reads or writes the memory of ``node``: it and each
    tensor it is a view of feed only the next one, and their memory is none of the graph's
    inputs' (``outside``: their storages' addresses at capture)."""
    example = node.meta.get("example")
    if example.untyped_storage().data_ptr() in outside:
        return False
    while len(node.users) == 1:
        if not (node.op == "call_method" and node.target in _VIEWS):
            return node.op in ("call_function", "call_method")
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return False
    return False


def _plan(node: torch.fx.Node, outside: set) -> tuple | None:
    """``(logits, target, ignore_index, mean)`` of a ``F.cross_entropy`` node this rewrite
    takes, else None: class-index targets of one row each, no weight, no label smoothing,
    a mean or sum; float CPU logits that require grad, at least ``MIN_LOGITS`` of them at
    capture, and that only the loss reads."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    logits, target = a["input"], a["target"]
    if a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None \
            or a["reduction"] not in ("mean", "sum") or a["label_smoothing"] != 0.0 \
            or type(a["ignore_index"]) is not int or not isinstance(logits, torch.fx.Node) \
            or not isinstance(target, torch.fx.Node):
        return None
    x, t = logits.meta.get("example"), target.meta.get("example")
    if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor) or x.dim() != 2 \
            or x.layout is not torch.strided or x.dtype not in (torch.float32, torch.float64) \
            or x.device.type != "cpu" or not x.requires_grad or x.numel() < MIN_LOGITS \
            or t.dim() != 1 \
            or t.dtype != torch.int64 or not _private_logits(logits, outside):
        return None
    return logits, target, a["ignore_index"], a["reduction"] == "mean"


def _input_storages(graph: torch.fx.Graph) -> set:
    return {n.meta["example"].untyped_storage().data_ptr() for n in graph.nodes
            if n.op in ("placeholder", "get_attr") and isinstance(n.meta.get("example"), torch.Tensor)
            and n.meta["example"].layout is torch.strided}


def rewrite(graph: torch.fx.Graph) -> int:
    """Each ``F.cross_entropy`` node ``_plan`` takes becomes ``cross_entropy``; returns how
    many."""
    count, outside = 0, None
    for node in graph.nodes:
        if node.op == "call_function" and node.target is F.cross_entropy:
            outside = _input_storages(graph) if outside is None else outside
            plan = _plan(node, outside)
            if plan is not None:
                node.target, node.args, node.kwargs = cross_entropy, plan, {}
                count += 1
    return count
