"""Pinned ``inductor`` on a small CNN with BatchNorm, differential against eager, under the
benchmark's conditions: the compile cache on (its static-shape tracing context) and an
epoch's short last batch. Each batch size is its own static graph compiled by Inductor (a
size that reaches float arithmetic, BatchNorm's ``n / (n - 1)``, once made Inductor fail
with ``KeyError: s36`` there, and the step ran on ``fx``); a graph whose sizes are dynamic
is compiled once for every size (``fx_lower/dynamic_sizes.py``)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch

BATCHES = (8, 8, 8, 8, 5, 8)  # four full batches, the short last one, the next epoch
TOL = dict(rtol=1e-4, atol=1e-5)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _models():
    torch.manual_seed(0)
    model = SmallCNN()
    return model, copy.deepcopy(model)


def _batches(sizes=BATCHES):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, 5, (n,), generator=gen))
            for n in sizes]


def _train_step(model):
    """The benchmark's step (``bench/steps.py``): the batch one tuple argument."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train_step(batch):
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss.item()
    return train_step, opt


def _assert_same_state(model, ref, opt, ref_opt, **tol):
    """Parameters, gradients, BatchNorm's running statistics and the momentum buffers."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"{name}.grad: {m}")
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"], **tol)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_batchnorm_step_with_a_short_last_batch_compiles_each_size(tmp_path):
    model, ref = _models()
    step, opt = _train_step(model)
    eager, ref_opt = _train_step(ref)
    fast = specularch.optimize(step, backend="inductor")
    with specularch.config.patch(compile_cache_dir=str(tmp_path)):
        for i, batch in enumerate(_batches()):
            loss, expected = fast(batch), eager(batch)
            assert abs(loss - expected) < 1e-4, (i, loss, expected)
    _assert_same_state(model, ref, opt, ref_opt, **TOL)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and len(e.graphs) == 2, str(e)
    assert all((g.backend, g.note) == ("inductor", "") for g in e.graphs), str(e)


@pytest.mark.slow
def test_batchnorm_forward_through_aot_autograd(tmp_path):
    """The module optimized (its forward's results need autograd: Inductor's AOT autograd
    path, not the flattened one): outputs, gradients and running statistics."""
    model, ref = _models()
    specularch.optimize(model, backend="inductor")
    with specularch.config.patch(compile_cache_dir=str(tmp_path), profile_calls=0):
        for x, _ in _batches((8, 8)):
            out, expected = model(x), ref(x)
            torch.testing.assert_close(out, expected, **TOL)
            out.square().mean().backward()
            expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}.grad: {m}")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, **TOL, msg=lambda m: f"{name}: {m}")
    e = specularch.explain(model)
    assert e.graphs and all((g.backend, g.note) == ("inductor", "") for g in e.graphs), str(e)


@pytest.mark.slow
def test_dynamic_batch_is_compiled_once_for_every_size(tmp_path):
    """The batch size varied while profiling (a plain tensor argument): the graph's batch
    dimension is dynamic, and Inductor compiles it once for every batch size (BatchNorm's
    ``n / (n - 1)`` included); a batch of one, which the trace assumed away, runs ``fx``."""
    model, ref = _models()
    step, opt = _train_step(model)
    eager, ref_opt = _train_step(ref)

    def by_arguments(step):
        return lambda x, y: step((x, y))
    fast = specularch.optimize(by_arguments(step), backend="inductor")
    eager = by_arguments(eager)
    with specularch.config.patch(compile_cache_dir=str(tmp_path)):
        for x, y in _batches((8, 5, 8, 8, 5, 3, 1, 8)):  # profiled calls: 8, 5, 8
            assert fast(x, y) == pytest.approx(eager(x, y), rel=1e-4)
    _assert_same_state(model, ref, opt, ref_opt, **TOL)
    e = specularch.explain(fast)
    assert [(g.backend, g.note) for g in e.graphs] == [("inductor", "")], str(e)
    assert e.graphs[0].sizes.startswith("compiled for every size where L['x'].is_contiguous()"), str(e)
    assert e.graphs[0].sizes.endswith("; 1 call(s) outside ran fx"), str(e)


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.out = nn.LSTM(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.rnn(x)[0]).flatten(0, 1)  # (time x batch, classes)


@pytest.mark.slow
def test_lstm_step_under_pinned_inductor_trains_like_eager(tmp_path):
    """An ``nn.LSTM`` training step compiled by Inductor (flattened: its recurrent layer traced
    as its cells, ``_torch_compilers._generic_lstms``; oneDNN's kernel made every call of
    the compiled step fail and it ran on ``fx``): losses, parameters, gradients and momentum
    buffers as eager's, within float rounding, and every graph run by Inductor."""
    torch.manual_seed(0)
    model = _Recurrent()
    ref = copy.deepcopy(model)
    step, opt = _train_step(model)
    eager, ref_opt = _train_step(ref)
    fast = specularch.optimize(step, backend="inductor")
    gen = torch.Generator().manual_seed(2)
    with specularch.config.patch(compile_cache_dir=str(tmp_path)):
        for i in range(6):
            batch = (torch.randn(5, 2, 4, generator=gen), torch.randint(0, 3, (10,), generator=gen))
            loss, expected = fast(batch), eager(batch)
            assert abs(loss - expected) < 1e-4, (i, loss, expected)
    _assert_same_state(model, ref, opt, ref_opt, **TOL)
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.graphs, str(e)
    assert all((g.backend, g.note) == ("inductor", "") for g in e.graphs), str(e)
