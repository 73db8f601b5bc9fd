"""Tiered execution (``backend="auto"``, the default), differential against eager: a hot
training step compiled in the background and kept only when measured faster, a slower
candidate rejected and remembered, a candidate that raises at run time sent back to ``fx``,
no call waiting for a compile, small graphs and ``exact=True`` staying bit-identical."""
import copy
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch import entry_function, tiering
from specularch.config import OPTIONS
from specularch.fx_lower.backends import BACKENDS, get_backend, register_backend
from specularch.tiering import policy

from differential import assert_same, lm_train_step, mse_train_step
from specularch.workloads import lstm_lm

pytestmark = pytest.mark.usefixtures("no_profiling")


class SmallLeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2 = nn.Linear(256, 64), nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _pair(make_model, lr=0.01):
    """An eager training step and an optimized one on two copies of one model (Adam)."""
    torch.manual_seed(0)
    model = make_model()
    twin = copy.deepcopy(model)
    eager = mse_train_step(twin, torch.optim.Adam(twin.parameters(), lr=lr))
    opt = mse_train_step(model, torch.optim.Adam(model.parameters(), lr=lr))
    return eager, specularch.optimize(opt), model, twin


def _batches(shape, outputs, count):
    torch.manual_seed(1)
    return [(torch.randn(*shape), torch.randn(shape[0], outputs)) for _ in range(count)]


def _run(eager, opt, batches, rtol=0.0):
    for x, y in batches:
        expected, got = eager(x, y), opt(x, y)
        assert got == pytest.approx(expected, rel=rtol, abs=rtol * 1e-3)


def _graph(fn):
    """The step's graph with ``.grad`` set (the first call, ``.grad`` None, has its own)."""
    return specularch.explain(fn).graphs[-1]


def _settle(opt, batches, eager):
    """Calls until every candidate of the (single) graph is decided."""
    entry = opt.__specularch_state__.entries[0]
    for _ in range(40):
        assert tiering.wait(timeout=120)
        if entry.tier.settled:
            return entry
        _run(eager, opt, batches, rtol=1e-4)
    raise AssertionError(f"tiering did not settle: {entry.tier.lines()}")


@pytest.fixture
def low_thresholds():
    with specularch.config.patch(tier_min_hits=3, tier_min_seconds=1e-6, tier_trial_calls=2):
        yield


@pytest.fixture
def candidates(monkeypatch):
    """``candidates(*names)``: the backends tried in the background, instead of the real list
    (Inductor's compile takes seconds to minutes)."""
    def set_(*names):
        monkeypatch.setattr(policy, "CANDIDATES", names)
    return set_


@pytest.fixture
def test_backend():
    """``test_backend(name, compile_fn)`` registers a backend for the test only."""
    added = []

    def add(name, compile_fn):
        register_backend(name, compile_fn, help="a test backend")
        added.append(name)
    yield add
    tiering.wait(timeout=60)
    for name in added:
        BACKENDS.pop(name)


