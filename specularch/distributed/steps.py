"""What the dispatcher does differently for a distributed training step: the hook points of
``specularch.dispatch.hooks``, installed when this package is imported.

A distributed step is an optimized function whose capture turned ``backward()`` into the
averaged gradient exchange (``cap.distributed_leaves``). Its graph's entry resets the call's
agreement and keeps buffers equal to rank 0's; its first run takes rank 0's parameters and
buffers; a rank that cannot run it as a graph tells the other ranks, and an eager run that
would reach an unaveraged ``backward()`` is refused (``eager.py``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from .. import frames
from ..dispatch import hooks
from ..entry_function import MISS
from ..records import Unsupported
from . import agreement, broadcast, eager
from .allreduce import active


class DistributedSteps(hooks.SingleProcess):
    """The dispatcher's hooks while ``torch.distributed`` may be in use."""

    def active(self) -> bool:
        return active()

    def start_capture(self) -> None:
        eager.start_capture()

    def capture_reached_backward(self) -> bool:
        return eager.capture_reached_backward()

    def step_state(self, cap, slots, cells, globals_, builtins_) -> list:
        return broadcast.step_state(cap, slots, cells, globals_, builtins_)

    def start_from_rank0(self, state, named: list) -> None:
        _start_from_rank0(state, named)

    def wrap_entry(self, fn: Callable, buffers: list) -> Callable:
        return _step_entry(fn, buffers)

    def graph_raised_late(self, error: Exception) -> bool:
        return agreement.header_issued() or isinstance(error, agreement.DistributedStepError)

    def step_graph_raised(self, state, error: Exception, fallback: Callable) -> Any:
        return _step_graph_raised(state, error, fallback)

    def refuse_strict(self, state, record, reaches_backward: bool) -> None:
        if reaches_backward or _is_step(state):
            agreement.reset_call()  # the other ranks wait for this step's header
            agreement.refuse(state.target.name, record.kind, record.explanation)

    def run_eager(self, state, slots, cells, record, reaches_backward: bool) -> Any:
        return _run_eager(state, slots, cells, record, reaches_backward)


def _step_entry(fn: Callable, buffers: list) -> Callable:
    """A distributed step's entry: each call starts without its header sent; after a step
    that ran, every rank takes rank 0's buffers (DDP's ``broadcast_buffers``)."""
    reset = agreement.reset_call
    sync = broadcast.sync_buffers
    digest = agreement.layout_hash([(tuple(b.shape), str(b.dtype)) for b in buffers])

    def entry(slots, cells, globals_, builtins_):
        reset(digest)
        result = fn(slots, cells, globals_, builtins_)
        if buffers and result is not MISS:
            sync(buffers)
        return result
    return entry


def _start_from_rank0(state, named: list) -> None:
    """Before a distributed step's new graph first runs: if it reads parameters or buffers
    this step never broadcast, every rank agrees (all captured the same step), then rank 0's
    values are broadcast. Otherwise nothing is sent here: the graph's own header agrees."""
    sent = state.broadcast
    new = [(path, t) for path, t in named
           if sent.get(id(t)) is None or sent[id(t)]() is not t]
    if not new:
        return
    header = agreement.Header(
        state.target.name, phase=agreement.Header.BROADCAST,
        digest=agreement.layout_hash([(p, tuple(t.shape), str(t.dtype)) for p, t in new]))
    if header.verdict() is not None:
        raise header.verdict()
    broadcast.from_rank0([t for _, t in new])
    for _, t in new:
        sent[id(t)] = weakref.ref(t)


def _step_graph_raised(state, error: Exception, fallback: Callable) -> Any:
    """A distributed step's graph raised. Before its header was sent, the other ranks wait for
    this rank: run the original (an error of the user's code raises again and the other ranks
    are told; an eager ``backward()`` is refused). After it, only this rank knows: say so."""
    if isinstance(error, agreement.DistributedStepError):  # every rank raises it
        raise error
    what = f"the compiled graph raised {type(error).__name__}: {error}"
    if agreement.header_issued():
        raise agreement.DistributedStepError(
            f"specularch: distributed training step {state.target.name}: {what} after the "
            f"gradients were exchanged; nothing was committed on this rank (rank "
            f"{agreement.rank()}), but the other ranks may have finished this step: stop "
            f"training.") from error
    fallback(Unsupported("exception_handling", what))  # the user's error: raised, others told
    raise agreement.refuse(state.target.name, "backend_error",
                           f"{what}, but the original code does not")


def _run_eager(state, slots, cells, record, reaches_backward: bool) -> Any:
    """The original Python while ``torch.distributed`` is active: an eager ``backward()``
    would not average gradients over ranks, so it is refused (the other ranks are told) unless
    DDP averages it; a distributed step that raises tells the other ranks too."""
    why = f"{record.explanation} ({record.location})"
    agreement.reset_call()
    if reaches_backward:  # known from its capture: stop before running anything
        raise agreement.refuse(state.target.name, record.kind, why)
    try:
        with frames.hook_active(), eager.WatchBackward(state.target.name, record.kind, why):
            return state.target.call_original(slots, cells)
    except agreement.DistributedStepError:
        raise
    except Exception as e:
        if _is_step(state):  # the other ranks wait for this step's header
            agreement.refuse(state.target.name, "error", f"{type(e).__name__}: {e}")
        raise


def _is_step(state) -> bool:
    return bool(state.broadcast) or any(e.capture.distributed_leaves for e in state.entries) \
        or any(e.reaches_backward for e in state.eager)


hooks.install(DistributedSteps())
