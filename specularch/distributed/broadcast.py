"""Start every rank from rank 0's model — parameters (trainable or frozen) and buffers — and
keep buffers equal to rank 0's after every step, like DDP.

Like DDP at construction, the first capture of a distributed training step broadcasts from
rank 0 the whole state of every module the step reads — found from the graph's guards and
inputs: the outermost ``nn.Module`` on each path (``G['model']`` for ``G['model'].fc.weight``)
— plus parameters and leaf tensors that require grad outside any module. A later capture
broadcasts only what an earlier one of the same step did not.

DDP (``broadcast_buffers=True``, its default) broadcasts rank 0's buffers before every forward.
A graph cannot send anything before its guards passed, so a distributed step broadcasts them
right after each step instead (one coalesced broadcast per dtype): the next forward sees rank
0's buffers on every rank, as with DDP, and so do evaluations between steps; only between a
step and the next one do other ranks hold rank 0's updated running statistics rather than
their own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..guards.sources import PINNED


def step_state(cap, slots, cells, globals_, builtins_) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` to broadcast for capture ``cap``: the parameters and buffers of the
    modules it read (the outermost module on the path of each guarded or input source), then
    the other parameters and leaves it reads; in the same order on every rank that captured
    the same step."""
    roots = {"L": slots, "C": cells, "G": globals_, "B": builtins_, "O": PINNED}
    values: dict = {}

    def value(source):
        if source not in values:
            try:
                values[source] = eval(source.expr(), {}, roots)
            except Exception:
                values[source] = None
        return values[source]

    modules: dict[int, tuple[str, nn.Module]] = {}
    for source in [*cap.input_sources, *(g.source for g in cap.guards if g.source is not None)]:
        chain = []
        while source is not None:
            chain.append(source)
            source = source.parent
        for s in reversed(chain):  # from the root: the outermost module
            obj = value(s)
            if isinstance(obj, nn.Module):
                modules.setdefault(id(obj), (str(s), obj))
                break
    state: dict[int, tuple[str, torch.Tensor]] = {}
    for label, module in modules.values():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            state.setdefault(id(t), (f"{label}.{name}", t))
    for source in cap.input_sources:
        t = value(source)
        if isinstance(t, nn.Parameter) or any(t is leaf for leaf in cap.distributed_leaves):
            state.setdefault(id(t), (str(source), t))
    for leaf in cap.distributed_leaves:  # read through a path we could not evaluate
        state.setdefault(id(leaf), ("<leaf>", leaf))
    return list(state.values())


def from_rank0(tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, 0)


def sync_buffers(buffers: list[torch.Tensor]) -> None:
    """Rank 0's values into ``buffers`` on every rank: one broadcast per dtype."""
    by_dtype: dict = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in group])
            dist.broadcast(flat, 0)
            offset = 0
            for b in group:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
