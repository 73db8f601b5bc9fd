"""The persistent compile cache (``config.compile_cache_dir``): a graph compiled by a
compiling backend is saved, and a later run (a fresh cache in this process, or another
process) loads it instead of compiling; a corrupt or stale entry is ignored with one log
line and compiled again. Each test compares eager with the optimized step."""
import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import specularch
from specularch import config
from specularch.fx_lower import compile_cache
from differential import mse_train_step

STEPS = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train_step(model, opt):
    return mse_train_step(model, opt, after=lambda model, loss: loss.detach())


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen))
            for _ in range(STEPS)]


def _run(step, model) -> tuple[list, list]:
    losses = [step(x, y) for x, y in _batches()]
    return losses, [p.detach().clone() for p in model.parameters()]


def _optimized_run(cache_dir) -> tuple[list, list, str]:
    """Losses, parameters after the steps, and the graphs' explain() lines, of a fresh
    optimized step (specularch reset: nothing compiled in memory). Adam's first step (no
    state yet) and the later ones are two graphs."""
    specularch.reset()
    model = _model()
    step = specularch.optimize(_train_step(model, torch.optim.Adam(model.parameters(), lr=0.1)),
                               backend="torchscript")
    with config.patch(compile_cache_dir=str(cache_dir), profile_calls=0):
        losses, params = _run(step, model)
    report = specularch.explain(step)
    assert len(report.graphs) == 2 and {g.backend for g in report.graphs} == {"torchscript"}, report
    return losses, params, "\n".join(g.summary() for g in report.graphs)


def _all_cached(lines: str) -> bool:
    return all("(cached)" in line for line in lines.splitlines())


def _eager_run():
    model = _model()
    return _run(_train_step(model, torch.optim.Adam(model.parameters(), lr=0.1)), model)


def _assert_close(got, expected):
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _entries(cache_dir) -> list[pathlib.Path]:
    return sorted(pathlib.Path(cache_dir, "torchscript").glob("*.pt"))


def test_second_run_loads_the_compiled_graph_and_matches_eager(tmp_path):
    eager_losses, eager_params = _eager_run()
    losses, params, first = _optimized_run(tmp_path)
    assert "(cached)" not in first
    assert len(_entries(tmp_path)) == 2
    again_losses, again_params, second = _optimized_run(tmp_path)
    assert _all_cached(second), second
    _assert_close(losses, eager_losses)
    _assert_close(params, eager_params)
    for a, b in zip(losses + params, again_losses + again_params):  # the same compiled code
        assert torch.equal(a, b)


def test_corrupt_entry_is_ignored_with_one_log_line_and_replaced(tmp_path, caplog):
    eager_losses, eager_params = _eager_run()
    _optimized_run(tmp_path)
    entry = _entries(tmp_path)[0]
    entry.write_bytes(b"not a TorchScript archive" * 10)
    with caplog.at_level(logging.WARNING, logger="specularch"):
        losses, params, line = _optimized_run(tmp_path)
    warned = [r for r in caplog.records if "compile cache" in r.getMessage()]
    assert len(warned) == 1 and str(entry) in warned[0].getMessage(), caplog.text
    assert "(cached)" in line and not _all_cached(line)  # the other entry is intact
    _assert_close(losses, eager_losses)
    _assert_close(params, eager_params)
    assert _all_cached(_optimized_run(tmp_path)[2])  # the recompiled graph replaced it


def test_entry_of_another_torch_version_or_shape_is_not_used(tmp_path, monkeypatch):
    _optimized_run(tmp_path)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "-other")
    assert "(cached)" not in _optimized_run(tmp_path)[2]
    assert len(_entries(tmp_path)) == 4


def test_key_covers_input_metadata_and_graph_constants():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    key = compile_cache.entry_key(gm, [torch.zeros(2, 3)], "torchscript", "flattened")
    assert key == compile_cache.entry_key(gm, [torch.ones(2, 3)], "torchscript", "flattened")
    for other in ([torch.zeros(3, 2)], [torch.zeros(2, 3, dtype=torch.float64)],
                  [torch.zeros(3, 2).t()], [torch.zeros(2, 3, requires_grad=True)], [2.0]):
        assert compile_cache.entry_key(gm, other, "torchscript", "flattened") != key
    assert compile_cache.entry_key(gm, [torch.zeros(2, 3)], "torchscript", "aot") != key

    class WithConstant(nn.Module):
        def __init__(self, value):
            super().__init__()
            self.register_buffer("c", torch.full((2,), value))

        def forward(self, x):
            return x + self.c
    keys = {compile_cache.entry_key(torch.fx.symbolic_trace(WithConstant(v)), [torch.zeros(2)],
                                    "torchscript", "flattened") for v in (1.0, 2.0)}
    assert len(keys) == 2


def test_off_writes_nothing(tmp_path):
    with config.patch(compile_cache_dir="off"):
        assert compile_cache.directory("torchscript") is None
    eager_losses, eager_params = _eager_run()
    specularch.reset()
    model = _model()
    step = specularch.optimize(_train_step(model, torch.optim.Adam(model.parameters(), lr=0.1)),
                               backend="torchscript")
    with config.patch(compile_cache_dir="off", profile_calls=0):
        losses, params = _run(step, model)
    _assert_close(losses, eager_losses)
    _assert_close(params, eager_params)
    assert not any(tmp_path.iterdir())


def test_auto_is_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with config.patch(compile_cache_dir="auto"):
        assert compile_cache.directory("torchscript") == str(tmp_path / "specularch" / "torchscript")


SCRIPT = """
import json, sys, torch, specularch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train_step(x, y):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()
step = specularch.optimize(train_step, backend="torchscript")
gen = torch.Generator().manual_seed(1)
losses = [step(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)) for _ in range(5)]
print(json.dumps({"losses": losses, "params": [p.tolist() for p in model.parameters()],
                  "graph": specularch.explain(step).graphs[0].summary()}))
"""


@pytest.mark.slow
def test_second_process_starts_with_the_first_ones_compiled_graph(tmp_path):
    env = dict(os.environ, SPECULARCH_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(specularch.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    runs = [json.loads(subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(2)]
    assert "(cached)" not in runs[0]["graph"] and "(cached)" in runs[1]["graph"], runs
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["params"] == runs[1]["params"]


def test_a_changed_split_module_changes_every_key(monkeypatch, tmp_path):
    """The split's modules make the glue's metadata saved with a forward part: a checkout
    whose split changed must not load what an older one saved."""
    from specularch.fx_lower import compile_cache
    here = os.path.dirname(compile_cache.__file__)
    before = compile_cache._specularch_version.__wrapped__()  # (cached per process)
    real_open = open

    def changed(path, *args, **kwargs):
        if os.path.abspath(path) == os.path.join(here, "_torch_joint.py"):
            copy = tmp_path / "_torch_joint.py"
            copy.write_bytes(real_open(path, "rb").read() + b"\n# changed\n")
            return real_open(copy, *args, **kwargs)
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", changed)
    assert compile_cache._specularch_version.__wrapped__() != before