def spin(seconds):
    """Compute for ``seconds`` of this thread's CPU time: what a trial measures (a sleeping
    call would cost it nothing, like a call preempted by another job)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _fx(gm, inputs):
    return get_backend("fx").compile(gm, inputs)


def test_hot_training_step_moves_to_torchscript_in_the_background(low_thresholds, candidates):
    candidates("torchscript")
    eager, opt, model, twin = _pair(SmallLeNet)
    batches = _batches((8, 1, 28, 28), 10, 4)
    _run(eager, opt, batches * 2, rtol=1e-5)
    entry = _settle(opt, batches, eager)
    _run(eager, opt, batches * 3, rtol=1e-4)
    (event,) = entry.tier.events
    assert event.candidate == "torchscript" and event.compile_seconds > 0
    assert event.candidate_us > 0 and event.current_us > 0 and event.against == "fx"
    graph = _graph(opt)
    assert graph.backend == entry.tier.tier
    if event.decision == "kept":  # (it is, on LeNet: 1.6x; the test holds either way)
        assert graph.backend == "torchscript"
    else:
        assert event.decision == "rejected" and graph.backend == "fx"
    assert entry.fn is not None and not isinstance(entry.fn, tiering.Tier)  # no wrapper left
    text = str(specularch.explain(opt))
    assert "torchscript: " + event.decision in text and "µs/call vs fx" in text
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p, rtol=1e-4, atol=1e-6)


def test_slower_candidate_is_rejected_and_remembered(low_thresholds, candidates, test_backend):
    def slow(gm, inputs):
        fn = _fx(gm, inputs)

        def run(*args):
            spin(0.03)  # far above this machine's noise on a tiny step
            return fn(*args)
        return run
    test_backend("slow_fx", slow)
    candidates("slow_fx")
    eager, opt, _, _ = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches)
    entry = _settle(opt, batches, eager)
    _run(eager, opt, batches * 4)  # bit-identical: fx ran every call that returned
    (event,) = entry.tier.events
    assert event.decision == "rejected"
    assert event.candidate_us > event.current_us + 20000
    assert _graph(opt).backend == "fx" and tiering.pending() == 0
    assert "slow_fx: rejected" in str(specularch.explain(opt))


def test_candidates_reuse_the_captures_entry_code(low_thresholds, candidates, test_backend,
                                                  monkeypatch):
    """Each candidate's entry runs the code generated and compiled at capture (no entry is
    generated on the background thread), with its own graph as ``GRAPH``; results are
    eager's, with fx's early release of old gradients and without it."""
    seen = {}  # backend -> [(entry code, its GRAPH is this backend's graph, EARLY)]

    def recording(name):
        def compile_fn(gm, inputs):
            fn = _fx(gm, inputs)

            def run(*args):
                caller = sys._getframe(1)
                if caller.f_code.co_name == "entry":  # (not the worker's warm-up call)
                    seen.setdefault(name, []).append(
                        (caller.f_code, caller.f_globals["GRAPH"] is run, caller.f_globals["EARLY"]))
                return fn(*args)
            return run
        return compile_fn
    test_backend("first", recording("first"))
    test_backend("second", recording("second"))
    candidates("first", "second")
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches, rtol=1e-5)  # both graphs captured (.grad None, then set)
    generated = []
    monkeypatch.setattr(entry_function, "compile", lambda *a: generated.append(a) or compile(*a),
                        raising=False)
    entry = _settle(opt, batches, eager)
    _run(eager, opt, batches * 2, rtol=1e-4)
    assert [e.candidate for e in entry.tier.events] == ["first", "second"]
    assert set(seen) == {"first", "second"}
    assert generated == [], "an entry was generated again for a candidate"
    codes = {id(code) for calls in seen.values() for code, _, _ in calls}  # (equal codes compare equal)
    assert len(codes) == 1
    assert all(own and not early for calls in seen.values() for _, own, early in calls)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p, rtol=1e-4, atol=1e-6)


def test_warm_up_makes_a_graphs_own_number_of_calls():
    calls = []

    def graph(x):
        calls.append("graph")
        return (x + 1,)

    def package(x):
        calls.append("package")
        return (x + 1,)
    package.warm_calls = 1  # (an AOTInductor package's, load_inductor_artifact)
    x = torch.randn(3)
    tiering.worker.warm_up(graph, [x])
    tiering.worker.warm_up(package, [x])
    assert calls == ["graph"] * tiering.worker.WARM_CALLS + ["package"]


def test_candidate_raising_in_its_trial_leaves_the_graph_on_fx(low_thresholds, candidates,
                                                               test_backend):
    def raising(gm, inputs):
        def run(*args):
            raise RuntimeError("compiled kernel failed")
        return run
    test_backend("raising", raising)
    candidates("raising")
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches)
    entry = _settle(opt, batches, eager)
    _run(eager, opt, batches * 2)
    (event,) = entry.tier.events
    assert event.decision == "raised at run time" and "compiled kernel failed" in event.reason
    assert _graph(opt).backend == "fx"
    assert not specularch.explain(opt).fallbacks
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p)


def test_kept_candidate_raising_later_goes_back_to_fx(low_thresholds, candidates, test_backend,
                                                      monkeypatch):
    calls = [0]

    def flaky(gm, inputs):
        fn = _fx(gm, inputs)

        def run(*args):
            calls[0] += 1
            if calls[0] > 30:
                raise RuntimeError("stale kernel")
            return fn(*args)
        return run
    test_backend("flaky", flaky)
    candidates("flaky")
    monkeypatch.setattr(policy, "MARGIN", -100.0)  # kept whatever it measures
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches)
    entry = _settle(opt, batches, eager)
    assert entry.tier.tier == "flaky" and _graph(opt).backend == "flaky"
    _run(eager, opt, batches * 6)  # the candidate raises from its 31st call on
    assert calls[0] > 30
    graph = _graph(opt)
    assert graph.backend == "fx"
    assert [e.decision for e in opt.__specularch_state__.entries[0].tier.events] == \
        ["kept", "raised at run time"]
    assert "flaky: raised at run time" in "\n".join(graph.tiers)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p)


def test_no_call_waits_for_a_background_compile(low_thresholds, candidates, test_backend):
    gate, started = threading.Event(), threading.Event()

    def gated(gm, inputs):
        started.set()
        assert gate.wait(timeout=60)
        return _fx(gm, inputs)
    test_backend("gated", gated)
    candidates("gated")
    eager, opt, _, _ = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    try:
        _run(eager, opt, batches * 3)  # hot after 3 calls; its compile blocks on the gate
        assert started.wait(timeout=30)
        assert tiering.pending() == 1 and not tiering.wait(timeout=0.01)
        _run(eager, opt, batches * 3)  # still running (on fx) while the compile waits
        assert _graph(opt).backend == "fx"
        assert opt.__specularch_state__.entries[0].tier.submitted_at is not None
    finally:
        gate.set()
    entry = _settle(opt, batches, eager)
    assert [e.candidate for e in entry.tier.events] == ["gated"]


def test_small_graphs_stay_on_fx_bit_identical():
    default = OPTIONS["tier_min_seconds"].default  # conftest raises it
    with specularch.config.patch(tier_min_seconds=default):
        eager, opt, model, twin = _pair(_mlp)
        _run(eager, opt, _batches((8, 16), 4, 30))
    assert specularch.config.backend == "auto"
    report = specularch.explain(opt)
    assert all(g.backend == "fx" and "not hot enough" in g.tiers[0] for g in report.graphs), [(g.backend, g.tiers) for g in report.graphs]
    assert tiering.pending() == 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p)


def test_random_graph_with_a_rolled_loop_is_not_compiled_beside_the_program(low_thresholds,
                                                                             candidates):
    """A rolled loop's body compiles on a warm-up run, which would draw from the program's
    generator: a graph with one that draws random numbers stays on its tier (forward graphs
    and steps without rolled loops: tests/test_tiering_random.py)."""
    candidates("torchscript")
    torch.manual_seed(0)
    model = lstm_lm.LSTMLM(30, 8, 2, dropout=0.2)
    twin = copy.deepcopy(model)
    eager = lm_train_step(twin, torch.optim.SGD(twin.parameters(), lr=0.5))
    opt = specularch.optimize(lm_train_step(model, torch.optim.SGD(model.parameters(), lr=0.5)))
    data = torch.Generator().manual_seed(1)
    for i, n in enumerate([5, 7, 6, 9, 5, 8, 7, 6, 5, 9, 6, 7]):
        tokens, targets = (torch.randint(0, 30, (n, 4), generator=data) for _ in range(2))
        torch.manual_seed(100 + i)
        expected = eager(tokens, targets)
        torch.manual_seed(100 + i)
        assert_same(expected, opt(tokens, targets), rtol=1e-5, atol=1e-7)
    assert tiering.wait(timeout=60)
    events = [e for entry in specularch.api._state_of(opt).entries for e in entry.tier.events]
    assert events and all(e.decision == "refused" and "random" in e.reason for e in events), events
    assert tiering.pending() == 0


@pytest.mark.parametrize("pinned", ["fx", "exact"])
def test_pinned_backend_or_exact_is_not_tiered(low_thresholds, pinned):
    torch.manual_seed(0)
    model = _mlp()
    twin = copy.deepcopy(model)
    kwargs = {"exact": True} if pinned == "exact" else {"backend": "fx"}
    opt = specularch.optimize(mse_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                              **kwargs)
    eager = mse_train_step(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
    _run(eager, opt, _batches((8, 16), 4, 12))
    assert all(g.backend == "fx" and g.tiers == [] for g in specularch.explain(opt).graphs)
    assert tiering.pending() == 0


def test_exact_cannot_take_a_compiling_backend():
    with pytest.raises(ValueError, match="exact=True"):
        specularch.optimize(lambda x: x, backend="torchscript", exact=True)
