"""Gradient all-reduce inserted into a captured training step, overlapped with backward.

When ``torch.distributed`` is initialised with more than one rank, a captured
``loss.backward()`` becomes ``grad_and_allreduce``: parameters are grouped into buckets
(``config.distributed_bucket_mb``, 25 MiB like DDP's default, filled in reverse order so the
last layers' gradients — ready first — form the first bucket, which like DDP's is at most
1 MiB so that communication starts early); a hook on each parameter launches a bucket's
asynchronous all-reduce as soon as all its gradients exist, so communication overlaps the rest
of backward; the handles are waited for only after backward, right before the gradients reach
the optimizer update. Gradients are averaged over ranks (divided by the world size, then
summed, like DDP). Before the first bucket leaves, the ranks agree that every one of them runs this same
step (``agreement.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import config
from . import agreement

MIB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * MIB  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def bucket_bytes() -> int:
    return max(1, int(config.distributed_bucket_mb * MIB))


def plan_buckets(params: list, bucket_bytes: int,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``params`` per bucket, last parameters first; a bucket closes once it holds
    ``bucket_bytes`` (the first one: ``min(first_bucket_bytes, bucket_bytes)``) or before a
    parameter of another dtype or device."""
    buckets, current, size = [], [], 0
    limit = min(first_bucket_bytes, bucket_bytes)
    for i in reversed(range(len(params))):
        if current and (params[i].dtype, params[i].device) != (params[current[0]].dtype,
                                                               params[current[0]].device):
            buckets.append(current)
            current, size, limit = [], 0, bucket_bytes
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, bucket_bytes
    if current:
        buckets.append(current)
    return buckets


def grad_and_allreduce(loss: torch.Tensor, params: list, step: str = "step", layout: int = 0):
    """``torch.autograd.grad(loss, params)`` averaged over all ranks, with each bucket's
    all-reduce started during backward as soon as the bucket is complete.

    ``step`` names the training step in errors; ``layout`` identifies ``params`` (a hash of
    their sources): ranks whose buckets would not match raise ``DistributedStepError``."""
    world = dist.get_world_size()
    buckets = plan_buckets(params, bucket_bytes())
    digest = agreement.layout_hash(layout, buckets, agreement.buffers_digest(),
                                   [(tuple(p.shape), str(p.dtype)) for p in params])
    header = agreement.Header(step, digest=digest, async_op=True)
    where = {}  # parameter index -> (bucket, offset in its flat buffer)
    for b, members in enumerate(buckets):
        offset = 0
        for i in members:
            where[i] = (b, offset)
            offset += params[i].numel()
    flats = [torch.empty(sum(params[i].numel() for i in members), dtype=params[members[0]].dtype,
                         device=params[members[0]].device) for members in buckets]
    missing = [set(members) for members in buckets]
    launched: dict[int, object] = {}

    def launch(b: int) -> None:
        if header.verdict() is not None:  # some rank does not run this step: send nothing
            return
        for i in missing[b]:  # unused parameters contribute zeros
            _, offset = where[i]
            flats[b][offset:offset + params[i].numel()].zero_()
        launched[b] = dist.all_reduce(flats[b], async_op=True)

    def hook_for(i: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            b, offset = where[i]
            # into the bucket, divided by the world size before the sum like DDP: one pass
            torch.div(grad.detach().reshape(-1), world,
                      out=flats[b][offset:offset + params[i].numel()])
            missing[b].discard(i)
            if not missing[b]:
                launch(b)
            return grad
        return hook

    handles = [p.register_hook(hook_for(i)) for i, p in enumerate(params) if p.requires_grad]
    try:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for b in range(len(buckets)):  # buckets holding unused parameters
        if b not in launched:
            launch(b)
    if header.verdict() is not None:
        raise header.verdict()
    averaged = list(grads)
    for b, work in launched.items():
        work.wait()
        for i in buckets[b]:
            if grads[i] is not None:
                _, offset = where[i]
                averaged[i] = flats[b][offset:offset + params[i].numel()].view_as(params[i])
    return tuple(averaged)
