"""The tracer's contract: one ``Assumptions`` object in, every field declared by
``Tracer.__init__`` (no state added to a tracer later by the modules that use it), and the
captures that exercise that state still agree with eager."""
from __future__ import annotations

import time

import pytest
import torch

import specularch
import specularch.symbolic.capture as capture_module
from specularch.guards.sources import LocalSource
from specularch.symbolic.assumptions import Assumptions


@pytest.fixture
def tracers(monkeypatch):
    """Every Tracer made while the test runs, with the fields its ``__init__`` declared."""
    made = []

    class Recording(capture_module.Tracer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((self, set(vars(self))))

    monkeypatch.setattr(capture_module, "Tracer", Recording)
    return made


def _in_inference_mode(x):
    with torch.inference_mode():
        y = x * 2
    return y + 1


def _handles_an_exception(x):
    try:
        raise ValueError("no")
    except ValueError as e:
        message = str(e)
    return x + 1, message


def _reads_a_clock(x):
    start = time.perf_counter()
    y = x * 3
    return y, type(start), time.perf_counter() - start


@pytest.mark.parametrize("fn", [_in_inference_mode, _handles_an_exception, _reads_a_clock])
def test_capture_adds_no_field_the_tracer_did_not_declare(tracers, fn, no_profiling):
    x = torch.randn(3)
    opt = specularch.optimize(fn)
    expected, got = fn(x), opt(x)
    if fn is _reads_a_clock:  # two clock readings: equal types, not equal times
        expected, got = expected[:2] + (type(expected[2]),), got[:2] + (type(got[2]),)
    if isinstance(expected, tuple):
        assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    else:
        assert torch.equal(got, expected)
    assert specularch.explain(opt).stats.fallback_calls == 0
    assert tracers, "the call was not captured"
    for tracer, declared in tracers:
        assert set(vars(tracer)) == declared, set(vars(tracer)) - declared


def test_assumptions_are_a_snapshot_of_what_the_dispatcher_learnt():
    sites, dims = {("code", 1)}, {0: {1}}
    assumptions = Assumptions(unstable_sites=sites, dynamic_dims=dims,
                              append_only={LocalSource(0, "xs")})
    sites.add(("code", 2))
    dims[0].add(0)
    dims[1] = {0}
    assert assumptions.unstable_sites == frozenset({("code", 1)})
    assert dict(assumptions.dynamic_dims) == {0: frozenset({1})}
    with pytest.raises(TypeError):
        assumptions.dynamic_dims[2] = frozenset()
    with pytest.raises(AttributeError):
        assumptions.append_only = frozenset()


def test_assumptions_refuse_a_malformed_dynamic_dims():
    with pytest.raises(TypeError, match="argument slots"):
        Assumptions(dynamic_dims={"x": {0}})


def test_the_tracer_keeps_its_own_copy_of_the_unstable_sites(tracers, no_profiling):
    """A capture may speculate an unstable site again (raising_branch.py); that must not
    change the assumptions the dispatcher handed in."""
    def f(x):
        return x * 2

    specularch.optimize(f)(torch.randn(2))
    tracer, _ = tracers[0]
    tracer.unstable_sites.add(("site", 0))
    assert ("site", 0) not in tracer.assumptions.unstable_sites
