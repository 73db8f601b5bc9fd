"""Tiering graphs that draw random numbers (dropout), differential against eager: a training
step with dropout is compiled in the background (worker process, or the compile thread) and
kept, and every step's loss, the parameters and the global generator's state after each call
equal eager's (the same random numbers); a candidate that draws other numbers than eager is
caught on its first trial call and dropped, the graph staying bit-identical on ``fx``; graphs
whose compile could draw beside the program stay refused; a forward graph with dropout (its
AOT autograd form) is compiled too."""
import copy

import pytest
import torch
from torch import nn

import specularch
from specularch import tiering
from specularch.fx_lower.backends import get_backend
from specularch.tiering import policy, process

from differential import assert_same, mse_train_step
from test_tiering import _batches, test_backend  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("no_profiling")


def _dropout_mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))


@pytest.fixture
def hot(monkeypatch):
    """Graphs hot after 3 calls; ``hot(*names, keep=...)`` sets the candidates."""
    def set_(*names, keep=True):
        monkeypatch.setattr(policy, "CANDIDATES", names)
        if keep:  # whatever the trial measures: the test is about what the candidate computes
            monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    with specularch.config.patch(tier_min_hits=3, tier_min_seconds=1e-6, tier_trial_calls=2):
        yield set_
    tiering.wait(timeout=300)


def _pair():
    torch.manual_seed(0)
    model = _dropout_mlp()
    twin = copy.deepcopy(model)
    eager = mse_train_step(twin, torch.optim.Adam(twin.parameters(), lr=0.01))
    opt = mse_train_step(model, torch.optim.Adam(model.parameters(), lr=0.01))
    return eager, specularch.optimize(opt), model, twin


def _steps(eager, opt, batches, seed, rtol):
    """Each step from the same seed in both: equal losses, equal generator states after."""
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(seed + i)
        expected = eager(x, y)
        eager_state = torch.get_rng_state()
        torch.manual_seed(seed + i)
        got = opt(x, y)
        assert torch.equal(torch.get_rng_state(), eager_state), i
        assert got == pytest.approx(expected, rel=rtol, abs=rtol * 1e-3), i


def _settled(opt, eager, batches):
    entry = max(opt.__specularch_state__.entries, key=lambda e: e.hits)
    for round_ in range(40):
        assert tiering.wait(timeout=300)
        if entry.tier.submitted_at is not None and entry.tier.settled:
            return entry
        _steps(eager, opt, batches, 1000 + 10 * round_, rtol=1e-4)
    raise AssertionError(f"tiering did not settle: {entry.tier.lines()}")


@pytest.mark.parametrize("where", ["process", "thread"])
def test_dropout_step_tiers_to_torchscript_drawing_eagers_numbers(hot, monkeypatch, where):
    hot("torchscript")
    monkeypatch.setattr(process, "ENABLED", where == "process")
    eager, opt, model, twin = _pair()
    batches = _batches((8, 16), 4, 4)
    _steps(eager, opt, batches * 2, 0, rtol=0.0)  # on fx until promoted: bit-identical
    entry = _settled(opt, eager, batches)
    (event,) = entry.tier.events
    assert (event.candidate, event.decision) == ("torchscript", "kept"), entry.tier.lines()
    assert event.compiled_in == ("worker process" if where == "process" else
                                 "thread: process.ENABLED is off")
    assert entry.backend == "torchscript"
    _steps(eager, opt, batches * 3, 500, rtol=1e-4)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_dropout_step_tiers_to_inductor_drawing_eagers_numbers(hot):
    hot("inductor")
    eager, opt, model, twin = _pair()
    batches = _batches((8, 16), 4, 3)
    _steps(eager, opt, batches * 2, 0, rtol=0.0)
    entry = _settled(opt, eager, batches)
    (event,) = entry.tier.events
    assert (event.candidate, event.decision) == ("inductor", "kept"), entry.tier.lines()
    _steps(eager, opt, batches * 3, 500, rtol=1e-4)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p, rtol=1e-4, atol=1e-6)


def _fx(gm, inputs):
    # Unwrapped: the registered compile puts the generator's state back afterwards, which
    # on the compile thread would rewind it under the program's draws.
    return get_backend("fx").compile.__wrapped__(gm, inputs)


