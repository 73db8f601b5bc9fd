"""Random numbers on every CPU backend, and the capture budget for long Python loops.

RNG: each backend either draws exactly eager's random numbers (dropout, ``torch.rand``,
``randn_like``, ``bernoulli``; values, gradients and the generator's state after the call
equal eager's) or refuses graphs that draw them with a recorded reason (it then runs on
``fx``). Compiling a graph draws nothing, even for a backend that runs it while compiling,
and Inductor's eager-RNG setting is specularch's own, not left set for the user's
``torch.compile``.

Budget: a capture that unrolls a very long loop gives up after about twice what an eager call
costs (the durations the profiling calls measured), is recorded once as ``recursion_limit``
and is not tried again; ordinary captures are untouched."""
import copy
import time

import pytest
import torch
from torch import nn

import specularch
from specularch.fx_lower import cudagraphs
from specularch.fx_lower.backends import BACKENDS, register_backend
from specularch.symbolic import budget
from test_backends import RerunRecorder

TOL = dict(rtol=1e-5, atol=1e-6)
CG_ON_CPU = "cudagraphs_replay_on_cpu_rng"


@pytest.fixture
def cpu_backend(request):
    """The backend named by the test's parameter; cudagraphs is replayed on CPU by re-running
    (every check but the device, as in test_backends)."""
    name = request.param
    if name != CG_ON_CPU:
        yield name
        return
    register_backend(CG_ON_CPU, lambda gm, inputs: cudagraphs.compile_cudagraph(
        gm, inputs, recorder=RerunRecorder), supports=cudagraphs.reason_without_device,
        help="test only: cudagraphs replayed by re-running")
    yield CG_ON_CPU
    BACKENDS.pop(CG_ON_CPU)


CPU_BACKENDS = ["fx", "torchscript", CG_ON_CPU, pytest.param("inductor", marks=pytest.mark.slow)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 2))


def _noisy(model, x):
    h = model(x)
    keep = torch.bernoulli(torch.full_like(h, 0.7))
    return h * keep + torch.rand(h.shape) * torch.randn_like(h)


def _seeded(fn, seed, *args):
    """``fn(*args)`` from a seeded default generator; its result and the generator's state."""
    torch.manual_seed(seed)
    return fn(*args), torch.get_rng_state()


def _ran_or_refused(fast, backend):
    """Each graph ran on ``backend`` itself, or on ``fx`` with a note saying the backend
    refused it for its random numbers."""
    e = specularch.explain(fast)
    assert e.graphs and e.fallbacks == [], str(e)
    for g in e.graphs:
        assert (g.backend, g.note) == (backend, "") or \
            (g.backend == "fx" and "random" in g.note), str(e)
    return e


@pytest.mark.parametrize("cpu_backend", CPU_BACKENDS, indirect=True)
def test_random_inference_matches_eager(cpu_backend, no_profiling):
    model = _model()
    ref = copy.deepcopy(model)
    fast = specularch.optimize(lambda x: _noisy(model, x), backend=cpu_backend)
    with torch.no_grad():
        for call in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(call))
            out, state = _seeded(fast, 100 + call, x)
            expected, ref_state = _seeded(lambda x: _noisy(ref, x), 100 + call, x)
            torch.testing.assert_close(out, expected, **TOL)
            assert torch.equal(state, ref_state), call
    _ran_or_refused(fast, cpu_backend)


@pytest.mark.parametrize("cpu_backend", [b for b in CPU_BACKENDS if b != CG_ON_CPU], indirect=True)
def test_random_forward_and_gradients_match_eager(cpu_backend, no_profiling):
    """Forward and backward compiled separately (AOT autograd) for torchscript and inductor;
    cudagraphs takes no graph whose results need autograd."""
    model = _model()
    ref = copy.deepcopy(model)
    fast = specularch.optimize(lambda x: _noisy(model, x), backend=cpu_backend)
    for call in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(call))
        out, state = _seeded(fast, 100 + call, x)
        expected, ref_state = _seeded(lambda x: _noisy(ref, x), 100 + call, x)
        torch.testing.assert_close(out, expected, **TOL)
        assert torch.equal(state, ref_state), call
        out.square().sum().backward()
        expected.square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL)
    _ran_or_refused(fast, cpu_backend)


