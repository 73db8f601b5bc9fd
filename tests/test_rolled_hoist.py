"""Hoisting out of rolled loops (symbolic/rolled/hoist.py): what feeds only the
values a loop appends runs once after the loop on their stacked inputs (equal to eager within
float rounding); what feeds the carried state, and random ops, stay in the body (eager's
order, bit for bit); ``templates="exact"`` hoists nothing."""
import copy

import pytest
import torch
import torch.nn.functional as F

import specularch
from specularch.symbolic.rolled.head import HeadedTail
from specularch.symbolic.rolled.hoist import HoistedTail
from specularch.symbolic.rolled.loops import RolledLoop
from specularch.workloads import lstm_lm

from differential import A, T, assert_same, check


def _graph(opt_fn):
    return specularch.api._state_of(opt_fn).entries[0].capture.graph_module


def _targets(gm, kind):
    return [n.target for n in gm.graph.nodes if isinstance(n.target, kind)]


def _tails(gm):
    """The hoisted tails, also those that run the loop's first item too (rolled/head.py)."""
    return _targets(gm, HoistedTail) + [h.tail for h in _targets(gm, HeadedTail)]


def _linears(gm):
    return [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "linear"]


def _lm_training(templates, lengths=(3, 4, 5, 6, 9, 2, 12, 7, 1, 10)):
    torch.manual_seed(0)
    eager_model = lstm_lm.LSTMLM(40, 8, 2, dropout=0.2)
    opt_model = copy.deepcopy(eager_model)

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def train_step(tokens, targets):
            opt.zero_grad()
            loss = lstm_lm.loss(model, (tokens, targets))
            loss.backward()
            opt.step()
            return loss
        return train_step
    eager_step, opt_step = make(eager_model), specularch.optimize(make(opt_model))
    data = torch.Generator().manual_seed(4)
    rtol = 0.0 if templates == "exact" else 1e-5
    with specularch.config.patch(templates=templates):
        for i, n in enumerate(lengths):
            batch = [torch.randint(0, 40, (n, 3), generator=data) for _ in range(2)]
            torch.manual_seed(i)  # dropout in the body: eager's draws in eager's order
            expected = eager_step(*batch)
            torch.manual_seed(i)
            assert_same(expected, opt_step(*batch), f"loss at length {n}", rtol=rtol)
    for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
        assert_same(p, q, name, rtol=rtol, atol=rtol * 1e-2)
    return opt_step


def test_the_lm_decoder_runs_once_after_the_loop_on_all_time_steps():
    opt_step = _lm_training("batched")
    report = specularch.explain(opt_step)
    assert report.stats.captures == 1 and not report.fallbacks, report
    (loop,) = report.graphs[0].loops
    assert loop.hoisted >= 1 and "hoisted after the loop" in str(report), report
    gm = _graph(opt_step)
    (rolled,) = _targets(gm, RolledLoop)
    (tail,) = _tails(gm)
    assert not _linears(rolled.body), rolled.body.code  # the decoder left the body
    assert not _linears(gm), gm.code  # iteration 0's decoder runs with the others
    assert len(_linears(tail.gm)) == 1, tail.gm.code    # one linear over [n - 1, B, H]
    assert any("dropout" in str(n.target) for n in rolled.body.graph.nodes)  # random: stays


def test_exact_templates_keep_the_decoder_in_the_body_bit_for_bit():
    opt_step = _lm_training("exact")
    gm = _graph(opt_step)
    (rolled,) = _targets(gm, RolledLoop)
    assert not _tails(gm) and len(_linears(rolled.body)) == 1, gm.code
    assert "nothing hoisted: templates='exact'" in str(specularch.explain(opt_step))


def _args(i):
    n = [4, 6, 3, 7, 5, 9, 2][i % 7]
    return A(T(n, 3, 5, requires_grad=True), T(5, 6, requires_grad=True), T(3, 5),
             T(6, requires_grad=True))


def _gate(z):
    a, g = z.chunk(2, 1)  # dims counted from the start: 1 becomes -1 after the loop
    return torch.cat([torch.sigmoid(a) * g, F.relu(a)], 1).log_softmax(1)


def _gates_on_the_last_dim(x, w, h, b):
    outs = []
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] + h)
        outs.append(_gate(h @ w + b))
    return torch.stack(outs), h


def _appended_feeds_the_state(x, w, h, b):
    outs = []
    for t in range(x.shape[0]):
        o = torch.tanh(h @ w[:, :5] + x[t])
        outs.append(o)
        h = o * 0.5  # what is appended is also carried: it stays in the body
    return torch.stack(outs)


def _appended_through_dropout(x, w, h, b):
    outs = []
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] + h)
        outs.append(F.dropout(h @ w + b, 0.5, True))  # random: stays in eager's order
    return torch.cat(outs)


def test_row_wise_ops_on_the_last_dim_are_hoisted_within_rounding():
    report = check(_gates_on_the_last_dim, _args, calls=7, grad=True, expect="graph", rtol=1e-5,
                   atol=1e-7)
    assert report.stats.captures == 1 and report.graphs[0].loops[0].hoisted >= 8, report


@pytest.mark.parametrize("fn, why", [
    (_appended_feeds_the_state, ""),
    (_appended_through_dropout, "draws random numbers"),
])
def test_what_feeds_the_state_or_draws_random_stays_in_the_body_bit_for_bit(fn, why):
    torch.manual_seed(0)
    report = check(fn, _args, calls=7, grad=True, expect="graph")  # rtol 0: nothing moved
    (loop,) = report.graphs[0].loops
    assert loop.rolled and loop.hoisted == 0 and why in loop.not_hoisted, report


def _decoder_halved_in_place(x, w0, h):
    w = w0 * 1
    outs = []
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] + h)
        outs.append(h @ w)  # reads w as this iteration finds it
        w.mul_(0.5)
    return torch.stack(outs), w


def test_nothing_moves_after_the_loop_across_an_in_place_write_in_the_body():
    # (no gradients: eager's backward raises, w is saved by the product and then written)
    args = lambda i: A(T([4, 6, 3, 7, 5, 9, 8][i], 3, 5), T(5, 5), T(3, 5))  # noqa: E731
    report = check(_decoder_halved_in_place, args, calls=7, expect="graph",
                   rtol=1e-5, atol=1e-6)
    (loop,) = report.graphs[0].loops
    assert loop.rolled and loop.hoisted == 0 and "writes in place" in loop.not_hoisted, report
