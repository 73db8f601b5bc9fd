"""Candidates compiled in a worker process (``specularch/tiering/process.py``), differential
against eager: the promoted graph's results within float rounding of eager, bit-identical
while the graph runs on ``fx``; the history saying "worker process"; a worker that crashes,
hangs or writes a corrupt artefact leaving the graph on ``fx`` with the reason; no call
waiting for the worker; graphs that cannot travel compiled on the thread, saying why."""
import copy
import sys
import time

import pytest
import torch
from torch import nn

import specularch
from specularch import tiering
from specularch.tiering import job, policy, process

from differential import assert_same, mse_train_step
from test_tiering import SmallLeNet, _batches, _mlp, _run

pytestmark = pytest.mark.usefixtures("no_profiling")

# Stand-ins for the worker's command (the niceness is appended to it; each job's folder
# comes as a line on its input, its status goes back as a line on its output).
CRASH = [sys.executable, "-c", "import os; os._exit(7)"]
HANG = [sys.executable, "-c", "import time; time.sleep(60)"]
CORRUPT = [sys.executable, "-c", "import json, os, sys; f = sys.stdin.readline().strip(); "
           "open(os.path.join(f, 'artefact'), 'wb').write(b'not a module'); "
           "json.dump({'meta': {'converted': [], 'devices': []}}, "
           "open(os.path.join(f, 'result.json'), 'w')); print(0, flush=True); sys.stdin.read()"]


def _pair(make_model):
    torch.manual_seed(0)
    model = make_model()
    twin = copy.deepcopy(model)
    eager = mse_train_step(twin, torch.optim.Adam(twin.parameters(), lr=0.01))
    opt = mse_train_step(model, torch.optim.Adam(model.parameters(), lr=0.01))
    return eager, specularch.optimize(opt), model, twin


def _hot_entry(opt, eager, batches):
    """Calls (bit-identical to eager: all on ``fx``) until the step's graph was submitted."""
    _run(eager, opt, batches * 4, rtol=0.0)
    entry = max(opt.__specularch_state__.entries, key=lambda e: e.hits)
    assert entry.tier.submitted_at is not None
    return entry


def _settled(opt, eager, batches, entry):
    for _ in range(40):
        assert tiering.wait(timeout=300)
        if entry.tier.settled:
            return entry.tier
        _run(eager, opt, batches, rtol=1e-4)
    raise AssertionError(f"tiering did not settle: {entry.tier.lines()}")


@pytest.mark.parametrize("command, reason", [
    (CRASH, "exited with status 7"),
    (CORRUPT, "artefact could not be loaded"),
])
def test_failed_worker_leaves_the_graph_on_fx(hot_at_once, monkeypatch, tmp_path, command, reason):
    hot_at_once("torchscript")
    monkeypatch.setattr(process, "COMMAND", command)
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 3)
    entry = _hot_entry(opt, eager, batches)
    history = _settled(opt, eager, batches, entry)
    (event,) = history.events
    assert event.decision == "compile failed" and reason in event.reason
    assert event.compiled_in == "worker process" and history.tier == "fx"
    _run(eager, opt, batches * 2, rtol=0.0)  # still fx: bit-identical
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert not list(tmp_path.glob("specularch-compile-*"))  # the job's folder is gone


def test_no_call_waits_for_the_worker_and_a_hung_one_is_killed(hot_at_once, monkeypatch, tmp_path):
    hot_at_once("torchscript")
    monkeypatch.setattr(process, "COMMAND", HANG)
    eager, opt, model, twin = _pair(_mlp)
    batches = _batches((8, 16), 4, 3)
    monkeypatch.setattr(process, "TIMEOUT", 5.0)
    start = time.perf_counter()
    entry = _hot_entry(opt, eager, batches)  # the worker was started in one of these calls
    assert time.perf_counter() - start < 4.0 and tiering.pending() == 1
    _run(eager, opt, batches, rtol=0.0)
    assert tiering.pending() == 1  # the worker still runs, the calls did not wait
    history = _settled(opt, eager, batches, entry)
    (event,) = history.events
    assert event.decision == "compile failed" and "ran past 5s" in event.reason
    assert history.tier == "fx" and not process._children
    assert not list(tmp_path.glob("specularch-compile-*"))


