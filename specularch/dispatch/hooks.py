"""Hook points for data-parallel training steps (``torch.distributed``).

The dispatcher never imports ``specularch.distributed``: it asks ``hooks.distributed``,
an object with the methods of ``SingleProcess`` below. ``SingleProcess`` is the behaviour of
one process (no collectives, nothing to agree on); ``specularch.distributed`` installs its own
with ``install`` when it is imported (``specularch`` imports it), and that object decides
per call whether ``torch.distributed`` is active.
"""
from __future__ import annotations

from typing import Any, Callable


class SingleProcess:
    """What the dispatcher asks of distributed training; each method says when it is asked."""

    def active(self) -> bool:
        """Asked before profiling, eager runs and at a graph that raised: is the process one
        of several ranks? (Their eager steps would not average gradients.)"""
        return False

    def start_capture(self) -> None:
        """Before each capture."""

    def capture_reached_backward(self) -> bool:
        """After a capture failed: did it get past a ``backward()`` it turned into the
        averaged exchange? (The path is then a distributed step even though it runs eagerly.)"""
        return False

    def step_state(self, cap, slots, cells, globals_, builtins_) -> list:
        """A fresh capture of a distributed step (``cap.distributed_leaves``): the
        ``(path, tensor)`` parameters and buffers the step reads."""
        return []

    def start_from_rank0(self, state, named: list) -> None:
        """Before a distributed step's new graph first runs, with ``step_state``'s list."""

    def wrap_entry(self, fn: Callable, buffers: list) -> Callable:
        """The entry of a distributed step's graph, given the buffers to keep equal."""
        return fn

    def graph_raised_late(self, error: Exception) -> bool:
        """Whether a step's graph that raised ``error`` got too far for another backend to
        rerun it (the ranks already exchanged its header, or agreed it fails)."""
        return False

    def step_graph_raised(self, state, error: Exception, fallback: Callable) -> Any:
        """A distributed step's graph raised ``error``; ``fallback(Unsupported)`` records it
        and runs the original."""
        raise error

    def refuse_strict(self, state, record, reaches_backward: bool) -> None:
        """Strict mode is about to raise for an eager run: tell the other ranks first."""

    def run_eager(self, state, slots, cells, record, reaches_backward: bool) -> Any:
        """Run the original while ``active()``: only called then."""
        raise NotImplementedError("SingleProcess is never active")


distributed = SingleProcess()


def install(hooks: SingleProcess) -> None:
    """Make ``hooks`` answer the dispatcher's questions about distributed steps."""
    global distributed
    distributed = hooks
