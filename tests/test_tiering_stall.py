"""No step of the program pays for tiering's background work (issue 14's "no step waits on a
compile"), tested without timing: a compiled candidate's first calls (TorchScript's
profiling and optimisation, Inductor's kernel loading) run on the background thread on copies
of the inputs before its trial; one warm worker process serves every candidate; a worker that
crashes or hangs still leaves the graph on ``fx``; a second run loads its compiled code from
the persistent compile cache without a worker. Results differential against eager."""
import threading
import time

import pytest
from torch import nn

import specularch
from specularch import tiering
from specularch.tiering import policy, process, worker

import test_tiering
from test_tiering import _batches, _fx, _mlp, _pair, _run, _settle

low_thresholds, candidates, test_backend = \
    test_tiering.low_thresholds, test_tiering.candidates, test_tiering.test_backend  # fixtures

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


class _CountingWorker(process._Worker):
    """The real worker process, counting how many were started and how many jobs each ran."""
    started: list = []

    def __init__(self, command, may_fork=True):
        super().__init__(command, may_fork)
        self.jobs = 0
        _CountingWorker.started.append(self)

    def run(self, folder, timeout):
        self.jobs += 1
        return super().run(folder, timeout)


@pytest.fixture
def counted_workers(monkeypatch, tmp_path):
    """Real worker processes, fresh for the test and counted; graphs hot after 3 calls."""
    process.shut_down()
    _CountingWorker.started = []
    monkeypatch.setattr(process, "_Worker", _CountingWorker)
    with specularch.config.patch(tier_min_hits=3, tier_min_seconds=1e-6, tier_trial_calls=2):
        yield _CountingWorker.started
    tiering.wait(timeout=300)
    process.shut_down()


def _models_stepped(make_models, shape, outputs, calls=40):
    """Eager and optimized training steps of each model, run side by side until settled."""
    pairs = [_pair(make) for make in make_models]
    batches = _batches(shape, outputs, 3)
    for _ in range(calls):
        for eager, opt, _, _ in pairs:
            _run(eager, opt, batches, rtol=1e-4)
        tiering.wait(timeout=300)
        if all(_settled(opt) for _, opt, _, _ in pairs) and tiering.pending() == 0:
            break
    else:
        raise AssertionError("tiering did not settle")
    for _, _, model, twin in pairs:
        for p, q in zip(model.parameters(), twin.parameters()):
            assert p.detach().allclose(q.detach(), rtol=1e-4, atol=1e-6)
    return [opt for _, opt, _, _ in pairs]


def _settled(opt) -> bool:
    """Some graph of ``opt`` was hot, and every hot one is decided."""
    hot = [e.tier for e in opt.__specularch_state__.entries
           if e.tier is not None and e.tier.submitted_at is not None]
    return bool(hot) and all(t.settled for t in hot)


def _worker_events(opt):
    return [e for entry in opt.__specularch_state__.entries if entry.tier is not None
            for e in entry.tier.events]


def test_one_warm_worker_compiles_every_candidate(counted_workers, candidates):
    candidates("torchscript")
    wide = lambda: nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))  # noqa: E731
    opts = _models_stepped([_mlp, wide], (8, 16), 4)
    events = [e for opt in opts for e in _worker_events(opt)]
    assert len(events) >= 2, events
    assert all(e.compiled_in == "worker process" and e.decision in ("kept", "rejected")
               for e in events), [str(e) for e in events]
    (only,) = counted_workers
    assert only.jobs == len(events) and only.child.poll() is None  # still warm


def test_worker_is_started_before_the_first_graph_is_hot(counted_workers, candidates,
                                                         monkeypatch):
    candidates("torchscript")
    hot = []
    monkeypatch.setattr(policy, "hot", lambda hits, seconds: bool(hot))
    eager, opt, _, _ = _pair(_mlp)
    batches = _batches((8, 16), 4, 3)
    _run(eager, opt, batches * 3)  # a quarter of the way to hot (and more), not hot
    assert tiering.pending() == 0 and all(e.tier.submitted_at is None
                                          for e in opt.__specularch_state__.entries)
    for _ in range(100):
        if counted_workers:
            break
        time.sleep(0.05)  # (it is started on a thread of its own)
    (prestarted,) = counted_workers
    hot.append(True)
    _models_settle(opt, eager, batches)
    assert counted_workers == [prestarted] and prestarted.jobs >= 1
    assert all(e.compiled_in == "worker process" for e in _worker_events(opt))


def _models_settle(opt, eager, batches):
    for _ in range(40):
        _run(eager, opt, batches, rtol=1e-4)
        assert tiering.wait(timeout=300)
        if _settled(opt):
            return
    raise AssertionError("tiering did not settle")


@pytest.mark.parametrize("backend", ["torchscript"])
def test_second_run_loads_the_worker_s_code_from_the_compile_cache(counted_workers, candidates,
                                                                    monkeypatch, tmp_path,
                                                                    backend):
    """A second run (the same program, a fresh process's state) finds each candidate the
    first run's worker compiled in the persistent compile cache: loaded, no worker job.
    (Inductor's package from the cache, in a second process: test_tiering_aoti.py; this
    test with ``inductor`` compiled one for 28 s of the suite's time.)"""
    candidates(backend)
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)  # keep it
    # Set, not patched: a patch is seen by this thread only, not by the background one.
    before, specularch.config.compile_cache_dir = specularch.config.compile_cache_dir, \
        str(tmp_path / "cache")
    try:
        first = _models_stepped([_mlp], (8, 16), 4)[0]
        assert {e.compiled_in for e in _worker_events(first)} == {"worker process"}
        jobs = sum(w.jobs for w in counted_workers)
        specularch.reset()
        second = _models_stepped([_mlp], (8, 16), 4)[0]
        # Nor is a worker started before the graph is hot (``prestart``): everything it would
        # compile is in the cache. One candidate more that is not, and it is.
        process.shut_down()
        started = len(counted_workers)
        gm = max(second.__specularch_state__.entries, key=lambda e: e.hits).capture.graph_module
        process._prestart(gm, (backend,))
        assert len(counted_workers) == started and process._current is None
        process._prestart(gm, (backend, {"torchscript": "inductor"}.get(backend, "torchscript")))
        assert len(counted_workers) == started + 1
    finally:
        specularch.config.compile_cache_dir = before
    events = _worker_events(second)
    assert events and {(e.decision, e.compiled_in) for e in events} == \
        {("kept", "from the compile cache")}, [str(e) for e in events]
    assert sum(w.jobs for w in counted_workers) == jobs  # no job in the second run
