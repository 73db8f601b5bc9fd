"""Crashes real programs hit, each checked against eager PyTorch.

A. A module with BatchNorm called twice before one ``backward()`` (siamese / contrastive
   models). Eager's batch_norm writes the running stats without bumping their autograd
   version, so the first call's saved running stats stay valid. The commit must leave every
   version counter where eager leaves it (not one ``copy_`` bump per written tensor), and a
   write eager *does* see must still make backward raise, also inside one captured call.
B. ``torch.save(model)`` / ``pickle`` / ``copy`` of an optimized module: the saved module is
   the plain module (it loads where specularch is not installed, ``weights_only=True``
   included); a deep copy is optimized too, with its own cache.
"""
from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of

INPLACE_ERROR = "modified by an inplace operation"


# --------------------------------------------------------------------------- A. siamese BatchNorm

def _siamese_net(kind: str, momentum=0.1) -> nn.Module:
    torch.manual_seed(0)
    if kind == "1d":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(),
                             nn.Linear(8, 3))
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=momentum),
                         nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3))


def _pairs(kind: str, steps: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    shape = (6, 4) if kind == "1d" else (3, 2, 4, 4)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(steps)]


def _optimizer(name: str, net: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":  # several in-place ops per state tensor: several version bumps
        return torch.optim.Adam(net.parameters(), lr=1e-2, foreach=False)
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _observed(net: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What a user can see after a step: parameters, buffers, grads, optimizer state and the
    autograd version counter of each (the counter decides whether a later backward raises)."""
    seen = {}
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        seen[name] = (t.detach().clone(), t._version)
        if isinstance(t, nn.Parameter):
            seen[name + ".grad"] = None if t.grad is None else t.grad.clone()
    for i, p in enumerate(net.parameters()):
        for key, value in opt.state.get(p, {}).items():
            if torch.is_tensor(value):
                seen[f"state[{i}].{key}"] = (value.clone(), value._version)
    return seen


def _assert_same_observed(eager: dict, opt: dict) -> None:
    assert eager.keys() == opt.keys()
    for key, e in eager.items():
        o = opt[key]
        if e is None or o is None:
            assert e is o, key
        elif isinstance(e, tuple):
            assert torch.equal(e[0], o[0]), key
            assert e[1] == o[1], f"{key}: version {o[1]}, eager {e[1]}"
        else:
            assert torch.equal(e, o), key


def _run_siamese(kind: str, mode: str, optimizer: str = "sgd", momentum=0.1, steps: int = 3):
    """``mode``: ``eager``, ``module`` (``optimize(net)``, the step in plain Python) or
    ``step`` (``optimize(train_step)``, the step calling the plain net twice)."""
    net = _siamese_net(kind, momentum)
    opt = _optimizer(optimizer, net)
    model = specularch.optimize(net) if mode == "module" else net

    def train_step(x1, x2):
        opt.zero_grad()
        out1 = model(x1)
        out2 = model(x2)
        loss = (out1 - out2).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    step = specularch.optimize(train_step) if mode == "step" else train_step
    losses = [step(x1, x2).detach() for x1, x2 in _pairs(kind, steps)]
    return losses, _observed(net, opt), (model if mode == "module" else step)


@pytest.mark.parametrize("profile_calls", [0, 1, 3])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_siamese_batchnorm_module_trains_like_eager(kind, profile_calls):
    """The first failing shape: an eager (profiled) call saved the real running stats for
    backward, the second call's commit wrote them with a version bump eager does not make."""
    with specularch.config.patch(profile_calls=profile_calls):
        losses, seen, model = _run_siamese(kind, "module", steps=max(3, profile_calls + 1))
    eager_losses, eager_seen, _ = _run_siamese(kind, "eager", steps=len(losses))
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    _assert_same_observed(eager_seen, seen)
    e = specularch.explain(model)
    assert e.graphs and e.fallbacks == [], str(e)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_siamese_batchnorm_train_step_matches_eager_with_versions(kind, optimizer):
    eager_losses, eager_seen, _ = _run_siamese(kind, "eager", optimizer, steps=5)
    losses, seen, step = _run_siamese(kind, "step", optimizer, steps=5)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    _assert_same_observed(eager_seen, seen)
    e = specularch.explain(step)
    assert e.stats.graph_hits >= 1 and e.fallbacks == [], str(e)


def test_siamese_batchnorm_with_momentum_none_called_twice():
    eager_losses, eager_seen, _ = _run_siamese("1d", "eager", momentum=None, steps=5)
    losses, seen, _ = _run_siamese("1d", "module", momentum=None, steps=5)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    _assert_same_observed(eager_seen, seen)


@pytest.mark.parametrize("optimized", [False, True])
def test_siamese_autograd_grad_matches_eager(optimized):
    def grads(net):
        model = specularch.optimize(net) if optimized else net
        out = []
        for x1, x2 in _pairs("1d", 5):
            o1, o2 = model(x1), model(x2)
            out.append(torch.autograd.grad((o1 * o2).sum(), list(net.parameters())))
        return out, _observed(net, torch.optim.SGD(net.parameters(), lr=0.1))
    eager, eager_seen = grads(_siamese_net("1d"))
    got, seen = grads(_siamese_net("1d"))
    for a, b in zip(eager, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    _assert_same_observed(eager_seen, seen)


class _Scaled(nn.Module):
    """``x * w * s``: autograd saves the buffer ``s`` (the gradient of ``w`` needs it)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.register_buffer("s", torch.full((3,), 2.0))

    def forward(self, x):
        return x * self.w * self.s


def _outcome(fn):
    try:
        fn()
        return None
    except RuntimeError as e:
        return type(e), INPLACE_ERROR in str(e)


@pytest.mark.parametrize("bump", [False, True])
def test_a_saved_buffer_written_by_a_later_call_raises_like_eager(bump):
    """The commit still bumps a tensor eager bumps: backward through an earlier call that
    saved it raises as in eager (and runs when nothing wrote it)."""
    def program(optimized):
        net = _Scaled()
        model = specularch.optimize(net) if optimized else net

        def scale_buffer():
            with torch.no_grad():
                net.s.mul_(1.5)
        write = specularch.optimize(scale_buffer) if optimized else scale_buffer
        results = []
        for i in range(4):
            y = model(torch.full((3,), float(i)))
            if bump:
                write()
            results.append(_outcome(lambda: y.sum().backward()))
        return results, net.s.clone(), net.s._version, net.w.grad
    eager, opt = program(False), program(True)
    assert eager[0] == opt[0] and eager[0][0] == ((RuntimeError, True) if bump else None)
    assert torch.equal(eager[1], opt[1]) and eager[2] == opt[2]
    assert (eager[3] is None and opt[3] is None) or torch.equal(eager[3], opt[3])


def test_a_saved_buffer_written_then_backward_in_the_same_call_raises_like_eager():
    """Inside one captured call the write goes to a copy and the real buffer is bumped only
    at commit: capture must still see that backward reads a tensor written since it was saved."""
    def program(optimized):
        net = _Scaled()

        def step(x):
            y = net(x)
            with torch.no_grad():
                net.s.add_(1)
            y.sum().backward()
            return y

        fn = specularch.optimize(step) if optimized else step
        results = [_outcome(lambda: fn(torch.full((3,), float(i)))) for i in range(5)]
        return results, net.s.clone(), net.s._version, net.w.grad
    eager, opt = program(False), program(True)
    assert eager[0] == opt[0] == [(RuntimeError, True)] * 5
    assert torch.equal(eager[1], opt[1]) and eager[2] == opt[2] and eager[3] is opt[3] is None


# --------------------------------------------------------------------------- B. save / pickle / copy

def _bn_model(optimized: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model = specularch.optimize(net) if optimized else net
    for i in range(4):  # trained a little: graphs cached, running stats moved
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).sum().backward()
    return model


_SAFE = [nn.Sequential, nn.Linear, nn.BatchNorm1d, nn.ReLU]


def test_state_dict_of_an_optimized_module_saves_like_the_plain_one():
    plain, optimized = _bn_model(False), _bn_model(True)
    saved = []
    for m in (plain, optimized):
        buffer = io.BytesIO()
        torch.save(m.state_dict(), buffer)
        buffer.seek(0)
        saved.append(torch.load(buffer))
    assert list(saved[0]) == list(saved[1])
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


def _loaded(how: str, m: nn.Module) -> tuple[bytes, nn.Module]:
    buffer = io.BytesIO()
    if how == "pickle":
        buffer.write(pickle.dumps(m))
        return buffer.getvalue(), pickle.loads(buffer.getvalue())
    torch.save(m, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(_SAFE):  # weights_only=True, the program's globals
        return buffer.getvalue(), torch.load(buffer)


def _globals_in(data: bytes) -> set:
    """The classes and functions a pickle names (what ``weights_only`` loading must allow)."""
    names = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)
    Recorder(io.BytesIO(data)).load()
    return names


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_an_optimized_module_saves_and_loads_as_the_plain_module(how):
    plain, optimized = _bn_model(False), _bn_model(True)
    assert _globals_in(pickle.dumps(optimized)) == _globals_in(pickle.dumps(plain))
    data, loaded = _loaded(how, optimized)
    assert b"specularch" not in data and type(loaded) is nn.Sequential
    assert "forward" not in loaded.__dict__ and "__getstate__" not in loaded.__dict__
    x = torch.randn(5, 4)
    torch.testing.assert_close(loaded(x), _loaded(how, plain)[1](x), rtol=0, atol=0)
    torch.testing.assert_close(optimized(x), plain(x), rtol=0, atol=0)
    assert specularch.explain(optimized).stats.graph_hits >= 1  # the original stays optimized


def test_torch_save_of_an_optimized_module_loads_where_specularch_is_missing(tmp_path):
    optimized = _bn_model(True).eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(9))
    torch.save(optimized, tmp_path / "model.pt")
    torch.save(optimized(x).detach(), tmp_path / "expected.pt")
    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "specularch":
                    raise ImportError("specularch is not installed here")
        sys.meta_path.insert(0, Block())
        import torch, torch.nn as nn
        d = {str(tmp_path)!r}
        x, expected = torch.load(d + "/x.pt"), torch.load(d + "/expected.pt")
        with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.BatchNorm1d, nn.ReLU]):
            strict = torch.load(d + "/model.pt")
        loose = torch.load(d + "/model.pt", weights_only=False)
        for m in (strict, loose):
            assert type(m) is nn.Sequential and "forward" not in m.__dict__, m.__dict__.keys()
            assert torch.equal(m(x), expected)
        assert not any(n.split(".")[0] == "specularch" for n in sys.modules)
        print("LOADED")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "LOADED" in out.stdout, out.stderr[-2000:]


def test_a_deep_copy_stays_optimized_with_its_own_cache():
    optimized, plain = _bn_model(True), _bn_model(False)
    twin, twin_plain = copy.deepcopy(optimized), copy.deepcopy(plain)
    assert twin.forward.__self__ is twin and twin[0].weight is not optimized[0].weight
    assert _state_of(twin) is not _state_of(optimized)
    calls = specularch.explain(optimized).stats.calls
    x = torch.randn(5, 4)
    for _ in range(4):
        torch.testing.assert_close(twin(x), twin_plain(x), rtol=0, atol=0)
    _assert_same_observed(_observed(twin_plain, torch.optim.SGD(twin_plain.parameters(), lr=1)),
                          _observed(twin, torch.optim.SGD(twin.parameters(), lr=1)))
    assert specularch.explain(optimized).stats.calls == calls
    e = specularch.explain(twin)
    assert e.stats.calls == 4 and e.graphs and e.fallbacks == [], str(e)
    again = copy.deepcopy(twin)
    assert again.forward.__self__ is again and _state_of(again) is not _state_of(twin)


def test_a_deep_copy_keeps_the_backend():
    torch.manual_seed(0)
    m = specularch.optimize(nn.Linear(2, 2), backend="torchscript")
    assert _state_of(copy.deepcopy(m)).backend == "torchscript"


def test_a_shallow_copy_is_a_plain_module():
    optimized = _bn_model(True)
    shallow = copy.copy(optimized)
    assert "forward" not in shallow.__dict__ and shallow[0] is optimized[0]
    calls = specularch.explain(optimized).stats.calls
    shallow(torch.randn(5, 4))  # runs Sequential.forward itself, not the optimized model's cache
    assert specularch.explain(optimized).stats.calls == calls