def _train_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train_step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(_noisy(model, x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return train_step


@pytest.mark.parametrize("cpu_backend", CPU_BACKENDS, indirect=True)
def test_random_training_step_matches_eager(cpu_backend, no_profiling):
    """The whole step flattened to one graph (torchscript, inductor, cudagraphs)."""
    model = _model()
    ref = copy.deepcopy(model)
    fast, slow = specularch.optimize(_train_step(model), backend=cpu_backend), _train_step(ref)
    for call in range(3):
        g = torch.Generator().manual_seed(call)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        loss, state = _seeded(fast, 100 + call, x, y)
        expected, ref_state = _seeded(slow, 100 + call, x, y)
        torch.testing.assert_close(loss, expected, **TOL)
        assert torch.equal(state, ref_state), call
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL)
    _ran_or_refused(fast, cpu_backend)


def test_cudagraphs_refuses_random_graphs_with_a_reason(no_profiling):
    """A replayed CUDA graph would not draw like eager: the graph runs on fx, and says why."""
    register_backend(CG_ON_CPU, lambda gm, inputs: cudagraphs.compile_cudagraph(
        gm, inputs, recorder=RerunRecorder), supports=cudagraphs.reason_without_device,
        help="test only")
    try:
        model = _model()
        fast = specularch.optimize(_train_step(model), backend=CG_ON_CPU)
        fast(torch.randn(3, 4), torch.randn(3, 2))
        e = specularch.explain(fast)
        assert e.graphs[0].backend == "fx" and "draws random numbers" in e.graphs[0].note, str(e)
    finally:
        BACKENDS.pop(CG_ON_CPU)


def test_a_backend_that_runs_the_graph_while_compiling_draws_nothing(no_profiling):
    """Warm-up runs (a CUDA graph's, ``ts_compile``'s on real inputs, autotuning) while
    compiling must not advance the generator: eager would not have drawn those numbers."""
    def warming_up(gm, example_inputs):
        for _ in range(2):
            gm(*example_inputs)
        return gm.forward

    register_backend("warm_up_test", warming_up, help="test only: runs the graph twice")
    try:
        model = _model()
        ref = copy.deepcopy(model)
        fast = specularch.optimize(lambda x: _noisy(model, x), backend="warm_up_test")
        x = torch.randn(3, 4)
        out, state = _seeded(fast, 7, x)
        expected, ref_state = _seeded(lambda x: _noisy(ref, x), 7, x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert torch.equal(state, ref_state)
        assert specularch.explain(fast).graphs[0].backend == "warm_up_test"
    finally:
        BACKENDS.pop("warm_up_test")


@pytest.mark.slow
def test_inductor_eager_rng_is_set_only_for_specularchs_compiles(no_profiling):
    """Inductor draws its own random numbers unless ``fallback_random`` is on: specularch turns
    it on for its own compiles (the graph then draws eager's numbers: the tests above) and
    leaves the user's setting as it was, for the user's own ``torch.compile``."""
    from torch._inductor import config as inductor_config  # the user's own setting
    # (config.patch, not monkeypatch: monkeypatch's undo deletes the option from torch's
    # config module, and every later Inductor compile then fails)
    with inductor_config.patch(fallback_random=False):
        model = _model()
        ref = copy.deepcopy(model)
        fast = specularch.optimize(lambda x: _noisy(model, x), backend="inductor")
        x = torch.randn(3, 4)
        out, state = _seeded(fast, 3, x)
        expected, ref_state = _seeded(lambda x: _noisy(ref, x), 3, x)
        torch.testing.assert_close(out, expected, **TOL)
        assert torch.equal(state, ref_state)
        assert specularch.explain(fast).graphs[0].backend == "inductor"
        assert inductor_config.fallback_random is False


# ---- the capture budget ---------------------------------------------------------------------

def _long_loop(x):
    for _ in range(60_000):
        x = x + 1
    return x


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def test_long_loop_capture_gives_up_early_and_is_not_retried(monkeypatch):
    x = torch.zeros(2)
    eager, expected = _timed(_long_loop, x)
    attempts = []
    start_budget = budget.for_capture
    monkeypatch.setattr(budget, "for_capture", lambda *a: attempts.append(1) or start_budget(*a))
    fast = specularch.optimize(_long_loop)
    with specularch.config.patch(profile_calls=1):
        profiled, _ = _timed(fast, x)  # runs eagerly, timed for the budget
        eager = min(eager, profiled)
        first, out = _timed(fast, x)  # captures, gives up, runs eagerly
        # Later calls run eagerly; timed next to eager calls of the same loop, so a busy
        # machine (CI's other test process) slows both alike.
        later, beside = [], []
        for _ in range(3):
            later.append(_timed(fast, x))
            beside.append(_timed(_long_loop, x)[0])
    # Before the budget it ran to config.max_instructions: ~15x eager.
    assert first < 1.0 + 4 * eager, (first, eager)
    assert min(t for t, _ in later) < 0.1 + 1.5 * min(beside), (later, beside)
    assert len(attempts) == 1
    for result in [out, *(r for _, r in later)]:
        torch.testing.assert_close(result, expected, rtol=0, atol=0)
    e = specularch.explain(fast)
    assert [f.kind for f in e.fallbacks] == ["recursion_limit"], str(e)
    assert "long loop" in e.fallbacks[0].explanation and e.fallbacks[0].count == 4, str(e)
    assert e.stats.captures == 0 and e.graphs == [], str(e)


def _no_time_budget(monkeypatch):
    """Any capture is over its time budget at once: only the loop condition decides."""
    monkeypatch.setattr(budget, "FLOOR_SECONDS", 0.0)
    monkeypatch.setattr(budget, "EAGER_FACTOR", 0.0)


def test_slow_capture_without_a_long_loop_is_not_abandoned(monkeypatch, no_profiling):
    """A training step's capture costs many eager calls; with no loop running thousands of
    times it is not abandoned however long it takes."""
    _no_time_budget(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    fast, slow = specularch.optimize(_train_step(model)), _train_step(ref)
    for call in range(2):
        x, y = torch.randn(3, 4), torch.randn(3, 2)
        torch.testing.assert_close(_seeded(fast, call, x, y), _seeded(slow, call, x, y))
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.graphs, str(e)


def test_loop_threshold_follows_max_instructions(monkeypatch, no_profiling):
    """A loop is long past config.max_instructions/100 iterations: 250 iterations are with a
    limit of 20,000 instructions (it would fit in the limit), not with the default."""
    _no_time_budget(monkeypatch)

    def loop(x):
        for _ in range(250):
            x = x * 1.001
        return x

    x = torch.ones(2)
    with specularch.config.patch(max_instructions=20_000):
        fast = specularch.optimize(loop)
        torch.testing.assert_close(fast(x), loop(x))
        e = specularch.explain(fast)
        assert [f.kind for f in e.fallbacks] == ["recursion_limit"], str(e)
        assert "ran more than 200 iterations" in e.fallbacks[0].explanation, str(e)
    specularch.reset()
    fast = specularch.optimize(loop)
    torch.testing.assert_close(fast(x), loop(x))
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.graphs, str(e)