def _one_more_draw(gm, inputs):
    fn = _fx(gm, inputs)

    def run(*args):
        torch.rand(1)  # a draw eager does not make
        return fn(*args)
    return run


def _other_mask(gm, inputs):
    """The generator left where eager leaves it, but the graph's numbers drawn elsewhere."""
    fn = _fx(gm, inputs)

    def run(*args):
        with torch.random.fork_rng():
            torch.manual_seed(12345)
            out = fn(*args)
        fn(*args)
        return out
    return run


@pytest.mark.parametrize("compile_fn", [_one_more_draw, _other_mask])
def test_candidate_drawing_other_numbers_is_dropped(hot, monkeypatch, test_backend, compile_fn):  # noqa: F811
    test_backend("other_numbers", compile_fn)
    hot("other_numbers")
    monkeypatch.setattr(policy, "FAKE_TRACED", ("other_numbers",))
    monkeypatch.setattr(process, "ENABLED", False)
    eager, opt, model, twin = _pair()
    batches = _batches((8, 16), 4, 4)
    _steps(eager, opt, batches * 2, 0, rtol=0.0)
    entry = _settled(opt, eager, batches)
    _steps(eager, opt, batches * 3, 500, rtol=0.0)  # bit-identical: fx ran every call
    (event,) = entry.tier.events
    assert event.decision == "raised at run time" and "not eager's" in event.reason, event
    assert entry.backend == "fx"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p)


def test_random_forward_graph_tiers_drawing_eagers_numbers(hot):
    """A forward graph with dropout (the model optimized, loss and backward eager around it)
    compiles through AOT autograd on the compile thread, traced with fake tensors: the
    program's draws meanwhile stay eager's, and the kept candidate draws eager's numbers."""
    hot("torchscript")
    torch.manual_seed(0)
    model = _dropout_mlp()
    twin = copy.deepcopy(model)
    opt = specularch.optimize(model)
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def compiling() -> bool:  # until the candidate was asked for and compiled
        entries = specularch.api._state_of(opt).entries
        tier = entries[0].tier if entries else None
        return tier is None or tier.submitted_at is None or tiering.pending() > 0

    def run(forward, steps=None):
        """The program's own draws between steps: ``steps`` of them, or (``None``) as many
        as the compile takes (at least 40)."""
        torch.manual_seed(5)
        draws = []
        while (len(draws) < 40 or compiling()) if steps is None else len(draws) < steps:
            forward(batches[len(draws) % 4]).square().mean().backward()
            draws.append(torch.rand(1).item())
            assert len(draws) < 50_000, "the candidate was never compiled"
        return draws
    got = run(opt)  # compiled meanwhile
    assert got == run(twin, len(got))
    assert tiering.wait(timeout=300)
    model.zero_grad(), twin.zero_grad()
    assert run(opt, 20) == run(twin, 20)  # kept: its trial's and later calls
    (event,) = specularch.api._state_of(opt).entries[0].tier.events
    assert (event.candidate, event.decision) == ("torchscript", "kept"), event
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_compiling_the_flattened_form_draws_nothing():
    """The premise of compiling a random graph on the compile thread: its flattened form is
    traced with fake tensors and never run, so the compile leaves the generator alone."""
    from specularch.fx_lower.backends import compile_in_background
    torch.manual_seed(0)
    model = _dropout_mlp()
    step = specularch.optimize(mse_train_step(model, torch.optim.Adam(model.parameters())),
                               backend="fx")
    for x, y in _batches((8, 16), 4, 6):
        step(x, y)
    entry = max(specularch.api._state_of(step).entries, key=lambda e: e.hits)
    gm = entry.capture.graph_module
    assert policy.candidates(gm) == [("torchscript", None), ("inductor", None), ("eager", None)]
    examples = [n.meta.get("example") for n in gm.graph.nodes if n.op == "placeholder"]
    before = torch.get_rng_state()
    compile_in_background(get_backend("torchscript"), gm, examples)
    assert torch.equal(torch.get_rng_state(), before)


