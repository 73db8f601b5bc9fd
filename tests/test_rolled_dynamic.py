"""Rolled loops with dynamic sizes, differential against eager: a training step whose batch
size and sequence length both change every call stays one graph (an op that returns a fixed
number of tensors, ``lstm_cell``'s ``(h, c)``, no longer fixes its inputs' sizes), and a body
assumption that fails in a later iteration is an assumption failure, not a graph error
(what follows the loop never runs on a partial result)."""
import copy
import random

import pytest
import torch
from torch import nn

import specularch

from differential import assert_same, ce_train_step


class TinyLM(nn.Module):
    def __init__(self, vocab=30, hidden=16):
        super().__init__()
        self.embed, self.cell = nn.Embedding(vocab, hidden), nn.LSTMCell(hidden, hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        h = torch.zeros(tokens.shape[1], self.cell.hidden_size)
        c = torch.zeros_like(h)
        outputs = []
        for t in range(tokens.shape[0]):
            h, c = self.cell(self.embed(tokens[t]), (h, c))
            outputs.append(self.decoder(h))
        return torch.stack(outputs).flatten(0, 1)


def _step(model):
    return ce_train_step(model, torch.optim.Adam(model.parameters(), lr=0.01))


def test_an_lstm_lm_with_varying_batch_and_length_stays_one_graph():
    torch.manual_seed(0)
    model = TinyLM()
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
