"""A differential sweep of the newly capturable constructs on compiled backends: slices with a
symbolic bound (``x[:n]`` with ``n`` a dynamic size, ``x[t:t + 2]`` in a rolled loop), sizes
made from data (``x[x > 0]``, ``nonzero``, ``unique``), layout queries of dynamic tensors
(``x.t().is_contiguous()``), rolled loops that stop early (``if tok.item() == EOS: break``)
and ``.item()`` membership tests (``tok.item() in self.stop_ids``).

Each case runs eager and optimized side by side (``differential.py``) over 10 calls whose
sizes / trip counts vary, with sizes 0 and 1 after call 4; some with ``grad=True`` and some as
a whole training step with an optimizer. Backends: ``torchscript`` (most cases), ``inductor``
(``slow``) and the default tiered mode with TorchScript's candidate forced kept (the
``promoted`` fixture). A backend refusing a graph (a note, ``fx`` runs it) or a fallback is
fine; a value / dtype / shape / gradient / exception differing from eager, or an
``internal_error`` record, is a bug. Which backend ran each graph is kept in ``RAN`` (written
to ``$SWEEP_REPORT`` if set)."""
import json
import os

import pytest
import torch
from torch import nn

import specularch
from specularch import tiering

from differential import A, Pair, T, _judge, assert_same, check, check_module
from test_item_speculation import Stopper  # (.item() in a list attribute, not in a global)
from test_rolled_exits import converged, greedy  # (loops that stop early)

