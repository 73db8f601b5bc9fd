"""A candidate for a graph that draws random numbers must draw eager's: the same numbers from
the same generator, so that the program's results and its generator's state after each call
are what eager's would be (the README's promise). TorchScript calls eager's random ops and
Inductor is compiled with ``fallback_random``, so both should; ``Checked`` makes sure of it on
the candidate's first calls of its trial, before any of its results is timed or kept.

On such a call the graph runs twice from the same generator state: first the reference (the
graph's ``fx`` code, eager's numbers), then the candidate. The candidate's result is used
when it left the generator where the reference did and its outputs are within float rounding
of the reference's; otherwise the state is put back and ``DrawsOtherNumbers`` is raised: the
trial drops the candidate and the current tier runs the call, as for any candidate that
raises. Graphs are functions of their inputs (the commit writes their results afterwards),
so running one twice changes nothing but the generator, which is restored.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..fx_lower.randomness import generator_states, restore_generators, same_generator_states

RTOL, ATOL = 1e-3, 1e-5  # float rounding of a compiled graph; another mask is far outside


class DrawsOtherNumbers(RuntimeError):
    """The candidate's random numbers (or the outputs they give) are not eager's."""


def _close(got, expected) -> bool:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or (got.shape, got.dtype) != (expected.shape, expected.dtype):
            return False
        if not expected.is_floating_point() and not expected.is_complex():
            return torch.equal(got, expected)
        return torch.allclose(got.detach(), expected.detach(), rtol=RTOL, atol=ATOL,
                              equal_nan=True)
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and \
            all(_close(g, e) for g, e in zip(got, expected))
    if isinstance(expected, float):
        return isinstance(got, (int, float)) and abs(got - expected) <= ATOL + RTOL * abs(expected)
    return True  # other values do not come from random numbers


class Checked:
    """``candidate``'s graph function, checked against ``reference`` on each call."""

    def __init__(self, candidate: Callable, reference: Callable):
        self.candidate, self.reference = candidate, reference

    def __call__(self, *args):
        before = generator_states()
        expected = self.reference(*args)
        after = generator_states()
        restore_generators(before)
        got = self.candidate(*args)
        if not same_generator_states(after, generator_states()):
            restore_generators(before)
            raise DrawsOtherNumbers("its random numbers are not eager's: it left the "
                                    "generator in another state")
        if not _close(got, expected):
            restore_generators(before)
            raise DrawsOtherNumbers("its random numbers are not eager's: its outputs differ "
                                    "from the fx graph's beyond float rounding")
        return got


class FirstCallsChecked:
    """A pinned backend's compiled form of a graph that draws random numbers, ``Checked``
    against the graph's ``fx`` code on its first ``calls`` calls. Where it draws other numbers
    (AOT autograd's decomposition of a multi-layer ``nn.LSTM`` leaves out the dropout between
    layers), the call's result is the ``fx`` code's and every later call runs the ``fx`` code
    (``note`` says why); otherwise, after those calls, only the compiled form runs."""

    def __init__(self, compiled: Callable, reference: Callable, backend: str, calls: int = 2):
        self.wrapped, self.reference, self.backend = compiled, reference, backend
        self.checked, self.left, self.note = Checked(compiled, reference), calls, ""
        for name in ("from_compile_cache", "artefact_note"):  # explain() reads them
            if hasattr(compiled, name):
                setattr(self, name, getattr(compiled, name))

    def __call__(self, *args):
        if self.left <= 0:
            return (self.reference if self.note else self.wrapped)(*args)
        self.left -= 1
        try:
            return self.checked(*args)
        except DrawsOtherNumbers as e:  # the generator is back where it was before the call
            self.left, self.note = 0, f"backend {self.backend!r} dropped: {e}; runs 'fx'"
            return self.reference(*args)
