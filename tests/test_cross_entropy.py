"""The ``fx`` backend's cross-entropy (fx_lower/cross_entropy.py, ``passes.CHEAPER_LOSS``):
outside exact mode ``F.cross_entropy(logits, target)`` on class indices is one autograd node
whose backward writes ``softmax - onehot`` once. Differential against eager: the loss (eager's
ops: the same bits), gradients and parameters after several SGD steps within rounding,
``ignore_index`` (some rows, every row: eager's nan), ``reduction="sum"``, eager's error for
a target out of range, a retained graph's second backward, eager's error for a freed one,
double backward; the forms it leaves alone and exact mode, bit for bit."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch.api import _state_of
from specularch.fx_lower import cross_entropy

from differential import assert_same

TOL = {"rtol": 1e-5, "atol": 1e-7}
DEFAULT_MIN_LOGITS = cross_entropy.MIN_LOGITS


@pytest.fixture(autouse=True)
def _small_logits_too(monkeypatch):
    """These tests' logits are small: the rewrite takes them here (not by default)."""
    monkeypatch.setattr(cross_entropy, "MIN_LOGITS", 1)


def _rewrites(fn) -> list:
    """How many cross-entropies each graph the ``fx`` backend runs took."""
    return [e.graph_fn.__self__.meta.get("cheaper_losses", 0) for e in _state_of(fn).entries]


def _step(model, opt, **ce):
    def train_step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y, **ce)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


def _targets(g, n, *, ignore=None, every=False):
    y = torch.randint(0, 5, (n,), generator=g)
    if ignore is not None:
        y[::3] = ignore
        if every:
            y[:] = ignore
    return y


def _train(ce: dict, *, ignore=None, exact=False, steps=8, all_ignored_at=None, close=None):
    torch.manual_seed(0)
    eager_model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
    opt_model = copy.deepcopy(eager_model)
    eager = _step(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9), **ce)
    opt = specularch.optimize(
        _step(opt_model, torch.optim.SGD(opt_model.parameters(), lr=0.1, momentum=0.9), **ce),
        exact=exact)
    g = torch.Generator().manual_seed(1)
    close = close or ({"rtol": 0.0, "atol": 0.0} if exact else TOL)
    for i in range(steps):
        x = torch.randn(12, 6, generator=g)
        y = _targets(g, 12, ignore=ignore, every=i == all_ignored_at)
        expected, got = eager(x, y), opt(x, y)
        if expected != expected:  # every row ignored: eager's nan
            assert got != got, f"step {i}"
        else:
            assert_same(expected, got, f"loss of step {i}", **close)
        for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
            assert_same(p, q, f"{name} after step {i}", **close)
            assert_same(p.grad, q.grad, f"{name}.grad after step {i}", **close)
    return opt


@pytest.mark.parametrize("ce,ignore,all_ignored_at", [
    ({}, None, None),
    ({"reduction": "sum"}, None, None),
    ({}, -100, None),                       # some rows ignored: the mean is over the others
    ({"ignore_index": 2}, 2, None),         # an ignored class that is also a valid index
    ({}, -100, 5),                          # one step with every row ignored: nan, no gradient
    ({"reduction": "sum", "ignore_index": 4}, 4, 6),
])
def test_training_with_the_cheaper_loss_matches_eager(ce, ignore, all_ignored_at):
    opt = _train(ce, ignore=ignore, all_ignored_at=all_ignored_at)
    assert _rewrites(opt) and all(n == 1 for n in _rewrites(opt)), _rewrites(opt)


def test_few_logits_keep_eagers_op_and_bits(monkeypatch):
    # below MIN_LOGITS the node's Python costs more than it saves
    monkeypatch.setattr(cross_entropy, "MIN_LOGITS", DEFAULT_MIN_LOGITS)
    opt = _train({}, exact=False, close={"rtol": 0.0, "atol": 0.0})
    assert all(n == 0 for n in _rewrites(opt)), _rewrites(opt)


def test_exact_mode_keeps_eagers_op_and_bits():
    opt = _train({}, ignore=-100, exact=True)
    assert all(n == 0 for n in _rewrites(opt)), _rewrites(opt)


@pytest.mark.parametrize("ce", [{"label_smoothing": 0.1}, {"reduction": "none"},
                                {"weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])}])
def test_other_forms_keep_eagers_op(ce):
    if ce.get("reduction") == "none":
        def fn(x, w, y):
            return F.cross_entropy(x @ w, y, **ce).sum()
    else:
        def fn(x, w, y):
            return F.cross_entropy(x @ w, y, **ce)
    opt = specularch.optimize(fn)
    for i in range(5):
        x, w = torch.randn(7, 4), torch.randn(4, 5, requires_grad=True)
        y = torch.randint(0, 5, (7,))
        w2 = w.detach().clone().requires_grad_()
        expected, got = fn(x, w, y), opt(x, w2, y)
        expected.backward()
        got.backward()
        assert_same(expected, got, f"call {i}")
        assert_same(w.grad, w2.grad, f"call {i} grad")  # eager's op: the same bits
    assert all(n == 0 for n in _rewrites(opt)), _rewrites(opt)


def test_logits_read_by_more_than_the_loss_keep_eagers_op():
    def fn(x, w, y):
        logits = x @ w
        return F.cross_entropy(logits, y), logits.argmax(1)
    opt = specularch.optimize(fn)
    for i in range(5):
        x, w, y = torch.randn(7, 4), torch.randn(4, 5, requires_grad=True), torch.randint(0, 5, (7,))
        opt(x, w, y)
    assert all(n == 0 for n in _rewrites(opt)), _rewrites(opt)


def _loss(x, w, y):
    return F.cross_entropy(torch.tanh(x @ w) * 3, y)


def _args(i, n_classes=5):
    g = torch.Generator().manual_seed(i)
    return (torch.randn(9, 4, generator=g), torch.randn(4, n_classes, generator=g).requires_grad_(),
            torch.randint(0, n_classes, (9,), generator=g))


def _twins(i):
    args = _args(i)
    return args, (args[0], args[1].detach().clone().requires_grad_(), args[2])


def test_a_target_out_of_range_raises_eagers_error():
    opt = specularch.optimize(_loss)
    for i in range(4):
        opt(*_args(i))
    assert _rewrites(opt) == [1]
    x, w, y = _args(7)
    y[3] = 5
    with pytest.raises(Exception) as eager:
        _loss(x, w, y)
    with pytest.raises(type(eager.value)) as got:
        opt(x, w, y)
    assert str(got.value) == str(eager.value)


def test_a_retained_graph_gives_eager_gradients_twice_and_a_freed_one_eagers_error():
    opt = specularch.optimize(_loss)
    for i in range(5):
        (a_e, a_o) = _twins(i)
        for fn, args in ((_loss, a_e), (opt, a_o)):
            loss = fn(*args)
            loss.backward(retain_graph=True)
            loss.backward()
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
        assert_same(a_e[1].grad, a_o[1].grad, f"call {i}", **TOL)
    assert _rewrites(opt) == [1]


def test_double_backward_through_the_loss_matches_eager():
    opt = specularch.optimize(_loss)
    for i in range(5):
        (a_e, a_o) = _twins(i)
        for fn, args in ((_loss, a_e), (opt, a_o)):
            (g,) = torch.autograd.grad(fn(*args), args[1], create_graph=True)
            g.pow(2).sum().backward()
        assert_same(a_e[1].grad, a_o[1].grad, f"call {i}", **TOL)
    assert _rewrites(opt) == [1]
