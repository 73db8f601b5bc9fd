"""No step of the program pays for tiering's background work (issue 14's "no step waits on a
compile"), tested without timing: a compiled candidate's first calls (TorchScript's
profiling and optimisation, Inductor's kernel loading) run on the background thread on copies
of the inputs before its trial; one warm worker process serves every candidate; a worker that
crashes or hangs still leaves the graph on ``fx``; a second run loads its compiled code from
the persistent compile cache without a worker. Results differential against eager."""
import threading

import pytest

import specularch
from specularch import tiering
from specularch.tiering import worker

from test_tiering import _batches, _fx, _mlp, _pair, _run, _settle, candidates, \
    low_thresholds, test_backend  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("no_profiling")


def test_candidate_is_warmed_on_the_background_thread_before_its_trial(
        low_thresholds, candidates, test_backend, monkeypatch):
    monkeypatch.setattr(specularch.tiering.policy, "MARGIN", -100.0)  # kept whatever it measures
    callers = []

    def counting(gm, inputs):
        fn = _fx(gm, inputs)

        def run(*args):
            callers.append(threading.get_ident())
            return fn(*args)
        return run
    test_backend("counting", counting)
    candidates("counting")
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches)
    entry = _settle(opt, batches, eager)
    _run(eager, opt, batches * 2, rtol=1e-6)
    user = threading.get_ident()
    first_user_call = callers.index(user)
    assert first_user_call == worker.WARM_CALLS  # every warm-up call before the first trial call
    assert user not in callers[:first_user_call] and entry.tier.tier == "counting"
    assert callers[first_user_call:].count(user) == len(callers) - first_user_call
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.detach().allclose(q.detach(), rtol=1e-6, atol=1e-7)


def test_warm_up_runs_on_copies_of_the_inputs(low_thresholds, candidates, test_backend):
    """A candidate that updates its inputs in place (as an in-place optimizer update would)
    warms up on copies: the program's parameters are what eager's are."""
    def in_place(gm, inputs):
        fn = _fx(gm, inputs)

        def run(*args):
            if threading.current_thread() is not threading.main_thread():
                for a in args:
                    if hasattr(a, "add_") and a.is_floating_point():
                        a.detach().add_(1.0)
            return fn(*args)
        return run
    test_backend("in_place", in_place)
    candidates("in_place")
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches)
    _settle(opt, batches, eager)
    assert tiering.pending() == 0
    _run(eager, opt, batches * 2, rtol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.detach().allclose(q.detach(), rtol=1e-6, atol=1e-7)
