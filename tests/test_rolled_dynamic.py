"""Rolled loops with dynamic sizes, differential against eager: a training step whose batch
size and sequence length both change every call stays one graph (an op that returns a fixed
number of tensors, ``lstm_cell``'s ``(h, c)``, no longer fixes its inputs' sizes), and a body
assumption that fails in a later iteration is an assumption failure, not a graph error
(what follows the loop never runs on a partial result)."""
import copy
import pathlib
import random
import sys
import threading

import pytest
import torch
from torch import nn

import specularch

from differential import assert_same, ce_train_step

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from train_step import LSTMLM  # noqa: E402  (an LSTM cell run by a Python loop over time)


def _step(model):
    return ce_train_step(model, torch.optim.Adam(model.parameters(), lr=0.01))


def test_an_lstm_lm_with_varying_batch_and_length_stays_one_graph():
    torch.manual_seed(0)
    model = LSTMLM(vocab=30, hidden=16)
    twin = copy.deepcopy(model)
    fast, eager = specularch.optimize(_step(model), backend="fx"), _step(twin)
    rng = random.Random(0)
    for _ in range(12):
        length, batch = rng.randint(3, 7), rng.randint(2, 6)
        tokens = torch.randint(0, 30, (length, batch))
        targets = torch.randint(0, 30, (length * batch,))
        # (within rounding: the input projection is one product for all steps, rolled/fast.py)
        assert fast(tokens, targets) == pytest.approx(eager(tokens, targets), rel=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    e = specularch.explain(fast)
    assert len(e.graphs) == 1 and e.fallbacks == [] and e.stats.assumption_failures == 0, str(e)


def _running_sums(xs):
    total, h = [], torch.zeros(3)
    for t in range(xs.shape[0]):
        h = h + xs[t]
        if (h > 100).any():
            h = h * 0
        total.append(h)
    return torch.stack(total).reshape(xs.shape[0] * 3)  # raises on a partial list


def test_a_body_assumption_failing_in_a_later_iteration_is_not_a_graph_error():
    fast = specularch.optimize(_running_sums)
    rows = [torch.ones(5, 3), torch.ones(6, 3), torch.ones(7, 3)]
    flipped = torch.ones(6, 3)
    flipped[2] = 200  # the branch, never taken at capture, is taken in iteration 2
    with specularch.config.patch(profile_calls=0):
        for xs in [*rows, flipped, torch.ones(8, 3)]:
            assert_same(fast(xs), _running_sums(xs))
    e = specularch.explain(fast)
    assert [f.kind for f in e.fallbacks] == ["assumption_failed"], str(e)
    assert e.stats.assumption_failures == 1, str(e)


def test_chunking_along_a_dynamic_dimension_still_fixes_it():
    def halves(x):
        a, b = x.chunk(2)
        return a * 2 + b
    fast = specularch.optimize(halves, backend="fx")
    with specularch.config.patch(profile_calls=0):
        for n in (4, 6, 6, 8):
            x = torch.randn(n, 3)
            assert_same(fast(x), halves(x))
    e = specularch.explain(fast)
    assert len(e.graphs) >= 2 and e.fallbacks == [], str(e)  # one graph per size


class TanhRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.wx, self.wh, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, xs):
        h = torch.zeros(xs.shape[1], 8)
        for t in range(xs.shape[0]):
            h = torch.tanh(self.wx(xs[t]) + self.wh(h))
        return self.out(h)