def test_compiling_the_aot_autograd_form_draws_nothing():
    """The same premise for a forward graph: AOT autograd traces it with fake tensors and its
    compilers get fake inputs (``ts_compile`` would run its graph on real ones)."""
    from specularch.fx_lower.backends import compile_in_background
    torch.manual_seed(0)
    model = _dropout_mlp()
    forward = specularch.optimize(_dropout_forward(model), backend="fx")
    for i in range(6):
        forward(torch.randn(8, 16)).sum().backward()
    gm = specularch.api._state_of(forward).entries[0].capture.graph_module
    assert policy.candidates(gm) == [("torchscript", None), ("inductor", None), ("eager", None)]
    examples = [n.meta.get("example") for n in gm.graph.nodes if n.op == "placeholder"]
    before = torch.get_rng_state()
    compile_in_background(get_backend("torchscript"), gm, examples)
    assert torch.equal(torch.get_rng_state(), before)


# ---- pinned backends: the first calls checked (same_draws.FirstCallsChecked) -----------------

def _dropout_forward(model):
    def forward(x):
        return model(x)
    return forward


def _pinned_pair(backend):
    torch.manual_seed(0)
    model = _dropout_mlp()
    twin = copy.deepcopy(model)
    return _dropout_forward(twin), specularch.optimize(_dropout_forward(model), backend=backend)


def _forward_steps(eager, opt, calls):
    for i in range(calls):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        torch.manual_seed(100 + i)
        expected, eager_state = eager(x), torch.get_rng_state()
        torch.manual_seed(100 + i)
        got = opt(x)
        assert torch.equal(torch.get_rng_state(), eager_state), i
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("draws_more", [True, False])
def test_a_pinned_backend_drawing_other_numbers_is_dropped_for_fx(test_backend, draws_more):  # noqa: F811
    """A compiled form that draws one number more than the graph (as AOT autograd's
    ``nn.LSTM`` with dropout between layers draws fewer) is caught on its first call: that
    call's result and generator state are ``fx``'s, and so are every later call's. One that
    draws eager's numbers runs on every call."""
    calls = []

    def compile_fn(gm, example_inputs):
        def run(*args):
            calls.append(1)
            if draws_more:
                torch.rand(1)
            return gm.forward(*args)
        return run
    test_backend("drawing", compile_fn)
    eager, opt = _pinned_pair("drawing")
    _forward_steps(eager, opt, 8)
    (graph,) = specularch.explain(opt).graphs
    assert graph.backend == "drawing", graph
    if draws_more:
        assert "backend 'drawing' dropped: its random numbers are not eager's" in graph.note, graph
        assert len(calls) == 1
    else:
        assert graph.note == "" and len(calls) == graph.hits, (graph, len(calls))


class _DroppedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.drop = nn.Embedding(20, 8), nn.Dropout(0.2)
        self.lstm = nn.LSTM(8, 8, 2, dropout=0.3)

    def forward(self, tokens, hidden):
        out, hidden = self.lstm(self.drop(self.embed(tokens)), hidden)
        return self.drop(out), hidden


def test_torchscripts_lstm_with_dropout_between_layers_runs_fx():
    """AOT autograd's forward of a two-layer ``nn.LSTM(dropout=...)`` holds the dropouts
    before and after it but not the one between its layers: pinned TorchScript draws fewer
    numbers than eager, so that graph runs ``fx`` after its first call, with eager's numbers."""
    torch.manual_seed(0)
    lstm = _DroppedLSTM()
    twin = copy.deepcopy(lstm)
    eager, opt = twin, specularch.optimize(lstm, backend="torchscript")
    for i in range(6):
        x = torch.randint(0, 20, (5, 3), generator=torch.Generator().manual_seed(i))
        hidden = (torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))
        torch.manual_seed(i)
        expected, state = eager(x, hidden), torch.get_rng_state()
        torch.manual_seed(i)
        torch.testing.assert_close(opt(x, hidden), expected, rtol=1e-4, atol=1e-6)
        assert torch.equal(torch.get_rng_state(), state), i
    (graph,) = specularch.explain(opt).graphs
    assert "backend 'torchscript' dropped" in graph.note, graph
