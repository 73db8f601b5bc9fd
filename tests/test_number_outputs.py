"""Graphs that return Python numbers computed inside them (a dynamic batch size the step
returns or counts, arithmetic on a number input) compiled by the compiling backends: the
flattened graph returns them as 0-d tensors and the compiled form's caller makes them numbers
again (``fx_lower/passes.number_outputs_as_tensors``, ``_torch_compilers.captured_outputs``).
Differential against eager: values and their Python types, the heap after the call."""
import pytest
import torch
from torch import nn

import specularch
from specularch import tiering
from specularch.api import _state_of
from specularch.fx_lower import passes

import test_tiering
import test_tiering_stall
from differential import A, T, check, check_module

candidates, counted_workers = test_tiering.candidates, test_tiering_stall.counted_workers  # fixtures

pytestmark = pytest.mark.usefixtures("no_profiling")

BATCHES = [4, 5, 7, 4, 9, 6]


def _backend_of(explanation) -> str:
    graph = explanation.graphs[-1]  # the one for every size, after the first size's
    assert not graph.note, str(explanation)
    return graph.backend


class Trainer(nn.Module):
    """A whole SGD step that returns its (dynamic) batch size and numbers made from it."""

    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def forward(self, x, y):
        self.opt.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        n = x.size(0)
        return loss.detach() * n, n, n / 3, n * 2 + 1


def _batch(call):
    n = BATCHES[call % len(BATCHES)]
    gen = torch.Generator().manual_seed(call)
    return A(torch.randn(n, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen))


@pytest.mark.parametrize("backend", ["torchscript", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_step_returning_its_dynamic_batch_size_is_compiled(backend):
    with specularch.config.patch(profile_calls=0):
        e = check_module(Trainer, _batch, calls=len(BATCHES), backend=backend, expect="graph",
                         atol=1e-5, rtol=1e-5)
    assert _backend_of(e) == backend
    assert "compiled for every size" in e.graphs[0].sizes, str(e)


def test_the_numbers_come_back_as_the_types_eager_returns():
    opt = specularch.optimize(Trainer(), backend="torchscript")
    with specularch.config.patch(profile_calls=0):
        for call in range(len(BATCHES)):
            args, _ = _batch(call)
            out = opt(*args)
    (entry,) = _state_of(opt).entries
    assert entry.graph_fn.misses == 0  # the size-checked compiled form ran
    n = BATCHES[-1]
    assert [type(v) for v in out[1:]] == [int, float, int]
    assert list(out[1:]) == [n, n / 3, n * 2 + 1]


def test_the_worker_compiles_a_step_returning_its_batch_size(counted_workers, candidates):
    """Tiered: the worker process's TorchScript candidate returns the batch size as a tensor
    and the program gets the number back, equal to eager's, whatever the decision."""
    candidates("torchscript")
    torch.manual_seed(0)
    fast, eager = Trainer(), Trainer()
    eager.load_state_dict(fast.state_dict())
    opt = specularch.optimize(fast)
    for _ in range(40):
        for call in range(len(BATCHES)):
            args, _ = _batch(call)
            got, want = opt(*args), eager(*args)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            assert list(got[1:]) == list(want[1:]) and type(got[2]) is float
        assert tiering.wait(timeout=300)
        entry = _state_of(opt).entries[-1]
        if entry.tier is not None and entry.tier.settled:
            break
    else:
        raise AssertionError("tiering did not settle")
    (event,) = [e for e in entry.tier.events if e.candidate == "torchscript"]
    assert event.compiled_in.startswith("worker process") and event.decision in ("kept", "rejected"), event


class Counter(nn.Module):
    """Counts the rows it has seen in a Python attribute (an epoch's sample count)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen = 0

    def forward(self, x):
        with torch.no_grad():
            self.seen += x.shape[0]
            return self.lin(x).relu()


def test_a_counter_of_rows_stored_on_the_module_is_compiled():
    with specularch.config.patch(profile_calls=0):
        e = check_module(Counter, lambda call: A(T(BATCHES[call % len(BATCHES)], 4, seed=call)),
                         calls=len(BATCHES), backend="torchscript", expect="graph")
    assert _backend_of(e) == "torchscript"


def _scaled(x, scale):
    with torch.no_grad():
        return x * scale, scale * 2 - 0.25, scale > 0.5


def test_arithmetic_on_a_number_input_returned_is_compiled():
    with specularch.config.patch(profile_calls=0):
        e = check(_scaled, lambda call: A(T(3, 4, seed=call), 0.1 + 0.3 * call), calls=4,
                  backend="torchscript", expect="graph")
    assert _backend_of(e) == "torchscript"


def _thirds(x, n):
    with torch.no_grad():
        return x * 2, n / 3


def test_a_number_the_tensor_form_would_round_otherwise_runs_fx():
    """``n / 3`` of an int input: as 0-d int64 tensors it gives a float32, where Python gives
    a float64; the compile refuses it (a number output of another dtype) and ``fx`` runs it,
    bit for bit."""
    with specularch.config.patch(profile_calls=0):
        e = check(_thirds, lambda call: A(T(3, 4, seed=call), 7 + call), calls=4,
                  backend="torchscript", expect="graph")
    graph = e.graphs[-1]
    assert graph.backend == "fx" and "number output" in graph.note, str(e)


def test_numbers_beside_results_that_need_autograd_are_compiled():
    """A forward whose results need autograd, returning its (dynamic) batch size beside them:
    compiled, the number eager's (``check`` compares every call with eager). It ran ``fx``
    before, refused ("returns Python numbers computed inside the graph and results that need
    autograd"); the split returns numbers now, and the refusal no longer counts dynamic
    sizes against it."""
    model = nn.Linear(4, 2)

    def forward(x):
        return model(x), x.shape[0]

    with specularch.config.patch(profile_calls=0):
        e = check(forward, lambda call: A(T(BATCHES[call], 4, seed=call)), calls=4,
                  backend="torchscript", expect="graph")
    graph = e.graphs[-1]
    assert graph.backend == "torchscript" and not graph.note, str(e)


def test_number_outputs_finds_numbers_and_refuses_other_values():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example"] = torch.zeros(2)
    size = graph.call_method("size", (x, 0))
    size.meta["example"] = 2
    name = graph.call_function(str, (size,))
    name.meta["example"] = "2"
    graph.output((x, size))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert passes.number_outputs(gm) == [1]
    graph.output_node().args = ((x, size, name),)
    assert passes.number_outputs(gm) is None