RTOL, ATOL = 1e-5, 1e-6
TS = "torchscript"
# Sizes / trip counts per call: 0 and 1 after call 4.
SIZES = [5, 7, 6, 8, 0, 1, 9, 1, 0, 6]
EOS = 1
RAN: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    path = os.environ.get("SWEEP_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(RAN, f, indent=1, sort_keys=True)


def _record(name, report):
    """Which backend ran each graph (and why not the one asked for); no ``internal_error``."""
    RAN[name] = {
        "graphs": [{"backend": g.backend, "hits": g.hits, "note": g.note,
                    "tiers": [str(t) for t in g.tiers]} for g in report.graphs],
        "fallbacks": sorted({f.kind for f in report.fallbacks}),
        "captures": report.stats.captures,
        "assumption_failures": report.stats.assumption_failures,
    }
    bugs = [str(f) for f in report.fallbacks if f.kind == "internal_error"]
    assert not bugs, f"{name}: internal error:\n" + "\n".join(bugs)
    return report


def _run(fn, make, backend, *, calls=10, grad=False, name=None):
    report = check(fn, make, calls=calls, grad=grad, backend=backend, rtol=RTOL, atol=ATOL)
    return _record(name or f"{fn.__name__}[{backend}]", report)


def _run_module(make_module, make, backend, *, calls=10, grad=False, between=None, name=None):
    report = check_module(make_module, make, calls=calls, grad=grad, backend=backend, rtol=RTOL,
                          atol=ATOL, between=between)
    return _record(name or f"{make_module.__name__}[{backend}]", report)


def _sized(*shape, grad=False, sizes=SIZES):
    return lambda i: A(T(*shape, requires_grad=grad), T(sizes[i % len(sizes)]))


# --------------------------------------------------------------------------- symbolic slices


def slice_bounds(x, y):
    n = y.shape[0]
    return x[:n], x[-n:], x[:-n], x[n - 3:2 * n:2], x[3 * n:], x[:3 * n] * 2


def slice_two_dims(x, y):
    n = y.shape[0]
    return x[..., :n].sum(-1), x[1:n, n - 4:] + 1, x[:, n:].shape


def slice_written(x, y):
    n = y.shape[0]
    z = x.clone()
    z[:n] = 0
    z[n:] += y.sum()
    return z


def slice_grad(x, y):
    n = y.shape[0]
    return (x[:n] * y).sum() + x[n:].pow(2).sum()


def slice_of_dynamic_input(x):
    n = x.shape[0]
    h = x[: n // 2] if n else x
    return h.sum(0), x[n // 2:].mean(0) if n > 1 else x.sum(0), h.shape[0]


def window(x, h, n):
    for t in range(n):
        h = torch.tanh(h + x[t:t + 2].sum(0))
    return h


def window_grad(x, h, n):
    out = h
    for t in range(n):
        out = out * 0.5 + x[t:t + 2].sum(0) * x[t + 1]
    return out


TRIPS = [4, 6, 5, 7, 0, 1, 8, 1, 0, 3]


def _window_args(grad=False):
    return lambda i: A(T(11, 3, requires_grad=grad), T(3, requires_grad=grad), TRIPS[i % 10])


SLICE_CASES = [
    (slice_bounds, _sized(20)),
    (slice_two_dims, _sized(12, 20)),
    (slice_written, _sized(20)),
    (slice_of_dynamic_input, lambda i: A(T(SIZES[i % 10], 3))),
    (window, _window_args()),
]


@pytest.mark.parametrize("fn, make", SLICE_CASES, ids=[f.__name__ for f, _ in SLICE_CASES])
def test_symbolic_slices_torchscript(fn, make):
    _run(fn, make, TS)


@pytest.mark.parametrize("fn, make", [(slice_grad, _sized(20, grad=True)),
                                      (window_grad, _window_args(grad=True))],
                         ids=["slice_grad", "window_grad"])
def test_symbolic_slices_with_grad_torchscript(fn, make):
    _run(fn, make, TS, grad=True)


# --------------------------------------------------------------------------- sizes made from data

SIGNS = [[1, 1, 1, -1], [1, -1, 1, -1], [-1, -1, -1, 1], [1, 1, 1, 1], [-1] * 4,
         [-1, 1, -1, -1], [1, -1, -1, 1], [-1] * 4, [1, 1, -1, 1], [-1, -1, 1, -1]]


def _signed(grad=False, dims=1):
    def make(i):
        x = torch.tensor(SIGNS[i % 10], dtype=torch.float) * (torch.rand(4) + 0.5)
        if dims == 2:
            x = torch.stack([x, -x.flip(0)], 1)
        return A(x.requires_grad_(grad))
    return make


def masked(x):
    k = x[x > 0]
    return x.new_zeros(len(k)), k.shape, k * 2, x[:len(k)] * 3


def masked_grad(x):
    k = x[x > 0]
    return k.pow(2).sum() * len(k) + x[: k.shape[0]].sum()


def nonzero_rows(x):
    idx = torch.nonzero(x > 0)
    return idx, idx.shape[0], x[idx[:, 0]].sum(0), torch.arange(idx.shape[0]) * 2


def masked_select_2d(x):
    k = torch.masked_select(x, x > 0)
    z = torch.zeros(k.numel(), 2)
    return k.sort().values, z + k.unsqueeze(1), k.numel()


def unique_counts(x):
    u, c = torch.unique((x > 0).long() * 2 + (x.abs() > 1).long(), return_counts=True)
    return u, c, torch.ones(u.numel()).cumsum(0), len(u)


def where_one_arg(x):
    (rows,) = torch.where(x > 0)
    return rows, x[rows].sum(), rows.float().mean() if len(rows) else x.sum()


def masked_dynamic_len(x):
    k = x[x > 0]
    return k.sum(), len(k), x.shape[0] - len(k)


DATA_CASES = [
    (masked, _signed()),
    (nonzero_rows, _signed()),
    (masked_select_2d, _signed(dims=2)),
    (unique_counts, _signed()),
    (where_one_arg, _signed()),
    (masked_dynamic_len, lambda i: A(T(SIZES[i % 10]))),
]


@pytest.mark.parametrize("fn, make", DATA_CASES, ids=[f.__name__ for f, _ in DATA_CASES])
def test_sizes_made_from_data_torchscript(fn, make):
    _run(fn, make, TS)


def test_sizes_made_from_data_with_grad_torchscript():
    _run(masked_grad, _signed(grad=True), TS, grad=True)


# --------------------------------------------------------------------------- layout queries

LAYOUT_ROWS = [5, 6, 7, 8, 1, 0, 4, 1, 9, 0]


def layout(x):
    return x.t().is_contiguous(), x.t()[:2].is_same_size(x[:2]), x[:, :1].is_contiguous(), x.t() * 2


def layout_branch(x):
    if x.t().is_contiguous():
        return x * 2
    return x.t().sum(0) + 1


def layout_of_slice(x, y):
    n = y.shape[0]
    v = x[:, :n]
    return v.is_contiguous(), v.sum(), x[:n].is_contiguous()


LAYOUT_CASES = [
    (layout, lambda i: A(T(LAYOUT_ROWS[i % 10], 3))),
    (layout_branch, lambda i: A(T(LAYOUT_ROWS[i % 10], 3))),
    (layout_of_slice, lambda i: A(T(4, 6), T([6, 2, 6, 3, 0, 1, 6, 1, 0, 5][i % 10]))),
]


@pytest.mark.parametrize("fn, make", LAYOUT_CASES, ids=[f.__name__ for f, _ in LAYOUT_CASES])
def test_layout_queries_torchscript(fn, make):
    _run(fn, make, TS)


# --------------------------------------------------------------------------- rolled loops that stop early


def appends(x, h, n):
    outs = [h]
    for di in range(n):
        h = torch.tanh(h @ x)
        outs.append(h * 2)
        if h.argmax().item() == EOS:
            break
    return torch.cat(outs), len(outs), torch.stack(outs).sum(0) * len(outs)


def index_after(x, h, n):
    di = -1
    for di in range(n):
        h = torch.tanh(h @ x)
        if h.argmax().item() == EOS:
            break
    return h * (di + 1), di


def window_until(x, h, n):
    for t in range(n):
        h = torch.tanh(h + x[t:t + 2].sum(0))
        if h.argmax().item() == EOS:
            break
    return h


def _loop_args(grad=False):
    return lambda i: A(T(4, 4, requires_grad=grad), T(1, 4, requires_grad=grad), TRIPS[i % 10])


LOOP_CASES = [
    (greedy, _loop_args()),
    (converged, _loop_args()),
    (appends, _loop_args()),
    (index_after, _loop_args()),
    (window_until, lambda i: A(T(11, 4), T(4), TRIPS[i % 10])),
]


@pytest.mark.parametrize("fn, make", LOOP_CASES, ids=[f.__name__ for f, _ in LOOP_CASES])
def test_rolled_loops_that_stop_early_torchscript(fn, make):
    _run(fn, make, TS)


def test_rolled_loop_that_stops_early_with_grad_torchscript():
    _run(appends, _loop_args(grad=True), TS, grad=True)


class GreedyLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell, self.out, self.embed = nn.GRUCell(4, 4), nn.Linear(4, 3), nn.Embedding(3, 4)

    def forward(self, h, n):
        tok, logits = torch.zeros(1, dtype=torch.long), [h.sum(1, keepdim=True).expand(1, 3)]
        for t in range(n):
            h = self.cell(self.embed(tok), h)
            step = self.out(h)
            logits.append(step)
            tok = step.argmax(1)
            if tok.item() == EOS:
                break
        return torch.stack(logits)


def test_greedy_decoder_module_with_grad_torchscript():
    _run_module(GreedyLogits, lambda i: A(T(1, 4, requires_grad=True), TRIPS[i % 10]), TS, grad=True)


def window_edge(x, h):
    """The loop runs over ``x``'s own rows: its last window is one row, at 0 rows none."""
    n = x.shape[0]
    for t in range(n):
        h = torch.tanh(h + x[t:t + 2].sum(0))
    return h


def until_window_edge(x, h):
    n = x.shape[0]
    out = []
    for t in range(n):
        h = torch.tanh(h + x[t:t + 3].mean(0))
        out.append(h)
        if h.argmax().item() in (0,):
            break
    return torch.stack(out) if out else h, len(out)


def masked_loop(x, n):
    """A data-sized tensor made in every iteration (unrolled: TorchScript / Inductor fail to
    compile ``nonzero`` here and say so; ``fx`` runs it)."""
    acc = x.sum() * 0
    for t in range(n):
        acc = acc + x[x > t * 0.3].sum()
    return acc


EDGE_CASES = [
    (window_edge, lambda i: A(T(TRIPS[i % 10], 3, requires_grad=True), T(3, requires_grad=True)), True),
    (until_window_edge, lambda i: A(T(TRIPS[i % 10], 3), T(3)), False),
    (masked_loop, lambda i: A(T(6), TRIPS[i % 10]), False),
]


@pytest.mark.parametrize("fn, make, grad", EDGE_CASES, ids=[f.__name__ for f, _, _ in EDGE_CASES])
def test_loops_over_edges_torchscript(fn, make, grad):
    _run(fn, make, TS, grad=grad)


# --------------------------------------------------------------------------- .item() membership

class StopDecoder(nn.Module):
    """Greedy decoding until a token in ``self.stop_ids``."""

    def __init__(self):
        super().__init__()
        self.embed, self.cell, self.out = nn.Embedding(5, 6), nn.GRUCell(6, 6), nn.Linear(6, 5)
        self.stop_ids = (1, 3)

    def forward(self, h, n):
        tok, total = torch.zeros(1, dtype=torch.long), h.sum() * 0
        for t in range(n):
            h = self.cell(self.embed(tok), h)
            logits = self.out(h)
            total = total + logits.logsumexp(1).sum()
            tok = logits.argmax(1)
            if tok.item() in self.stop_ids:
                break
        return total, h


def member_set(t, x):
    if t.item() in {1, 4}:
        return x.sum()
    return (x * t).sum()


def stop_in_tuple(tok, n):
    t = -1
    for t in range(n):
        tok = tok + 1
        if tok.item() in (11, 12):
            break
    return tok, t


def stop_not_in(tok, n):
    t = -1
    for t in range(n):
        tok = tok + 1
        if tok.item() not in (7, 8, 9, 10):
            break
    return tok, t


TOKS = [10, 9, 7, 5, 3, 10, 8, 11, 6, 9]


def test_membership_in_a_module_list_torchscript():
    _run_module(Stopper, lambda i: A(torch.tensor(i % 4 + 1), T(2)), TS, calls=12)


def test_membership_stop_ids_decoder_with_grad_torchscript():
    _run_module(StopDecoder, lambda i: A(T(1, 6, requires_grad=True), TRIPS[i % 10]), TS, grad=True)


@pytest.mark.parametrize("fn, make", [
    (member_set, lambda i: A(torch.tensor(i % 5), T(3))),
    (stop_in_tuple, lambda i: A(torch.tensor(TOKS[i % 10]), TRIPS[i % 10])),
    (stop_not_in, lambda i: A(torch.tensor(TOKS[i % 10] - 4), TRIPS[i % 10])),
], ids=["member_set", "stop_in_tuple", "stop_not_in"])
def test_membership_torchscript(fn, make):
    _run(fn, make, TS)


# --------------------------------------------------------------------------- training steps with an optimizer


class SliceNet(nn.Module):
    """A prefix of the batch (``x[:n]``, ``n`` a dynamic size) and its positive entries."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        n = y.shape[0]
        h = torch.tanh(self.lin(x))
        k = h[h > 0]
        return h[:n].pow(2).sum() + k.sum() * 0.5 + (y * h[:n, 0]).sum()


class LoopNet(nn.Module):
    """A rolled loop over ``x[t:t + 2]`` that may stop at a token in ``stop_ids``."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 3)
        self.stop_ids = [EOS]

    def forward(self, x, n):
        h = torch.tanh(self.lin(x[0]))
        total = h.sum() * 0.1
        for t in range(n):
            h = torch.tanh(self.lin(h + x[t:t + 2].sum(0)))
            logits = self.out(h)
            total = total + logits.logsumexp(0)
            if logits.argmax().item() in self.stop_ids:
                break
        return total + h.pow(2).sum()


def _slice_batch(i):
    return A(T(9, 4), T(SIZES[i % 10]))


def _loop_batch(i):
    return A(T(11, 4), TRIPS[i % 10])


def train(make_model, make_batch, backend, name, calls=10, warm=None):
    """A whole training step (``zero_grad``, forward, ``backward``, Adam, ``loss``) optimized
    beside an eager twin: losses, parameters, their ``.grad`` and Adam's state compared after
    every call. With ``warm`` (the tiered mode): calls of ``warm``'s batches until the tiers
    settle first."""
    def step_of(model, opt):
        def train_step(*args):
            opt.zero_grad()
            loss = model(*args)
            loss.backward()
            opt.step()
            return loss.detach()
        return train_step

    torch.manual_seed(0)
    m_e = make_model()
    torch.manual_seed(0)
    m_o = make_model()
    opt_e, opt_o = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (m_e, m_o))
    step_e, step_o = step_of(m_e, opt_e), step_of(m_o, opt_o)
    opt_fn = specularch.optimize(step_o) if backend is None else specularch.optimize(step_o, backend=backend)
    pair = Pair(name, step_e, opt_fn, opt_fn, rtol=RTOL, atol=ATOL,
                eager_roots={"model": m_e}, opt_roots={"model": m_o})
    make, begin = _phased(warm or make_batch, make_batch, pair)

    def one():
        pair.step(make)
        where = f"call {pair.calls}"
        for (pn, p), q in zip(m_e.named_parameters(), m_o.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{where}: {pn}.grad"
            if p.grad is not None:
                assert_same(p.grad, q.grad, f"{where}: {pn}.grad", rtol=RTOL, atol=ATOL)
        assert_same(opt_e.state_dict(), opt_o.state_dict(), f"{where}: Adam", rtol=RTOL, atol=ATOL)

    if warm is not None:
        _until_settled(one, opt_fn)
    begin()
    for _ in range(calls):
        one()
        if warm is not None:
            tiering.wait(timeout=120)
    report = pair.explain()
    _judge(report, None, None, None, None, name)
    return _record(name, report)


@pytest.mark.parametrize("model, batch", [(SliceNet, _slice_batch), (LoopNet, _loop_batch)],
                         ids=["slices_and_mask", "rolled_window_membership"])
def test_training_step_torchscript(model, batch):
    train(model, batch, TS, f"train {model.__name__}[torchscript]")


# --------------------------------------------------------------------------- default tiered mode, candidate kept


def _settled(target):
    entries = target.__specularch_state__.entries
    return bool(entries) and all(e.tier is None or e.tier.settled for e in entries)


def _until_settled(step, target, limit=60):
    """Warm-up calls (sizes 5-8) until every graph's tier is settled, a ``tiering.wait``
    after each so that the candidate's compile lands; then the sweep's 10 calls."""
    for _ in range(limit):
        step()
        tiering.wait(timeout=120)
        if _settled(target):
            return
    raise AssertionError(f"tiers not settled after {limit} calls\n{specularch.explain(target)}")


def _phased(warm, sweep, pair):
    """``make(i)``: ``warm(i)`` during the warm-up, ``sweep(j)`` for the sweep's j-th call."""
    start = []
    def make(i):
        return warm(i) if not start else sweep(i - start[0])
    return make, lambda: start.append(pair.calls)


def _run_promoted(fn, warm, sweep, grad=False, name=None):
    """``check`` by hand, in the default tiered mode with TorchScript's candidate kept."""
    name = name or f"{fn.__name__}[tiered]"
    pair = Pair.of_function(fn, rtol=RTOL, atol=ATOL, grad=grad)
    make, begin = _phased(warm, sweep, pair)
    _until_settled(lambda: pair.step(make), pair.opt)
    begin()
    for _ in range(10):
        pair.step(make)
        tiering.wait(timeout=120)
    report = pair.explain()
    _judge(report, None, None, None, None, name)
    return _record(name, report)


WARM = [5, 7, 6, 8]


@pytest.mark.parametrize("fn, warm, sweep, grad", [
    (slice_grad, _sized(20, grad=True, sizes=WARM), _sized(20, grad=True), True),
    (masked, _signed(), lambda i: _signed()(i + 3), False),
    (greedy, lambda i: A(T(4, 4), T(1, 4), WARM[i % 4]), _loop_args(), False),
    (stop_in_tuple, lambda i: A(torch.tensor(TOKS[i % 4]), WARM[i % 4]),
     lambda i: A(torch.tensor(TOKS[i % 10]), TRIPS[i % 10]), False),
], ids=["slice_grad", "masked", "greedy", "stop_in_tuple"])
def test_tiered_candidate_kept(promoted, fn, warm, sweep, grad):
    report = _run_promoted(fn, warm, sweep, grad=grad)
    assert report.graphs, report


def test_tiered_training_step_kept(promoted):
    train(LoopNet, _loop_batch, None, "train LoopNet[tiered]", warm=lambda i: A(T(11, 4), WARM[i % 4]))


# --------------------------------------------------------------------------- inductor (slow)


@pytest.mark.slow
@pytest.mark.parametrize("fn, make, grad", [
    (slice_bounds, _sized(20), False),
    (slice_grad, _sized(20, grad=True), True),
    (masked, _signed(), False),
    (layout, lambda i: A(T(LAYOUT_ROWS[i % 10], 3)), False),
    (greedy, _loop_args(), False),
    (stop_in_tuple, lambda i: A(torch.tensor(TOKS[i % 10]), TRIPS[i % 10]), False),
    (window_grad, _window_args(grad=True), True),
    EDGE_CASES[0], EDGE_CASES[2],
], ids=["slice_bounds", "slice_grad", "masked", "layout", "greedy", "stop_in_tuple", "window_grad",
        "window_edge", "masked_loop"])
def test_inductor(fn, make, grad):
    _run(fn, make, "inductor", grad=grad)


@pytest.mark.slow
def test_training_step_inductor():
    train(SliceNet, _slice_batch, "inductor", "train SliceNet[inductor]", calls=8)
