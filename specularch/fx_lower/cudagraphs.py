"""The ``cudagraphs`` backend: flatten a static-shape graph that needs no autograd to ATen
ops (a whole training step's backward and optimizer update included), capture it once with
``torch.cuda.CUDAGraph`` and replay it.

Replay works on static buffers: each call copies its inputs into the captured input buffers
(parameters and optimizer state too: the commit later updates the real tensors, so the
buffers are this backend's own copies), replays, and clones the outputs out of the static
output buffers before returning, so results (and the values the commit copies into
parameters, ``.grad`` and optimizer state) stay valid after the next replay. The cost is one
extra copy of every input and output per call and of their memory.

Whether a graph needs autograd is decided from the graph, not from its inputs: parameters
always require grad, but a graph captured under ``no_grad`` (or whose results are detached, or
a training step whose in-graph backward the flattening makes explicit) returns nothing that
requires grad, and runs identically without autograd. Graphs whose results need autograd,
with dynamic sizes, random ops (a replay would draw differently from eager), gradient hooks,
or inputs that are not CUDA tensors are refused with a reason (the runtime uses ``fx``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from .backends import flattening_reason
from .randomness import graph_uses_randomness


def supports(gm: torch.fx.GraphModule) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA graphs need a CUDA device; none is available on this machine"
    for node in gm.graph.nodes:
        example = node.meta.get("example") if node.op == "placeholder" else None
        if isinstance(example, torch.Tensor) and not example.is_cuda:
            return "CUDA graphs need every tensor input to be a CUDA tensor"
    return reason_without_device(gm)


def reason_without_device(gm: torch.fx.GraphModule) -> str | None:
    """Everything ``supports`` checks except the device: why the graph cannot be captured
    and replayed as one static CUDA graph, or None."""
    reason = flattening_reason(gm, "a CUDA graph")
    if reason:
        return reason
    if gm.meta.get("dynamic_dims"):
        return "it has dynamic sizes (a CUDA graph replays the sizes it was recorded with)"
    if gm.meta.get("outputs_require_grad"):
        return ("its results need autograd (captured with grad enabled from inputs that require "
                "grad); CUDA graphs replay graphs that need none: inference under no_grad, or "
                "whole training steps")
    if graph_uses_randomness(gm):
        return "it draws random numbers (a replayed CUDA graph would not draw them like eager)"
    return None


class CudaGraphRecorder:
    """Captures ``fn`` (no arguments; it reads and writes only static buffers) as one CUDA
    graph; ``outputs`` are the static output buffers that ``replay()`` refills."""

    def __init__(self, fn: Callable[[], tuple]):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # allocations and lazy initialisation happen off the graph
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn()

    def replay(self) -> None:
        self.graph.replay()


def compile_cudagraph(gm: torch.fx.GraphModule, example_inputs: list,
                      recorder: Callable = CudaGraphRecorder) -> Callable:
    """``recorder(fn)`` captures ``fn``; another recorder (e.g. one that re-runs ``fn`` and
    copies into the same output buffers) exercises the buffer handling without a GPU."""
    from ._torch_compilers import captured_outputs, flatten
    device = next(t.device for t in example_inputs if isinstance(t, torch.Tensor))
    flat = flatten(gm, example_inputs, tracing_mode="fake", scalar_device=device)
    static = [t.detach().clone() for t in flat.inputs]
    numbers = set(flat.converted)
    graph = flat.graph

    def body():
        with torch.no_grad():
            return tuple(graph(*static))

    recording = recorder(body)

    def run(*inputs):
        with torch.no_grad():
            for i, (buffer, value) in enumerate(zip(static, inputs)):
                if i in numbers:
                    buffer.fill_(value)
                else:
                    buffer.copy_(value)
            recording.replay()
            return captured_outputs([o.clone() for o in recording.outputs], flat.numbers)

    return run
