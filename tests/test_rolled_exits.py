"""Rolled loops that stop early (``symbolic/rolled/exits.py``): a ``for`` loop whose body ends
with ``if <test>: break`` (greedy decoding, iterate-until-converged) is one graph whatever
the iteration it stops at; the runner evaluates the test every iteration and stops where
eager does. Every check is differential (values, gradients, heap) against eager, bit for
bit, with iteration 0 run by the body (default) and in the graph (``templates="exact"``)."""
import pytest
import torch
from torch import nn

import specularch

from differential import A, T, check, check_module

EOS = 1


def _loops(report):
    return [loop for graph in report.graphs for loop in graph.loops]


def _one_rolled_graph(report, stops=True):
    """One graph, no fallback, its loop rolled (and stopping at its ``break`` test)."""
    assert report.stats.captures == 1 and not report.fallbacks, report
    (loop,) = _loops(report)
    assert loop.rolled and (("stops where its `break` test says so" in str(loop)) == stops), report
    return loop


def greedy(x, h, n):
    for di in range(n):
        h = torch.tanh(h @ x)
        if h.argmax().item() == EOS:
            break
    return h


def fixed_budget(x, h):
    for di in range(8):  # a constant trip count: rolled because it may stop early
        h = torch.tanh(h @ x)
        if h.argmax().item() == EOS:
            break
    return h


def converged(x, h, n):
    total = h * 0
    for step in range(n):
        h = torch.tanh(h @ x)
        total = total + h
        if h.max() > 0.9:  # a tensor test
            break
    return total, h


def negated(x, h, n):
    for di in range(n):
        h = torch.tanh(h @ x)
        if not h.argmax().item() != EOS:  # (POP_JUMP_FORWARD_IF_TRUE: the exit shape too)
            break
    return h


def stored(x, h, n):
    for di in range(n):
        h = torch.tanh(h @ x)
        stop = h.argmax().item() == EOS
        if stop:  # a test made before the jump: an ordinary check
            break
    return h


def index_after(x, h, n):
    for di in range(n):
        h = torch.tanh(h @ x)
        if h.argmax().item() == EOS:
            break
    return h * (di + 1), di


def _args(i):
    return A(T(4, 4), T(1, 4), 5 + i % 3)


@pytest.mark.parametrize("templates", ["batched", "exact"])
@pytest.mark.parametrize("fn", [greedy, converged, index_after, negated])
def test_a_loop_that_breaks_anywhere_is_one_graph(fn, templates):
    with specularch.config.patch(templates=templates):
        report = check(fn, _args, calls=20)
    loop = _one_rolled_graph(report)
    assert len(set(loop.trips)) > 2 and min(loop.trips) >= 1, loop  # stopped at many places


@pytest.mark.parametrize("templates", ["batched", "exact"])
def test_a_constant_trip_count_rolls_when_the_loop_may_stop_early(templates):
    with specularch.config.patch(templates=templates):
        report = check(fixed_budget, lambda i: A(T(4, 4), T(1, 4)), calls=20)
    loop = _one_rolled_graph(report)
    assert max(loop.trips) <= 8 and len(set(loop.trips)) > 2, loop


def test_a_test_made_before_the_exit_jump_is_an_ordinary_check():
    """``stop = a == b; if stop: break``: the test's assertion is not made at the exit jump,
    so it is not taken for the exit test; a call that breaks runs eagerly
    (``assumption_failed``), never a wrong result."""
    report = check(stored, _args, calls=12)
    assert report.stats.assumption_failures >= 1, report


def test_the_capturing_call_breaking_at_once_still_rolls_the_loop():
    """Capture takes the test's no-break side whatever its own call's value: a call whose
    decoding stops at its first token captures the loop rolled too."""
    def first_stops(x, h, n):
        for di in range(n):
            h = h + x
            if h.sum().item() > 0:
                break
        return h
    starts = [-2.0, -1.0, -3.0, 1.0, -2.0, -0.2, -4.0, -1.4, 2.0]  # call 3 captures: stops at once
    report = check(first_stops, lambda i: A(torch.full((3,), 0.5), torch.full((3,), starts[i % 9]), 6),
                   calls=14)
    loop = _one_rolled_graph(report)
    assert 1 in loop.trips, loop


def appends(x, h, n):
    outs = [h]
    for di in range(n):
        h = torch.tanh(h @ x)
        outs.append(h * 2)  # (hoisted after the loop in the default mode: row-wise)
        if h.argmax().item() == EOS:
            break
    return torch.cat(outs), len(outs), torch.stack(outs).sum(0) * len(outs)


@pytest.mark.parametrize("templates", ["batched", "exact"])
def test_a_loop_that_stops_early_appends_the_iterations_it_ran(templates):
    """The lists it appends to hold the iterations it ran: ``torch.cat``/``torch.stack`` of
    them take those, ``len`` of one is a number the graph produces."""
    with specularch.config.patch(templates=templates):
        report = check(appends, _args, calls=20)
    loop = _one_rolled_graph(report)
    assert loop.outputs == 1 and len(set(loop.trips)) > 2, loop


class GreedyLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell, self.out, self.embed = nn.GRUCell(4, 4), nn.Linear(4, 3), nn.Embedding(3, 4)

    def forward(self, h, n):
        tok, logits = torch.zeros(1, dtype=torch.long), []
        for t in range(n):
            h = self.cell(self.embed(tok), h)
            step = self.out(h)
            logits.append(step)
            tok = step.argmax(1)
            if tok.item() == EOS:
                break
        return torch.stack(logits)


