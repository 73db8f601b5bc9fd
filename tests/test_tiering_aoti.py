"""Inductor's candidate of a flattened graph as an AOTInductor package
(``fx_lower/_torch_aoti.py``), differential against eager: a training step that draws random
numbers and takes a Python number, tiered to the package in a worker process and, in a
second process, loaded from the compile cache — each step's loss and the generator's state,
then the parameters and Adam's state, as eager's, no module of ``torch._inductor`` imported by
the program beyond those eager PyTorch imports itself (``torch._dynamo``'s; not
``compile_fx``), and no unpacked package left in the temporary directory; a package's outputs that
are inputs, repeated or views, its number inputs, calls from three threads at once; where
AOTInductor fails, or its package raises when run once in the worker, today's
``standalone_compile`` artefact, saying so; an unreadable cached
package ignored with one warning."""
import json
import logging
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

import specularch
from specularch.fx_lower import _torch_aoti as aoti, _torch_compilers as compilers, compile_cache
from specularch.tiering import process

# One training step (MLP with dropout, Adam, a loss scale passed as a Python float) run
# eagerly and tiered side by side, each step from the same seed, until the tiered step's
# graph settled on its Inductor candidate, then 6 steps more. Prints what the test checks.
SCRIPT = r"""
import copy, json, sys
import torch
import torch.nn.functional as F
from torch import nn
import specularch
from specularch import tiering
from specularch.tiering import policy, process

torch.set_num_threads(1)
policy.CANDIDATES = ("inductor",)
policy.faster = lambda candidate, current: True  # kept whatever its trial measures
specularch.config.tier_min_hits = 3
specularch.config.tier_min_seconds = 1e-6
specularch.config.tier_trial_calls = 2

def make_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    def step(x, y, scale):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * scale
        loss.backward()
        opt.step()
        return loss.detach()
    return step, opt

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
twin = copy.deepcopy(model)
(eager, eager_opt), (tiered, tiered_opt) = make_step(twin), make_step(model)
# What eager PyTorch imports of Inductor by itself (an optimizer imports torch._dynamo, which
# imports a few of its modules): nothing more may be imported below.
eagers = {m for m in sys.modules if m.startswith("torch._inductor")}
tiered = specularch.optimize(tiered)
gen = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(3)]
worst, rng_equal, i = 0.0, True, 0

def steps(n):
    global worst, rng_equal, i
    for _ in range(n):
        x, y = batches[i % 3]
        scale = 1.0 + 0.25 * (i % 4)  # a constant-folded number would show here
        torch.manual_seed(100 + i)
        expected = eager(x, y, scale)
        state = torch.get_rng_state()
        torch.manual_seed(100 + i)
        got = tiered(x, y, scale)
        rng_equal &= torch.equal(torch.get_rng_state(), state)
        worst = max(worst, ((got - expected).abs() / expected.abs()).item())
        i += 1

entry = None
for _ in range(200):
    steps(3)
    # longer than a worker may compile (process.TIMEOUT, then it is killed): a hung compile
    # then shows as the candidate's event, not as this wait's
    assert tiering.wait(timeout=process.TIMEOUT + 120)
    entries = tiered.__specularch_state__.entries  # (none while the first calls are profiled)
    entry = max(entries, key=lambda e: e.hits) if entries else None
    if entry is not None and entry.tier.submitted_at is not None and entry.tier.settled:
        break
steps(6)
params = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))
state = max((a - b).abs().max().item()
            for p, q in zip(model.parameters(), twin.parameters())
            for a, b in zip(tiered_opt.state[p].values(), eager_opt.state[q].values()))
print(json.dumps({"events": [str(e) for e in entry.tier.events], "backend": entry.backend,
                  "compiled_in": [e.compiled_in for e in entry.tier.events],
                  "worst_loss": worst, "rng_equal": rng_equal, "params": params, "adam": state,
                  "inductor_imported": sorted({m for m in sys.modules
                                               if m.startswith("torch._inductor")} - eagers)}))
"""