def test_a_tiered_body_never_compiles_in_a_call_of_the_program(monkeypatch):
    """Tiered, batch and length varying: the TorchScript candidate's loop body compiles for
    the shapes its warm-up meets, on the background thread; a trial call with other shapes
    runs the fx body instead of compiling in the program's call (each compile of it took
    seconds there, and its tracing patched nn.Module.__call__ under the program), and asks
    the background thread for a compile for every size of what varied."""
    from specularch import tiering
    from specularch.fx_lower.rolled import compiled
    from specularch.tiering import policy
    monkeypatch.setattr(policy, "CANDIDATES", ("torchscript",))
    threads = []
    original = compiled.CompiledBody._compile

    def counted(self, args, dynamic=None):
        threads.append((threading.get_ident(), bool(dynamic)))
        return original(self, args, dynamic)
    monkeypatch.setattr(compiled.CompiledBody, "_compile", counted)
    torch.manual_seed(0)
    model = TanhRNN()
    twin = copy.deepcopy(model)
    fast, eager = specularch.optimize(_step(model)), _step(twin)
    rng = random.Random(1)
    with specularch.config.patch(tier_min_hits=3, tier_min_seconds=1e-6, tier_trial_calls=2):
        for _ in range(60):
            length, batch = rng.randint(2, 6), rng.randint(2, 9)
            xs, labels = torch.randn(length, batch, 4), torch.randint(0, 3, (batch,))
            assert fast(xs, labels) == pytest.approx(eager(xs, labels), rel=1e-5)
            assert tiering.wait(timeout=120)
    (entry,) = fast.__specularch_state__.entries
    assert entry.tier is not None and entry.tier.settled, entry.tier and entry.tier.lines()
    assert threads and threading.get_ident() not in {t for t, _ in threads}, threads
    assert any(every_size for _, every_size in threads), threads
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["torchscript", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_pinned_body_compiles_once_for_every_batch_size(monkeypatch, backend):
    """Pinned, batch and length varying: the body compiles for its first shapes,
    then once for every size of what varied (size-checked, ``dynamic_sizes``), not once per
    batch size; values and parameters within rounding of eager's."""
    from specularch.fx_lower.rolled import compiled
    compiles = []
    original = compiled.CompiledBody._compile

    def counted(self, args, dynamic=None):
        compiles.append(dynamic)
        return original(self, args, dynamic)
    monkeypatch.setattr(compiled.CompiledBody, "_compile", counted)
    torch.manual_seed(0)
    model = TanhRNN()
    twin = copy.deepcopy(model)
    fast, eager = specularch.optimize(_step(model), backend=backend), _step(twin)
    rng = random.Random(2)
    for _ in range(30):
        length, batch = rng.randint(2, 6), rng.randint(2, 12)
        xs, labels = torch.randn(length, batch, 4), torch.randint(0, 3, (batch,))
        assert fast(xs, labels) == pytest.approx(eager(xs, labels), rel=1e-5)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    # per kind of body inputs (the first iteration's h needs no grad, the others' do): its
    # first shapes, then one compile for every batch size
    assert len(compiles) <= 4 and sum(1 for d in compiles if d) >= 1, compiles
    e = specularch.explain(fast)
    assert len(e.graphs) == 1 and e.fallbacks == [], str(e)
    assert "then once for every size that varies" in str(e), str(e)


def test_a_tiered_bodys_compile_leaves_the_programs_random_numbers_alone(monkeypatch):
    """The background thread compiling a rolled loop's body (its warm-up) while the program
    draws random numbers: the generator is not put back to where it was when that compile
    began (it was, by the compile wrapper of the program's own compiles), so the program
    draws eager's numbers throughout."""
    from specularch import tiering
    from specularch.tiering import policy
    monkeypatch.setattr(policy, "CANDIDATES", ("torchscript",))
    torch.manual_seed(0)
    model = TanhRNN()
    twin = copy.deepcopy(model)
    fast, eager = specularch.optimize(_step(model)), _step(twin)
    batches = [(torch.randn(length, batch, 4), torch.randint(0, 3, (batch,)))
               for length, batch in [(3, 5), (4, 5), (5, 7), (3, 8)]]

    def compiling() -> bool:  # until the candidate was asked for and its compiles are done
        entries = fast.__specularch_state__.entries
        tier = entries[0].tier if entries else None
        return tier is None or tier.submitted_at is None or tiering.pending() > 0

    def draws(step, steps=None):
        """The program's own draws between steps: ``steps`` of them, or (``None``) as many as
        it takes the background thread to compile (at least 40)."""
        torch.manual_seed(1)
        out = []
        while (len(out) < 40 or compiling()) if steps is None else len(out) < steps:
            step(*batches[len(out) % len(batches)])
            out.append(torch.rand(1).item())
            assert len(out) < 20_000, "the candidate was never compiled"
        return out
    with specularch.config.patch(tier_min_hits=3, tier_min_seconds=1e-6, tier_trial_calls=2):
        got = draws(fast)
        assert tiering.wait(timeout=120)
    assert got == draws(eager, len(got))