def test_graph_round_trips_to_the_same_code(hot_at_once):
    """What the worker compiles is the captured graph: same code text (``set_grad_enabled``
    calls included, which a pickled GraphModule loses), same inputs' layout."""
    hot_at_once("torchscript")
    eager, opt, model, twin = _pair(SmallLeNet)
    batches = _batches((8, 1, 28, 28), 10, 2)
    for x, y in batches * 2:
        eager(x, y), opt(x, y)
    gm = max(opt.__specularch_state__.entries, key=lambda e: e.hits).capture.graph_module
    examples = [n.meta["example"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert job.unsendable(gm) is None
    gm2, examples2 = job.unpack(job.pack(gm, examples))
    assert gm2.code == gm.code and "set_grad_enabled" in gm.code
    for a, b in zip(examples, examples2):
        if isinstance(a, torch.Tensor):
            assert (a.shape, a.stride(), a.dtype, a.requires_grad) == \
                (b.shape, b.stride(), b.dtype, b.requires_grad)
        else:
            assert a == b
    # The other nodes' examples travel as metadata (dtypes decide number inputs' casts).
    inner = [(n.meta.get("example"), m.meta.get("example")) for n, m in
             zip(gm.graph.nodes, gm2.graph.nodes) if n.op not in ("placeholder", "output")]
    assert any(isinstance(a, torch.Tensor) for a, _ in inner)
    for a, b in inner:
        if isinstance(a, torch.Tensor):
            assert b.is_meta and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        elif isinstance(a, (bool, int, float)):
            assert a == b


def test_graph_calling_a_user_function_is_not_sent():
    def mine(x):
        return x + 1
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example"] = torch.ones(2)
    graph.output(graph.call_function(mine, (x,)))
    reason = job.unsendable(torch.fx.GraphModule({}, graph))
    assert reason is not None and "mine" in reason


class _Clamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x, scale):
        return self.fc(x).clamp(max=scale)


def test_forward_graph_with_a_number_compiled_per_value_compiles_on_the_thread_saying_why(hot_at_once, monkeypatch):
    """A forward graph whose results need autograd goes to the worker as its forward and
    backward (tests/test_split_forward.py), its number inputs as 0-d tensors; but not one
    whose number reaches more than arithmetic (``clamp(max=)``: compiled per value of it,
    ``fx_lower/specialise.py``, in this process)."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(0)
    model = _Clamped()
    opt = specularch.optimize(copy.deepcopy(model))
    xs = [torch.randn(4, 8) for _ in range(3)]
    for i in range(20):
        for x in xs:
            assert_same(model(x, 0.5 + i), opt(x, 0.5 + i), rtol=1e-5, atol=1e-6)
        tiering.wait(timeout=120)
    event = specularch.explain(opt).graphs[-1].tier.events[0]
    assert event.compiled_in == "thread: its AOT-autograd form cannot be sent (it is compiled " \
        "once per value of a number input, in this process)"


@pytest.mark.slow
@pytest.mark.parametrize("backend, make_model, shape, outputs", [
    ("torchscript", SmallLeNet, (8, 1, 28, 28), 10),
    ("inductor", _mlp, (8, 16), 4),
])
def test_step_promoted_from_a_worker_process_matches_eager(hot_at_once, monkeypatch, backend,
                                                           make_model, shape, outputs):
    hot_at_once(backend)
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)  # keep it
    eager, opt, model, twin = _pair(make_model)
    batches = _batches(shape, outputs, 3)
    entry = _hot_entry(opt, eager, batches)
    history = _settled(opt, eager, batches, entry)
    (event,) = history.events
    assert (event.candidate, event.decision, event.compiled_in) == (backend, "kept", "worker process")
    assert entry.backend == backend and "worker process" in str(specularch.explain(opt))
    _run(eager, opt, batches * 3, rtol=1e-4)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p, rtol=1e-4, atol=1e-6)


def _captured_graph(fn, calls):
    opt = specularch.optimize(fn, backend="fx")
    for args in calls:  # profiled calls, then the capture
        opt(*args)
    return specularch.api._state_of(opt).entries[0].capture.graph_module


def test_graphs_the_backend_wraps_in_this_process_are_not_sent():
    """A worker's artefact is loaded bare: graphs whose compiled form the backend wraps here —
    outputs with used-up autograd history (spent.py), a number compiled per value
    (specialise.py) — stay on the thread, where that wrapping happens."""
    from specularch.tiering import process
    from test_spent_history import _batches, _lm_pair

    _, (_, step), _ = _lm_pair(0.0)
    gm = _captured_graph(step, _batches(4))
    assert gm.meta.get("outputs_require_grad")
    assert "autograd history" in process.route("torchscript", gm)

    def filled(x, k):
        return torch.full((3,), k) + x
    gm = _captured_graph(filled, [(torch.ones(3), k) for k in (2.0, 3.0, 4.0, 5.0)])
    assert "per value" in process.route("inductor", gm)


def test_number_input_meets_a_0d_tensor_in_eagers_dtype_in_the_worker(hot_at_once, monkeypatch):
    """A loss scaled by a Python number passed per call: in the worker (which gets the
    graph's node examples as metadata) the number is cast to the loss's dtype, as eager's
    Python number is; the promoted step returns eager's float32 loss (it returned float64)."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)  # keep it
    torch.manual_seed(0)
    model = _mlp()
    twin = copy.deepcopy(model)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, y, scale):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y) * scale
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    eager, opt = make(twin), specularch.optimize(make(model))
    batches = _batches((8, 16), 4, 3)
    for i in range(60):
        x, y = batches[i % 3]
        expected, got = eager(x, y, 1.0 + 0.25 * (i % 4)), opt(x, y, 1.0 + 0.25 * (i % 4))
        assert got.dtype == expected.dtype and torch.allclose(got, expected, rtol=1e-5), i
        entry = max(opt.__specularch_state__.entries, key=lambda e: e.hits, default=None)
        if entry is not None and entry.tier.settled and i >= 30:
            break
        tiering.wait(timeout=120)
    (event,) = entry.tier.events
    assert (event.decision, event.compiled_in) == ("kept", "worker process"), str(event)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_same(q, p, rtol=1e-5, atol=1e-6)