@pytest.mark.slow
def test_package_from_the_worker_then_from_the_cache_matches_eager_without_inductor(tmp_path):
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, SPECULARCH_CACHE_DIR=str(cache), TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(specularch.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                              text=True, timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    for run, where in zip(runs, ("worker process", "from the compile cache")):
        assert run["compiled_in"] == [where] and run["backend"] == "inductor", run
        assert run["events"][0].startswith("inductor: kept"), run
        assert run["rng_equal"] and run["worst_loss"] < 1e-4, run
        assert run["params"] < 1e-5 and run["adam"] < 1e-5, run
        assert run["inductor_imported"] == [], run
    (meta,) = [json.loads(p.read_text()) for p in (cache / "inductor-artifacts").glob("*.json")]
    assert meta["format"] == "aoti" and meta["converted"], meta  # the scale: a 0-d tensor input
    assert len(list((cache / "inductor-artifacts").glob("*.pt2"))) == 1
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("aotinductor_")]


def _traced(fn, examples):
    gm = torch.fx.symbolic_trace(fn)
    for node, example in zip([n for n in gm.graph.nodes if n.op == "placeholder"], examples):
        node.meta["example"] = example
    return gm


def _edges(x, p, k, n):
    """Outputs a captured graph may have: an input, one value twice, a view of another
    output, views of an input, a parameter's update; Python numbers (a float and an int) as
    inputs."""
    y = x * k + n
    return x, y, y, y.t(), x.t(), x[1:], p - 0.1 * y.sum(), p


