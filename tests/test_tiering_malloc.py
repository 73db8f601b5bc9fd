"""glibc's malloc thresholds fixed before a graph's first compiled candidate is timed
(``_glibc_malloc.py``), or before a pinned compiling backend's first graph runs: once, only
where the program did not choose its allocator, and not with ``tune_malloc`` off."""
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch import tiering
from specularch import _glibc_malloc as glibc

pytestmark = pytest.mark.usefixtures("no_profiling")


@pytest.fixture
def fresh(monkeypatch):
    """``tune`` not run yet in this process; no MALLOC_*_ variable nor preload set; mallopt
    recorded instead of called. Yields the recorded calls."""
    calls = []
    monkeypatch.setattr(glibc, "_done", None)
    for name in (*glibc._CHOSEN, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)

    def mallopt(option, value):
        calls.append((option, value))
        return 1
    monkeypatch.setattr(glibc.ctypes, "CDLL", lambda name: types.SimpleNamespace(mallopt=mallopt))
    monkeypatch.setattr(glibc.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(glibc.platform, "system", lambda: "Linux")
    return calls


def test_tune_sets_both_thresholds_once(fresh):
    done, now = glibc.tune()
    assert now and done == "glibc malloc: mmap threshold 32 MiB, trim threshold 64 MiB"
    assert fresh == [(glibc.M_MMAP_THRESHOLD, 32 << 20), (glibc.M_TRIM_THRESHOLD, 64 << 20)]
    assert glibc.tune() == (done, False) and len(fresh) == 2


@pytest.mark.parametrize("name, value, why", [
    ("MALLOC_TRIM_THRESHOLD_", "1000", "the program set MALLOC_TRIM_THRESHOLD_"),
    ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2", "jemalloc is preloaded"),
])
def test_a_program_that_chose_its_allocator_keeps_it(fresh, monkeypatch, name, value, why):
    monkeypatch.setenv(name, value)
    assert glibc.tune() == (f"left as they are: {why}", True)
    assert fresh == []


def _train(steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = specularch.optimize(model)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    for _ in range(steps):
        adam.zero_grad()
        F.mse_loss(opt(x), y).backward()
        adam.step()
        tiering.wait(timeout=120)
    return specularch.explain(opt).graphs[-1]


@pytest.mark.parametrize("candidates, option, tuned", [
    (("torchscript",), True, True),
    (("torchscript",), False, False),
    (("eager",), True, False),  # (no compiled candidate: nothing is timed that needs it)
])
def test_the_first_compiled_candidates_trial_tunes_malloc(fresh, hot_at_once, candidates, option, tuned):
    hot_at_once(*candidates)
    with specularch.config.patch(tune_malloc=option):
        graph = _train(40)
    assert graph.tier.events and graph.tier.events[0].candidate == candidates[0]
    assert (glibc._done is not None) == tuned
    assert bool(fresh) == tuned


@pytest.mark.parametrize("backend, tuned", [("torchscript", True), ("fx", False)])
def test_a_pinned_compiling_backend_tunes_malloc_before_its_first_graph_runs(fresh, backend, tuned):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = specularch.optimize(model, backend=backend)
    x = torch.randn(4, 8)
    for _ in range(5):
        torch.testing.assert_close(opt(x), model(x))
    assert specularch.explain(opt).graphs[-1].backend == backend
    assert bool(fresh) == tuned