def _long(x):
    for _ in range(1200):  # unrolled: a node each
        x = x * 1.001
    return x


def test_a_graph_of_many_nodes_round_trips():
    """A job's graph is written node by node: pickling an ``fx.Graph`` walks its linked
    nodes recursively, a level per node (Inception's 1,640-node step raised RecursionError)."""
    opt = specularch.optimize(_long, backend="fx")
    x = torch.randn(3)
    for _ in range(4):
        assert torch.equal(opt(x), _long(x))
    gm = max(opt.__specularch_state__.entries, key=lambda e: e.hits).capture.graph_module
    assert len(gm.graph.nodes) > 1200
    examples = [n.meta["example"] for n in gm.graph.nodes if n.op == "placeholder"]
    gm2, _ = job.unpack(job.pack(gm, examples))
    assert gm2.code == gm.code


def test_inference_forward_compiles_in_the_worker_process(hot_at_once, monkeypatch):
    """A forward graph whose results need no autograd (``torch.no_grad()``, an eval loop)
    travels as one flattened graph, as a whole step does; before, it compiled through AOT
    autograd on the thread beside the program's calls."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).eval()
    opt = specularch.optimize(copy.deepcopy(model))
    xs = [torch.randn(4, 8) for _ in range(3)]
    with torch.no_grad():
        for _ in range(20):
            for x in xs:
                expected, got = model(x), opt(x)
                assert_same(expected, got, rtol=1e-5, atol=1e-6)
                assert not got.requires_grad
            tiering.wait(timeout=120)
    graph = specularch.explain(opt).graphs[-1]
    (event,) = graph.tier.events
    assert (event.decision, event.compiled_in) == ("kept", "worker process"), event
    assert graph.backend == "torchscript"
