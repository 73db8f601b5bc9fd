"""Ranks agree on every distributed training step before any gradient leaves a rank.

Every call of a distributed training step issues exactly one *header* — a small int64
all-reduce (MAX) — before its first gradient all-reduce, on every path it can take:

* a graph (cache hit or fresh capture) issues it at the start of its ``grad_and_allreduce``
  and waits for it right before launching the first gradient bucket (it overlaps the tail of
  the forward and the start of backward);
* a rank that cannot run the step as a graph (capture failed, an eager-only path, a graph
  that raised before its gradient exchange) issues it with the *failed* flag, then raises;
* a fresh capture whose parameters and buffers must first be broadcast from rank 0 issues
  one more header, synchronously, before that broadcast (every rank is on the same fresh
  capture then, or the headers disagree).

Every rank reduces the same vectors, so every rank reaches the same verdict: all run, or all
raise ``DistributedStepError`` (nothing committed on the ranks that ran a graph). The header
also carries a hash of the gradient layout (parameter paths, shapes, dtypes, buckets), so
ranks that captured different steps stop instead of exchanging mismatched buckets.

Collectives never happen while capturing, so a rank that misses its cache and captures while
another rank hits pairs its header with the other's as soon as its new graph runs.
"""
from __future__ import annotations

import threading
import zlib

import torch
import torch.distributed as dist

from ..records import FALLBACK_KINDS

_KINDS = ["error", *FALLBACK_KINDS]  # code 0: an exception raised by the user's code
_LOCAL = threading.local()           # per call: has this rank issued its header yet?
_GROUP = {}                          # default group -> gloo group used for headers


class DistributedStepError(RuntimeError):
    """A distributed training step cannot run on some rank, so it runs on none.

    Example: ``loss.backward()`` in an optimized step under ``torchrun`` where one rank's
    capture fails (``if loss > 10:`` — a branch on a tensor value) would run that rank's step
    eagerly, without averaging its gradients. Instead that rank raises this error naming the
    reason, and every other rank raises it naming that rank; ranks that ran a graph committed
    nothing. Fix the reason shown (``specularch.explain(step)`` lists it), or wrap the model in
    ``DistributedDataParallel`` (a step that cannot be captured then runs eagerly and DDP
    averages its gradients).
    """


def layout_hash(*parts) -> int:
    """A hash equal on every rank for equal ``parts`` (``hash()`` of a str is salted)."""
    data = repr(parts).encode()
    return (zlib.crc32(data) << 31) ^ zlib.crc32(data[::-1])


def _group():
    """Headers travel on gloo (CPU tensors): no device synchronisation to read them."""
    if dist.get_backend() == "gloo":
        return None
    default = dist.group.WORLD  # the default process group
    if default not in _GROUP:
        _GROUP[default] = dist.new_group(backend="gloo")
    return _GROUP[default]


def _vector(failed: bool, kind: str, phase: int, digest: int) -> torch.Tensor:
    if failed:
        code = (dist.get_rank() + 1) * 64 + (_KINDS.index(kind) if kind in _KINDS else 0)
        return torch.tensor([1, code, 0, 0, 0, 0], dtype=torch.int64)
    return torch.tensor([0, 0, phase, -phase, digest, -digest], dtype=torch.int64)


def rank() -> int:
    return dist.get_rank()


def reset_call(buffers_digest: int = 0) -> None:
    """A distributed step's graph (whose buffers, broadcast after it, hash to
    ``buffers_digest``) is about to run: it has not issued its header yet."""
    _LOCAL.issued = False
    _LOCAL.buffers = buffers_digest


def buffers_digest() -> int:
    return getattr(_LOCAL, "buffers", 0)


def header_issued() -> bool:
    return getattr(_LOCAL, "issued", False)


class Header:
    """One rank's header for the current call; ``verdict()`` waits for every rank's."""

    GRAPH, BROADCAST = 1, 2

    def __init__(self, name: str, *, failed: bool = False, kind: str = "error",
                 phase: int = GRAPH, digest: int = 0, async_op: bool = False):
        self.name = name
        self.tensor = _vector(failed, kind, phase, digest)
        _LOCAL.issued = True
        self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, group=_group(),
                                    async_op=async_op)
        self.error: DistributedStepError | None = None
        self.done = not async_op
        if self.done:
            self._decide()

    def _decide(self) -> None:
        failed, code, phase, neg_phase, digest, neg_digest = self.tensor.tolist()
        if failed:
            rank, kind = code // 64 - 1, _KINDS[code % 64]
            self.error = DistributedStepError(
                f"specularch: distributed training step {self.name} stopped on every rank: rank "
                f"{rank} could not run it ([{kind}]; its own error says why). Nothing was "
                f"committed on this rank (rank {dist.get_rank()}).")
        elif phase != -neg_phase or digest != -neg_digest:
            what = ("one rank must first broadcast new parameters from rank 0 while another "
                    "does not" if phase != -neg_phase else
                    "their gradients or buffers differ (other parameters, shapes, order or "
                    "config.distributed_bucket_mb)")
            self.error = DistributedStepError(
                f"specularch: ranks disagree on distributed training step {self.name}: {what}. "
                f"Every rank must run the same step on the same model; nothing was committed "
                f"on this rank (rank {dist.get_rank()}).")

    def verdict(self) -> DistributedStepError | None:
        """None when every rank runs this step, else the error every rank raises."""
        if not self.done:
            self.work.wait()
            self.done = True
            self._decide()
        return self.error


def refuse(name: str, kind: str, why: str) -> DistributedStepError:
    """This rank cannot run step ``name``: tell the others (unless this call already issued
    its header) and return the error to raise here."""
    if not header_issued():
        Header(name, failed=True, kind=kind)
    return DistributedStepError(
        f"specularch: distributed training step {name} cannot run on rank {dist.get_rank()}: "
        f"[{kind}] {why}\nRun eagerly, this rank would not average its gradients with the "
        f"other ranks, so every rank stops here. Make the step capturable (see "
        f"specularch.explain), or wrap the model in DistributedDataParallel (then the step runs "
        f"eagerly and DDP averages the gradients).")
