"""A candidate rejected in a graph's trial is remembered in the compile cache: the next runs of
the same program (a fresh capture of the same step) neither compile nor time it, for
``policy.REMEMBER_RUNS`` runs, then try it again; ``explain()`` says so; an unreadable
decisions file is ignored with one log line; with the cache off nothing is remembered. Every
run is differential against eager (fx ran every call that returned)."""
import json
import logging

import pytest

import specularch
from specularch.tiering import policy, remembered

from test_tiering import (_batches, _fx, _mlp, _pair, _run, _settle,  # noqa: F401
                          candidates, low_thresholds, spin, test_backend)

pytestmark = pytest.mark.usefixtures("low_thresholds")


@pytest.fixture
def slow_backend(test_backend, candidates):  # noqa: F811
    """A candidate far slower than fx (rejected), counting its compiles."""
    compiles = []

    def slow(gm, inputs):
        compiles.append(gm)
        fn = _fx(gm, inputs)

        def run(*args):
            spin(0.03)
            return fn(*args)
        return run
    test_backend("slow_fx", slow)
    candidates("slow_fx")
    return compiles


def _one_run():
    """A fresh capture of the same training step, run until tiering settled: its event."""
    specularch.reset()
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 4)
    _run(eager, opt, batches)
    entry = _settle(opt, batches, eager)
    _run(eager, opt, batches * 2)
    assert specularch.tiering.wait(timeout=60)  # (the decision's record)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert (p == q).all()
    (event,) = entry.tier.events
    return event, str(specularch.explain(opt))


def _files(cache):
    return sorted((cache / remembered.FOLDER).glob("*.json"))


def test_a_rejection_is_skipped_in_the_next_runs_then_tried_again(
        slow_backend, cache_dir, monkeypatch):
    monkeypatch.setattr(policy, "REMEMBER_RUNS", 2)
    first, _ = _one_run()
    assert first.decision == "rejected" and len(slow_backend) == 1
    (path,) = _files(cache_dir)
    saved = json.loads(path.read_text())["rejected"]["slow_fx"]
    assert saved["runs_left"] == 2 and saved["candidate_us"] == first.candidate_us

    second, text = _one_run()
    assert len(slow_backend) == 1  # not compiled again
    assert second.decision == "rejected in an earlier run"
    assert (second.candidate_us, second.current_us) == (first.candidate_us, first.current_us)
    assert "slow_fx: rejected in an earlier run" in text and "tried again after 1 more" in text
    assert json.loads(path.read_text())["rejected"]["slow_fx"]["runs_left"] == 1

    third, text = _one_run()
    assert third.decision == "rejected in an earlier run" and len(slow_backend) == 1
    assert "tried again in the next" in text
    assert json.loads(path.read_text())["rejected"] == {}

    fourth, _ = _one_run()
    assert fourth.decision == "rejected" and len(slow_backend) == 2  # tried again
    assert json.loads(path.read_text())["rejected"]["slow_fx"]["runs_left"] == 2


def test_a_rejection_against_another_tier_is_tried_again(slow_backend, cache_dir):
    """Lost against TorchScript in an earlier run, but this run's graph is on fx: tried."""
    _one_run()
    (path,) = _files(cache_dir)
    data = json.loads(path.read_text())
    data["rejected"]["slow_fx"]["against"] = "torchscript"
    path.write_text(json.dumps(data))
    again, _ = _one_run()
    assert again.decision == "rejected" and len(slow_backend) == 2
    assert json.loads(path.read_text())["rejected"]["slow_fx"]["against"] == "fx"


@pytest.mark.parametrize("text", ['{"format": 1, "rejected": {"slow_fx": {"runs_left": "many"}}}',
                                  '{"format": 1, "rejected": {"slow_f'])
def test_an_unreadable_decisions_file_is_ignored_and_replaced(
        slow_backend, cache_dir, caplog, text):
    _one_run()
    (path,) = _files(cache_dir)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="specularch"):
        again, _ = _one_run()
    assert again.decision == "rejected" and len(slow_backend) == 2
    (line,) = [r.getMessage() for r in caplog.records if "decisions" in r.getMessage()]
    assert "ignoring unreadable decisions" in line and path.name in line
    assert json.loads(path.read_text())["rejected"]["slow_fx"]["runs_left"] == policy.REMEMBER_RUNS


def test_a_kept_candidate_clears_its_rejection(cache_dir):
    key = "k" * 64
    remembered.remember(key, "torchscript", {"candidate_us": 2.0, "current_us": 1.0,
                                             "against": "fx", "runs_left": 3})
    remembered.remember(key, "inductor", {"candidate_us": 3.0, "current_us": 1.0,
                                          "against": "fx", "runs_left": 1})
    assert set(remembered.rejections(key)) == {"torchscript", "inductor"}
    remembered.remember(key, "torchscript", None)
    assert set(remembered.rejections(key)) == {"inductor"}


def test_with_the_cache_off_nothing_is_remembered(slow_backend, tmp_path):
    assert specularch.config.compile_cache_dir == "off"  # (tests/conftest.py)
    for _ in range(2):
        event, _ = _one_run()
        assert event.decision == "rejected"
    assert len(slow_backend) == 2 and not list(tmp_path.iterdir())
