"""A trial's calls of a forward graph whose results need autograd, timed with their backward.

The program calls such a graph (``specularch.optimize(model)``) and later runs the backward
itself (``loss.backward()``): timing only the call compares forward passes, and a candidate
with a faster forward and a slower backward (Inductor's on LeNet: its step 0.69x eager) was
kept. Each timed call's sample is therefore its forward's time plus its backward's: from
when the backward reaches the first of the call's outputs (a tensor hook) to the end of that
backward run (``_torch_autograd.at_end_of_backward``), on the same clock. What the backward
does beyond the graph (the loss's own backward before it, gradients accumulated into
parameters, layers before the graph) is the same on both sides of the trial. A call whose
outputs get no backward before the graph is called again counts its forward alone
(``Trial._flush``). The eager tier's run happens after the call returns: its timer
(``eager_tier.RunTimer``) attaches the backward timing to the run's result.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..fx_lower._torch_autograd import at_end_of_backward


def grad_outputs(result) -> list[torch.Tensor]:
    """The tensors that require grad in a call's result (a tensor, or a tuple, list or dict
    of them, one level deep)."""
    if isinstance(result, torch.Tensor):
        values = [result]
    elif isinstance(result, (tuple, list)):
        values = list(result)
    elif isinstance(result, dict):
        values = list(result.values())
    else:
        return []
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


class BackwardTimer:
    """Times the backward through one call's ``outputs`` and hands ``record(forward +
    backward)`` the total, once; ``forward`` is the call's own time."""

    __slots__ = ("clock", "forward", "record", "began", "side")

    def __init__(self, clock: Callable[[], float], forward: float, side: int,
                 record: Callable[["BackwardTimer", float], None]):
        self.clock, self.forward, self.side, self.record = clock, forward, side, record
        self.began = None

    def attach(self, outputs: list[torch.Tensor]) -> None:
        for tensor in outputs:
            tensor.register_hook(self._reached)

    def _reached(self, grad):
        if self.began is None:
            self.began = self.clock()
            at_end_of_backward(self._ended)
        return None

    def _ended(self) -> None:
        self.record(self, self.forward + self.clock() - self.began)
