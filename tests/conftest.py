"""Shared test setup: ``tests/`` importable (``from differential import check``), and every test
starts and ends with specularch's caches and records cleared and torch's RNG seeded."""
import os
import pathlib
import sys
import tempfile
import types

import pytest
import torch

_TESTS = pathlib.Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))
if str(_TESTS.parent) not in sys.path:
    # Appended, so an installed specularch still wins; lets plain `pytest` work from a checkout.
    sys.path.append(str(_TESTS.parent))

# No persistent compile cache unless a test asks for one (it uses tmp_path): a graph compiled
# by an earlier test, or an earlier run, must not stand in for the compile a test exercises.
# Through the variable, so subprocesses of tests inherit it.
os.environ["SPECULARCH_CACHE_DIR"] = "off"
# No graph is compiled in the background unless a test asks for it (tests/test_tiering.py
# lowers the thresholds): whether a graph gets hot depends on how fast this machine is, and
# a test's results must not depend on that.
os.environ["SPECULARCH_TIER_MIN_SECONDS"] = "3600"

import specularch  # noqa: E402


@pytest.fixture
def no_profiling():
    """Capture on the first call (config.profile_calls=0): for tests about capture itself,
    not about the profiling phase."""
    with specularch.config.patch(profile_calls=0):
        yield


@pytest.fixture(autouse=True)
def _fresh_specularch():
    specularch.reset()
    torch.manual_seed(0)
    yield
    specularch.reset()


@pytest.fixture
def recursion_limit():
    """The interpreter's default recursion limit (1000) for the test, restored after."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield 1000
    sys.setrecursionlimit(before)


@pytest.fixture
def cache_dir(tmp_path):
    """The compile cache in ``tmp_path / "cache"`` for every thread (``config.patch`` is per
    thread, and the background thread reads and writes the cache)."""
    before = specularch.config.compile_cache_dir
    specularch.config.compile_cache_dir = str(tmp_path / "cache")
    yield tmp_path / "cache"
    specularch.config.compile_cache_dir = before


@pytest.fixture
def hot_at_once(monkeypatch, tmp_path):
    """Graphs hot after 3 calls; ``candidates`` as given; job folders under ``tmp_path``."""
    from specularch import tiering
    from specularch.tiering import policy, process
    monkeypatch.setattr(process, "tempfile", types.SimpleNamespace(
        mkdtemp=lambda prefix: tempfile.mkdtemp(prefix=prefix, dir=tmp_path)))
    with specularch.config.patch(tier_min_hits=3, tier_min_seconds=1e-6, tier_trial_calls=2):
        yield lambda *names: monkeypatch.setattr(policy, "CANDIDATES", names)
    tiering.wait(timeout=120)


@pytest.fixture
def promoted(hot_at_once, monkeypatch):
    """Graphs hot after 3 calls, TorchScript the one candidate, always measured faster (the
    promotion sweeps, ``promotion.py``)."""
    from specularch.tiering import policy
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
