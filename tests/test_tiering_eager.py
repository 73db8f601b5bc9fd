"""The eager tier (``tiering/eager_tier.py``), differential against eager: a graph measured
slower than the original Python has its path run eagerly — bit for bit eager's results and
state, no fallback recorded or warned about, nested optimized calls still running their own
graphs — and a graph measured faster keeps its tier."""
import logging

import pytest
import torch
from torch import nn

import specularch
from specularch import tiering
from specularch.tiering import policy

from test_tiering import (_batches, _graph, _mlp, _pair, _run, _settle,  # noqa: F401
                          candidates, low_thresholds, spin)
from test_tiering_trial import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_profiling", "one_thread")


def _slowed(opt, seconds):
    """Make the step's latest graph's current tier (``fx``) ``seconds`` of CPU slower."""
    _slowed_entry(opt.__specularch_state__.entries[0], seconds)


def _slowed_entry(entry, seconds):
    tier = entry.fn
    graph = tier.fn

    def slow(L, C, G, B):
        spin(seconds)
        return graph(L, C, G, B)
    tier.fn = slow


def test_path_runs_eagerly_when_eager_is_measured_faster(low_thresholds, candidates, caplog):  # noqa: F811
    candidates("eager")
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches[:2])  # the graphs with .grad None and with .grad set
    _slowed(opt, 0.02)
    with caplog.at_level(logging.WARNING, logger="specularch"):
        entry = _settle(opt, batches, eager)
        hits = opt.__specularch_state__.stats.graph_hits
        _run(eager, opt, batches * 3)  # eager's results, bit for bit
    (event,) = entry.tier.events
    assert event.candidate == "eager" and event.decision == "kept", event
    assert event.candidate_us < event.current_us and event.against == "fx"
    assert entry.backend == "eager" and _graph(opt).backend == "eager"
    stats = opt.__specularch_state__.stats
    assert stats.graph_hits == hits and stats.eager_tier_calls >= len(batches) * 3
    assert stats.fallback_calls == 0 and not specularch.explain(opt).fallbacks
    assert not [r for r in caplog.records if r.name == "specularch"]
    assert "eager_tier_calls=" in str(specularch.explain(opt))
    assert "tier: eager (final)" in str(specularch.explain(opt))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


class _Busy(nn.Module):
    """A forward whose Python (a loop the graph does not contain) costs more than its ops."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        k = 0
        for i in range(4000):
            k += i
        return self.fc(x) * (k % 7)


def test_graph_faster_than_eager_keeps_its_tier(low_thresholds, candidates):  # noqa: F811
    candidates("eager")
    eager, opt, model, twin = _pair(_Busy)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches[:2])
    entry = _settle(opt, batches, eager)
    stats = opt.__specularch_state__.stats
    tried, hits = stats.eager_tier_calls, stats.graph_hits  # (the trial's eager calls)
    _run(eager, opt, batches * 2)
    (event,) = entry.tier.events
    assert event.candidate == "eager" and event.decision == "rejected", event
    assert entry.backend == "fx" and stats.eager_tier_calls == tried
    # whole rounds of k calls (one when far slower), no untimed warm-up calls before them
    k = specularch.config.tier_trial_calls
    assert tried % k == 0 and tried <= k * policy.ROUNDS, tried
    assert stats.graph_hits == hits + len(batches) * 2
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_nested_optimized_call_is_still_a_graph_on_the_eager_tier(low_thresholds, candidates):  # noqa: F811
    """An optimized function called by a path on the eager tier still runs its own graph."""
    candidates("eager")
    inner = specularch.optimize(lambda x: torch.relu(x) * 2, backend="fx")

    def outer(x, n):
        return inner(x + n) + 1
    opt = specularch.optimize(outer)
    x = torch.randn(5)
    expected = outer(x, 1.0)
    for _ in range(3):
        assert torch.equal(opt(x, 1.0), expected)
    _slowed(opt, 0.02)
    entry = opt.__specularch_state__.entries[0]
    for _ in range(40):
        assert torch.equal(opt(x, 1.0), expected)
        assert tiering.wait(timeout=60)
        if entry.tier.settled:
            break
    assert entry.backend == "eager", entry.tier.lines()
    before = inner.__specularch_state__.stats.graph_hits
    assert torch.equal(opt(x, 1.0), expected)
    assert inner.__specularch_state__.stats.graph_hits == before + 1



class _Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.fc, self.inner = nn.Linear(5, 5), inner

    def forward(self, x):
        return self.inner(self.fc(x)) + 1


def test_nested_optimized_call_in_a_module_on_the_eager_tier(low_thresholds, candidates):  # noqa: F811
    """The same through ``optimize(module)`` (its eager runs are not reached through a
    trampoline)."""
    candidates("eager")
    inner = specularch.optimize(lambda x: torch.relu(x) * 2, backend="fx")
    torch.manual_seed(0)
    model = _Outer(inner)
    x = torch.randn(3, 5)
    with torch.no_grad():
        expected = model(x)
        specularch.optimize(model)
        for _ in range(3):
            assert torch.equal(model(x), expected)
        state = specularch.api._state_of(model)
        _slowed_entry(state.entries[0], 0.02)
        for _ in range(40):
            assert torch.equal(model(x), expected)
            assert tiering.wait(timeout=60)
            if state.entries[0].tier.settled:
                break
        assert state.entries[0].backend == "eager", state.entries[0].tier.lines()
        before = inner.__specularch_state__.stats.graph_hits
        assert torch.equal(model(x), expected)
    assert inner.__specularch_state__.stats.graph_hits == before + 1