def _memory(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.slow
def test_package_outputs_numbers_and_threads_match_the_graph(tmp_path, monkeypatch):
    """As fx's graph: an input returned is that object, a view of an input or of another
    output is a view of it (same memory, strides, offset); a value returned twice comes back
    as two objects (``captured_outputs``), with memory of their own."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    examples = [torch.randn(3, 3), torch.nn.Parameter(torch.randn(3, 3)), 0.5, 2]
    meta = compilers.inductor_artifact(_traced(_edges, examples), examples,
                                       str(tmp_path / "a"), threads=1)
    assert meta["format"] == "aoti" and meta["converted"] == [2, 3], meta
    run = compilers.load_inductor_artifact(str(tmp_path / "a"), meta)
    assert run.artefact_note == "" and run.warm_calls == 1  # (worker.warm_up: kernels loaded)
    x, p = torch.randn(3, 3), torch.nn.Parameter(torch.randn(3, 3))
    for k, n in [(0.25, 3), (-1.5, 0)]:  # new values of the numbers: inputs, not constants
        got = run(x, p, k, n)
        with torch.no_grad():
            expected = _edges(x, p, k, n)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
            assert (a.stride(), a.storage_offset(), a.requires_grad) == \
                (b.stride(), b.storage_offset(), b.requires_grad)
        assert got[0] is x and got[7] is p
        assert _memory(got[4]) == _memory(got[5]) == _memory(x)
        assert _memory(got[3]) == _memory(got[1]) != _memory(got[2])
        assert got[1] is not got[2]
    reference = [t.clone() for t in run(x, p, 0.25, 3)]
    wrong = []

    def calls(run=run):
        for _ in range(200):
            if not all(torch.equal(a, b) for a, b in zip(run(x, p, 0.25, 3), reference)):
                wrong.append(1)
    threads = [threading.Thread(target=calls) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    del run, calls  # the loader removes its unpacked folder when freed
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("aotinductor_")]


def test_where_aoti_fails_the_standalone_artefact_says_why(monkeypatch, tmp_path):
    import torch._inductor

    class Artifact:
        def save(self, path, format):
            pathlib.Path(path).write_bytes(b"standalone")

    def refuse(*args, **kwargs):
        raise ValueError("no export for you\nsecond line")
    monkeypatch.setattr(aoti, "package", refuse)
    monkeypatch.setattr(torch._inductor, "standalone_compile", lambda *a, **k: Artifact())
    examples = [torch.randn(3), 2.0]
    gm = _traced(lambda x, k: x * k, examples)
    meta = compilers.inductor_artifact(gm, examples, str(tmp_path / "a"))
    assert meta == {"converted": [1], "devices": ["cpu"], "format": "standalone",
                    "aoti_failed": "ValueError: no export for you"}
    assert compilers.inductor_artifact(gm, examples, str(tmp_path / "b"), aoti=False)[
        "aoti_failed"] == "the program's torch cannot load its packages"

    def updates(x, k):
        x.mul_(k)
        return (x + 1,)
    meta_b = compilers.inductor_artifact(_traced(updates, examples), examples, str(tmp_path / "b"))
    assert meta_b["aoti_failed"] == "the graph updates its input x in place"
    monkeypatch.setattr(torch._inductor.CompiledArtifact, "load",
                        staticmethod(lambda path, format: lambda x, k: (x * k,)))
    run = compilers.load_inductor_artifact(str(tmp_path / "a"), meta)
    assert run.artefact_note == "standalone_compile artefact (AOTInductor: ValueError: no export for you)"
    assert not hasattr(run, "warm_calls")  # its first call loads its kernels: warmed as usual
    torch.testing.assert_close(run(torch.ones(3), 2.0)[0], torch.full((3,), 2.0))


def test_a_package_that_raises_when_run_gives_way_to_the_standalone_artefact(monkeypatch, tmp_path):
    import torch._inductor

    class Artifact:
        def save(self, path, format):
            pathlib.Path(path).write_bytes(b"standalone")

    def fails(path, inputs):
        assert pathlib.Path(path).read_bytes() == b"package" and len(inputs) == 2
        raise RuntimeError("Expected IntList but got None\nframe #0")
    monkeypatch.setattr(aoti, "package", lambda *a: b"package")
    monkeypatch.setattr(aoti, "test_run", fails)
    monkeypatch.setattr(torch._inductor, "standalone_compile", lambda *a, **k: Artifact())
    examples = [torch.randn(3), 2.0]
    meta = compilers.inductor_artifact(_traced(lambda x, k: x * k, examples), examples,
                                       str(tmp_path / "a"))
    assert meta["format"] == "standalone" and meta["aoti_failed"] == \
        "its package compiled but raised when run: RuntimeError: Expected IntList but got None"
    assert (tmp_path / "a").read_bytes() == b"standalone"


class _Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.out = torch.nn.LSTM(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.rnn(x)[0])


def _lstm_step_graph():
    """The captured graph of an ``nn.LSTM`` model's SGD step and its example inputs."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = _Recurrent()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    fast = specularch.optimize(step, backend="fx")
    x, y = torch.randn(5, 2, 4), torch.randn(5, 2, 3)
    for _ in range(5):
        fast(x, y)
    gm = max(specularch.api._state_of(fast).entries, key=lambda e: e.hits).capture.graph_module
    return gm, [n.meta.get("example") for n in gm.graph.nodes if n.op == "placeholder"]


def test_an_lstm_step_is_flattened_to_its_cells_not_the_onednn_kernel():
    """oneDNN's ``mkldnn_rnn_layer`` makes its backward's workspace only in grad mode, and a
    flattened graph runs under ``no_grad``: its compiled forms failed every call. The
    flattened step has the cells' ops, computes what the captured graph computes, and
    leaves oneDNN as it was."""
    gm, examples = _lstm_step_graph()
    assert any(getattr(n.target, "__name__", None) == "lstm" for n in gm.graph.nodes)
    reference = gm(*examples)
    flat = compilers.flatten(gm, examples, tracing_mode="fake")
    assert not [n for n in flat.graph.graph.nodes if "rnn" in str(n.target)], flat.graph.code
    assert torch.backends.mkldnn.enabled
    with torch.no_grad():
        outputs = flat.graph(*flat.inputs)
    assert len(outputs) == len(reference) > 1
    for got, want in zip(outputs, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tracing_an_lstm_never_switches_onednn_off_for_the_process(monkeypatch):
    """The cells' ops come from rewriting the traced copy of the graph, not from oneDNN's
    process-wide switch: a background compile must not change the kernel the program's own
    LSTMs run meanwhile (flattened and AOT-autograd forms alike)."""
    switched = []
    monkeypatch.setattr(torch._C, "_set_mkldnn_enabled", lambda on: switched.append(on))
    gm, examples = _lstm_step_graph()
    flat = compilers.flatten(gm, examples, tracing_mode="fake")
    assert not [n for n in flat.graph.graph.nodes if "rnn" in str(n.target)]
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6)
    forward = specularch.optimize(lstm, backend="torchscript")
    for _ in range(5):
        out, _ = forward(torch.randn(3, 2, 4))
    assert [g.backend for g in specularch.explain(forward).graphs] == ["torchscript"]
    assert switched == []


@pytest.mark.slow
def test_the_lstm_steps_package_runs_and_matches_the_graph(tmp_path):
    """A real one: ``nn.LSTM``'s training step (the big LM's step stayed on fx because its
    package's LSTM-backward call raised, "Expected IntList but got None", and the
    ``standalone_compile`` artefact tried next its size check): now an AOTInductor package
    whose outputs are the graph's."""
    gm, examples = _lstm_step_graph()
    reference = gm(*examples)
    path = str(tmp_path / "a")
    meta = compilers.inductor_artifact(gm, examples, path, threads=1)
    assert meta["format"] == "aoti", meta
    outputs = compilers.load_inductor_artifact(path, meta)(*examples)
    assert len(outputs) == len(reference) > 1
    for got, want in zip(outputs, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("damage", ["unloadable", "changed after it was saved"])
def test_unreadable_cached_package_is_ignored_with_one_warning_and_replaced(
        monkeypatch, tmp_path, caplog, damage):
    """A package the loader refuses, or one whose bytes changed since it was saved (the
    loader would load a damaged library: it does not check its zip's CRCs): one WARNING, no
    entry (the candidate is compiled again), nothing left in the temporary directory; the
    fresh package replaces it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    meta = {"format": "aoti", "converted": [], "devices": []}
    with specularch.config.patch(compile_cache_dir=str(tmp_path / "cache")):
        folder = pathlib.Path(compile_cache.directory("inductor-artifacts"))
        source = tmp_path / "package"
        source.write_bytes(b"PK\x03\x04 not a package" if damage == "unloadable" else b"PK" * 100)
        compile_cache.save_artifact("k", str(source), meta)
        if damage != "unloadable":
            (folder / "k.pt2").write_bytes(b"PK" * 99 + b"PX")
        with caplog.at_level(logging.WARNING, logger="specularch"):
            assert process._cached("inductor", "k", None) is None
        (record,) = caplog.records
        assert "ignoring unreadable entry" in record.getMessage() and "k.pt2" in record.getMessage()
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("aotinductor_")]
        source.write_bytes(b"a fresh package")
        compile_cache.save_artifact("k", str(source), meta)
        path, saved = compile_cache.artifact("k")
    assert pathlib.Path(path).read_bytes() == b"a fresh package" and saved["format"] == "aoti"


def test_the_job_asks_for_a_package_only_where_this_torch_loads_one(monkeypatch):
    seen = []
    monkeypatch.setattr(process, "_run", lambda folder, timeout, may_fork: seen.append(
        torch.load(f"{folder}/job.pt", weights_only=False)) or {})
    monkeypatch.setattr(process, "_load", lambda backend, path, meta, fallback: None)
    gm = _traced(lambda x: x + 1, [torch.ones(2)])
    for loadable in (True, False):
        monkeypatch.setattr(aoti, "loadable", lambda: loadable)
        process.compile_candidate("inductor", gm, [torch.ones(2)], timeout=5)
    assert [job["aoti"] for job in seen] == [True, False]