def test_a_decoder_returning_its_stacked_logits_is_one_graph():
    report = check_module(GreedyLogits, lambda i: A(T(1, 4), 6 + i % 3), calls=16, grad=True,
                          rtol=1e-5, atol=1e-6)
    _one_rolled_graph(report)


def index_as_a_size(x, h, n):
    for di in range(n):
        h = torch.tanh(h @ x)
        if h.argmax().item() == EOS:
            break
    return h.expand(di + 1, 4)


def test_the_index_after_an_early_stop_is_a_value_of_the_graph():
    """Where it stopped is known when the graph runs: used where Python needs the number
    itself (a size), the capture does not bake the capturing call's value in."""
    check(index_as_a_size, _args, calls=12)


class Decoder(nn.Module):
    """Greedy decoding with a GRU cell, a loss summed over the steps it ran."""

    def __init__(self):
        super().__init__()
        self.embed, self.cell, self.out = nn.Embedding(3, 8), nn.GRUCell(8, 8), nn.Linear(8, 3)

    def forward(self, h, target, max_len):
        tok, loss = torch.zeros(1, dtype=torch.long), 0.0
        for t in range(max_len):
            h = self.cell(self.embed(tok), h)
            logits = self.out(h)
            loss = loss + nn.functional.cross_entropy(logits, target[t])
            tok = logits.argmax(1).detach()
            if tok.item() == EOS:
                break
        return loss


@pytest.mark.parametrize("templates", ["batched", "exact"])
def test_a_greedy_decoder_training_step_stops_where_eager_does(templates):
    def make(i):
        g = torch.Generator().manual_seed(i)
        return A(torch.randn(1, 8, generator=g), torch.randint(0, 3, (9, 1), generator=g), 6 + i % 3)
    with specularch.config.patch(templates=templates):
        report = check_module(Decoder, make, calls=16, grad=True)
    loop = _one_rolled_graph(report)
    assert len(set(loop.trips)) >= 2, loop


class TeacherForced(nn.Module):
    """Fed the reference tokens (``embed(tokens[t])``, computed from the index alone), stopping
    once the loss passes a limit: eager never reads the tokens past where it stops."""

    def __init__(self):
        super().__init__()
        self.embed, self.cell, self.out = nn.Embedding(4, 6), nn.LSTMCell(6, 6), nn.Linear(6, 4)

    def forward(self, tokens, n, limit):
        h = c = torch.zeros(1, 6)
        loss = 0.0
        for t in range(n):
            h, c = self.cell(self.embed(tokens[t]), (h, c))
            loss = loss + nn.functional.cross_entropy(self.out(h), tokens[t + 1])
            if loss.item() > limit:
                break
        return loss


def test_a_loop_that_stops_early_reads_no_row_past_where_it_stops():
    """No prelude (``rolled/fast.py``: rows computed for every iteration before the loop) for
    a loop that may stop early: ``tokens`` shorter than ``n`` allows would make it raise
    where eager, stopping first, does not (the call then ran eagerly, recorded as a
    ``backend_error``). (Within rounding: the default mode's fused LSTM cell sums its
    gradients in another order, ``rolled/fast.py``.)"""
    def make(i):
        g = torch.Generator().manual_seed(i)
        return A(torch.randint(0, 4, (5, 1), generator=g), 6, 0.5 + (i % 4))
    report = check_module(TeacherForced, make, calls=14, grad=True, rtol=1e-5, atol=1e-7)
    assert not report.fallbacks and report.stats.captures == 1, report


def counted(x, h, n):
    k = 0
    for di in range(n):
        h = torch.tanh(h @ x)
        k += 2  # a Python number carried: not a rolled loop's
        if h.argmax().item() == EOS:
            break
    return h * k


@pytest.mark.parametrize("fn, why", [
    (counted, "`k` is a Python value that changes per iteration"),
    (index_as_a_size, "capture failed with it rolled")])
def test_why_a_loop_stayed_unrolled_outlives_its_graph(fn, why):
    """Unrolled, the ``break`` is speculated and the graph is dropped once a call breaks (or
    the capture falls back): ``explain()`` still says why the loop was not rolled."""
    report = check(fn, _args, calls=12)
    assert not report.graphs or all(not loop.rolled for loop in _loops(report)), report
    assert any(why in loop.why for loop in report.unrolled + _loops(report)), report
    assert "loops not rolled" in str(report) or report.graphs, report


def from_one(x, h, n):
    for t in range(1, n):
        h = torch.tanh(h @ x)
        if h.argmax().item() == EOS:
            break
    return h * t, t


def stepped(x, h, n):
    out = []
    for t in range(2, 2 * n, 3):
        h = torch.tanh(h @ x) + t
        out.append(h)
        if h.argmax().item() == EOS:
            break
    return torch.cat(out), t, len(out)


def fixed_from_one(x, h):
    for t in range(1, 9):
        h = torch.tanh(h @ x)
        if h.argmax().item() == EOS:
            break
    return h, t


@pytest.mark.parametrize("templates", ["batched", "exact"])
@pytest.mark.parametrize("fn, make", [(from_one, _args), (stepped, _args),
                                      (fixed_from_one, lambda i: A(T(4, 4), T(1, 4)))])
def test_a_range_with_a_start_or_a_step_that_may_stop_early_is_one_graph(fn, make, templates):
    """The loop's variable after it is ``start + last * step`` of the last iteration run,
    computed in the graph."""
    with specularch.config.patch(templates=templates):
        report = check(fn, make, calls=18)
    _one_rolled_graph(report)
