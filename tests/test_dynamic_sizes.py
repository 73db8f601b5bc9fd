"""Graphs with dynamic sizes compiled once for every size (``fx_lower/dynamic_sizes.py``,
``fx_lower/_torch_shapes.py``): differential against eager on sizes the trace holds for and
on sizes it does not (a batch of one, two sizes traced equal called unequal, a
non-contiguous input), which must run the graph's ``fx`` code; what the trace assumed is
checked, not trusted; pinned backends, the tiering worker and the compile cache."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch import tiering
from specularch.api import _state_of
from specularch.fx_lower import _torch_compilers, _torch_shapes, compile_cache
from specularch.fx_lower.dynamic_sizes import SizeChecked, checked
from specularch.fx_lower.passes import example_inputs
from specularch.guards.guard import same_value

import test_tiering
import test_tiering_stall
from differential import ce_train_step

candidates, counted_workers = test_tiering.candidates, test_tiering_stall.counted_workers  # fixtures

pytestmark = pytest.mark.usefixtures("no_profiling")


def _pair_sums(x, y):
    with torch.no_grad():
        return (x.relu() * 2).sum(0) + y.tanh().sum(0)


def _optimized(fn, backend, calls):
    """``fn`` optimized with ``backend``, called on ``calls`` (argument tuples) with the
    sizes made dynamic by the first two; each result compared with eager's."""
    opt = specularch.optimize(fn, backend=backend)
    for args in calls:
        torch.testing.assert_close(opt(*args), fn(*args))
    return opt


def _rows(*sizes, width=3):
    gen = torch.Generator().manual_seed(sum(sizes))
    return [torch.randn(n, width, generator=gen) for n in sizes]


def _entry(opt):
    (entry,) = _state_of(opt).entries
    return entry


def test_sizes_the_trace_did_not_hold_for_run_the_fx_code():
    calls = [_rows(4, 4), _rows(5, 5), _rows(9, 9), _rows(6, 2),
             _rows(1, 1),  # one: traced as at least 2
             _rows(12, 12)]
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_pair_sums, "torchscript", calls)
    graph_fn = _entry(opt).graph_fn
    assert isinstance(graph_fn, SizeChecked), graph_fn
    assert graph_fn.misses == 1
    e = specularch.explain(opt).graphs[0]
    assert e.backend == "torchscript" and e.note == "", e
    assert e.sizes == ("compiled for every size where L['x'].is_contiguous() and "
                       "L['y'].is_contiguous() and (2 <= L['x'].size()[0] and "
                       "2 <= L['y'].size()[0]); 1 call(s) outside ran fx"), e.sizes
    # (a transposed argument fails capture's guards: a graph of its own; the compiled form
    # alone refuses it too)
    x, y = torch.randn(3, 7).t(), torch.randn(7, 3)
    torch.testing.assert_close(graph_fn(x, y), graph_fn.fallback(x, y))
    assert graph_fn.misses == 2


def test_a_graph_captured_at_size_one_is_traced_at_two():
    """Tracing specialises on sizes 0 and 1: a graph whose example has a dynamic size of one
    (a batch of one, a first token) is traced with that size 2 (``_torch_shapes.hinted``), so
    it is compiled for every size but 0 and 1, which run ``fx``."""
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_pair_sums, "fx", [_rows(4, 4), _rows(5, 5)])
    gm = _entry(opt).capture.graph_module
    assert gm.meta["dynamic_inputs"] == [[0, [0]], [1, [0]]]
    # traced at the sizes of the call the relaxed graph was captured from (a full batch) ...
    assert gm.meta["size_hints"] == [[0, [4, 3]], [1, [4, 3]]]
    flat = _torch_compilers.flatten(gm, _rows(1, 1))
    assert [tuple(t.shape) for t in flat.inputs] == [(4, 3), (4, 3)]
    # ... and, without an earlier call's sizes, at 2 where the call's are 1
    del gm.meta["size_hints"]
    flat = _torch_compilers.flatten(gm, _rows(1, 1))
    assert [tuple(t.shape) for t in flat.inputs] == [(2, 3), (2, 3)]
    ok = flat.meta()
    check = _torch_shapes.size_check(ok["size_guards"])
    assert check(tuple(_rows(7, 7))) and check(tuple(_rows(7, 6)))
    assert not check(tuple(_rows(1, 7))) and not check((torch.randn(3, 7).t(), torch.randn(7, 3)))
    run = _torch_compilers.run_scripted(_torch_compilers.script_aten_graph(flat.graph), ok, gm.forward)
    for sizes in ((1, 1), (6, 3), (1, 4)):
        torch.testing.assert_close(run(*_rows(*sizes)), list(gm(*_rows(*sizes))))
    assert run.misses == 2


def test_a_graph_captured_at_a_batch_of_one_is_compiled_for_the_others():
    """Sizes varied while profiling, then the capturing call has a batch of one: the pinned
    backend compiles the graph (traced at two); the batch of one ran, and runs, ``fx``."""
    calls = [_rows(3, 3), _rows(5, 5), _rows(7, 7), _rows(1, 1), _rows(4, 4), _rows(6, 6), _rows(1, 1)]
    with specularch.config.patch(profile_calls=3):
        opt = _optimized(_pair_sums, "torchscript", calls)
    (graph,) = specularch.explain(opt).graphs
    assert graph.backend == "torchscript" and graph.note == "", graph
    assert graph.sizes.endswith("; 2 call(s) outside ran fx"), graph.sizes  # both (1, 1)


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        with torch.no_grad():
            return self.head(torch.flatten(F.max_pool2d(self.conv(x).relu(), 2), 1))


def _images(batch):
    return [torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))]


@pytest.mark.parametrize("batches, profile_calls", [
    ([32, 32, 32, 32, 7, 32, 32, 32, 7, 32], 0),   # the short batch fails the static graph
    ([32, 32, 32, 7, 32, 32, 32, 7, 32], 3)],      # ... or varies while profiling
    ids=["relaxed", "profiled"])
def test_dynamic_sizes_are_traced_at_a_full_batch_not_the_short_one(batches, profile_calls):
    """The short batch that made the batch dynamic used to be what the compile traced at:
    the convolution's kernel choice below a batch of 16 then held the compiled form to
    batches up to 15, and every full batch ran ``fx``. Now the trace takes an earlier
    call's sizes (the commonest profiled call's): the full batches run compiled."""
    torch.manual_seed(0)
    model = _Conv()
    twin = copy.deepcopy(model)  # (before optimize: a module is optimized in place)
    opt = specularch.optimize(model, backend="torchscript")
    with specularch.config.patch(profile_calls=profile_calls):
        for b in batches:
            torch.testing.assert_close(opt(*_images(b)), twin(*_images(b)))
    (graph,) = specularch.explain(opt).graphs
    assert graph.backend == "torchscript" and graph.note == "", graph
    outside = int(graph.sizes.rsplit("; ", 1)[-1].split()[0]) if "outside ran fx" in graph.sizes else 0
    assert outside <= batches.count(7), graph.sizes  # the short batches at most


def _halves(x, y):
    with torch.no_grad():
        return (x * 2).sum(1) + y.sum(1), x[:, :2] - 1


def _sliced(batch, width=6):
    """Rows of a wider table without its last column (``data[3:, :-1]``): not contiguous."""
    gen = torch.Generator().manual_seed(batch)
    data = torch.randn(batch + 3, width + 1, generator=gen)
    return [data[3:, :-1], torch.randn(batch, 2, generator=gen)]


def test_a_sliced_input_with_dynamic_sizes_is_compiled_with_its_strides_checked():
    """A non-contiguous input (a slice) is traced with torch's strides for it, and the ones
    it took as numbers are checked: a contiguous input of those sizes runs ``fx``."""
    calls = [_sliced(4), _sliced(5), _sliced(9), _sliced(7)]
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_halves, "torchscript", calls)
    graph_fn = _entry(opt).graph_fn
    assert isinstance(graph_fn, SizeChecked) and graph_fn.misses == 0, graph_fn
    assert "L['t0'].stride()[1] == 1" in graph_fn.expression, graph_fn.expression
    assert "L['t0'].is_contiguous()" not in graph_fn.expression, graph_fn.expression
    x, y = _sliced(6)
    torch.testing.assert_close(graph_fn(x, y), _halves(x, y))
    wider = _sliced(6, width=9)[0][:, :6]  # rows 10 apart: its row stride was a symbol
    torch.testing.assert_close(graph_fn(wider, y), _halves(wider, y))
    assert graph_fn.misses == 0
    every_other = torch.randn(6, 12)[:, ::2]  # columns 2 apart: traced as 1
    torch.testing.assert_close(graph_fn(every_other, y), _halves(every_other, y))
    assert graph_fn.misses == 1
    contiguous = x.contiguous()
    torch.testing.assert_close(graph_fn(contiguous, y), _halves(contiguous, y))


def _with_size_check(gm, as_python_bool: bool):
    """``gm`` returning also ``same_value(x.size(0), 5)`` (an in-graph check of a size the
    program used in Python), or its ``bool()``, which a trace can only take as a number."""
    graph = gm.graph
    (output,) = [n for n in graph.nodes if n.op == "output"]
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_before(output):
        size = graph.call_method("size", (placeholder, 0))
        check = graph.call_function(same_value, (size, 5))
        if as_python_bool:
            check = graph.call_function(bool, (check,))
    size.meta["example"], check.meta["example"] = 5, True
    output.args = (tuple(output.args[0]) + (check,),)
    gm.recompile()
    gm.meta["non_tensor_outputs"] = True
    gm.meta["size_hints"] = []  # (as capture makes it for a graph that checks in-graph)
    return gm


@pytest.mark.parametrize("as_python_bool", [False, True])
def test_an_in_graph_check_of_a_dynamic_size_is_compiled(as_python_bool):
    """The check is a symbolic boolean in the trace, computed for every size; where the trace
    had to take it as a Python bool it fixed the size to the number, and the compiled form
    runs for that size only (``fx`` for the others, whose check then says False)."""
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_pair_sums, "fx", [_rows(4, 4), _rows(5, 5)])
    gm = _with_size_check(copy.deepcopy(_entry(opt).capture.graph_module), as_python_bool)
    flat = _torch_compilers.flatten(gm, _rows(5, 5))
    meta = flat.meta()
    assert ("L['t0'].size()[0] == 5" in meta["size_guards"]) is as_python_bool, meta
    run = _torch_compilers.run_scripted(_torch_compilers.script_aten_graph(flat.graph), meta, gm.forward)
    for sizes in ((5, 5), (6, 6), (5, 3)):
        out, expected = run(*_rows(*sizes)), gm(*_rows(*sizes))
        assert out[-1] is expected[-1] is (sizes[0] == 5)
        torch.testing.assert_close(list(out[:-1]), list(expected[:-1]))
    assert run.misses == (1 if as_python_bool else 0)  # (6, 6); the second input's size is free


def test_a_compiled_form_for_dynamic_sizes_needs_its_fallback():
    def compiled(*args):
        return args
    assert checked(compiled, {"converted": []}, None) is compiled
    with pytest.raises(ValueError, match="needs its fx code"):
        checked(compiled, {"size_guards": "2 <= L['t0'].size()[0]"}, None)
    guarded = checked(compiled, {"size_guards": "2 <= L['t0'].size()[0]"}, lambda *a: "fx")
    x = torch.zeros(3)
    assert guarded(x)[0] is x and guarded.misses == 0
    assert guarded(torch.zeros(1)) == "fx" and guarded.misses == 1


def test_the_cache_key_of_a_dynamic_graph_leaves_out_its_dynamic_sizes():
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_pair_sums, "fx", [_rows(4, 4), _rows(5, 5)])
    gm = _entry(opt).capture.graph_module

    def key(*sizes, width=3):
        return compile_cache.entry_key(gm, _rows(*sizes, width=width), "torchscript", "flattened")
    assert key(4, 4) == key(9, 9)
    assert key(4, 4) != key(4, 4, width=5)  # a static size


def _mlp_pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    twin = copy.deepcopy(model)

    def step_of(m):
        return ce_train_step(m, torch.optim.Adam(m.parameters(), lr=0.01))
    return model, twin, step_of(model), step_of(twin)


def _batches(sizes):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))
            for n in sizes]


def _train(opt, eager, sizes):
    for x, y in _batches(sizes):
        assert opt(x, y) == pytest.approx(eager(x, y), rel=1e-5)


def _tiered_with_varying_batches(backend):
    """Tiered: the step's batch size varies; ``backend``'s candidate, compiled in the worker
    process for every batch size, is timed and decided like any other, and whatever the
    decision the parameters stay within rounding of eager's. Its tier event."""
    model, twin, step, eager = _mlp_pair()
    opt = specularch.optimize(step)
    sizes = [5, 7, 9, 4, 8, 6, 1, 10]
    for _ in range(40):
        _train(opt, eager, sizes)
        assert tiering.wait(timeout=300)
        entry = _entry(opt)
        if entry.tier is not None and entry.tier.settled:
            break
    else:
        raise AssertionError("tiering did not settle")
    (event,) = [e for e in entry.tier.events if e.candidate == backend]
    assert event.compiled_in.startswith("worker process") and event.decision in ("kept", "rejected"), event
    assert "compiled for every size of its dynamic dimensions" in str(event), event
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    return event


def test_a_training_step_with_varying_batches_is_compiled_by_the_worker(counted_workers, candidates):
    candidates("torchscript")
    _tiered_with_varying_batches("torchscript")


@pytest.mark.slow
def test_inductors_candidate_for_varying_batches_comes_from_the_worker(counted_workers, candidates):
    candidates("inductor")
    event = _tiered_with_varying_batches("inductor")
    assert "standalone_compile artefact" not in event.compiled_in, event  # a package


@pytest.mark.slow
def test_an_aotinductor_package_for_every_size_checks_exports_ranges_too(tmp_path):
    """The worker's AOTInductor package for dynamic sizes: exported with those dimensions
    dynamic; what it holds for (export's ranges and equal dimensions) joins the trace's
    assumptions in the size check."""
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_pair_sums, "fx", [_rows(4, 4), _rows(5, 5)])
    gm = _entry(opt).capture.graph_module
    path = str(tmp_path / "artefact")
    meta = _torch_compilers.inductor_artifact(gm, _rows(5, 5), path, threads=1, aoti=True)
    assert meta["format"] == "aoti", meta
    assert meta["size_guards"].endswith(" and (2 <= L['t0'].size()[0] and 2 <= L['t1'].size()[0])"), meta
    run = _torch_compilers.load_inductor_artifact(path, meta, gm.forward)
    for x, y in (_rows(3, 8), _rows(40, 2), _rows(1, 3)):
        torch.testing.assert_close(run(x, y)[0], _pair_sums(x, y))
    assert run.misses == 1


@pytest.mark.slow
def test_inductor_runs_only_the_sizes_and_layouts_it_was_compiled_for():
    """Inductor's compiled code assumes its inputs' strides and what its trace assumed of
    the sizes: a batch of one and a transposed input run ``fx``."""
    calls = [_rows(4, 4), _rows(5, 5), _rows(9, 9), _rows(6, 2), _rows(1, 1), _rows(33, 33)]
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_pair_sums, "inductor", calls)
    graph_fn = _entry(opt).graph_fn
    assert isinstance(graph_fn, SizeChecked) and graph_fn.misses == 1, graph_fn
    x, y = torch.randn(3, 7).t(), torch.randn(7, 3)
    torch.testing.assert_close(graph_fn(x, y)[0], _pair_sums(x, y))
    assert graph_fn.misses == 2


def test_a_flattened_dynamic_graph_keeps_its_static_sizes_as_numbers():
    """Only the dimensions that varied become symbols: a parameter's sizes stay numbers
    (the compiled code may specialise on them; our guards check them)."""
    model, twin, step, eager = _mlp_pair()
    opt = specularch.optimize(step, backend="fx")
    _train(opt, eager, [5, 7, 9])
    gm = _entry(opt).capture.graph_module
    flat = _torch_compilers.flatten(gm, example_inputs(gm))
    shapes = [n.meta["val"].shape for n in flat.graph.graph.nodes if n.op == "placeholder"
              and isinstance(n.meta.get("val"), torch.Tensor)]
    symbolic = [[isinstance(s, torch.SymInt) for s in shape] for shape in shapes]
    assert symbolic[:2] == [[True, False], [True]], shapes
    assert not any(any(row) for row in symbolic[2:]), shapes


def test_cuda_graphs_still_refuse_dynamic_sizes():
    from specularch.fx_lower.cudagraphs import reason_without_device
    with specularch.config.patch(profile_calls=0):
        opt = _optimized(_pair_sums, "fx", [_rows(4, 4), _rows(5, 5)])
    gm = _entry(opt).capture.graph_module
    assert reason_without_device(gm) == ("it has dynamic sizes (a CUDA graph replays the sizes "
                                         "it was recorded with)")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def _forward_and_backward(backend):
    """``optimize(model)``, the loss's backward outside it: the batch size varies, so the
    forward graph (whose result needs autograd) has a dynamic batch dimension."""
    torch.manual_seed(0)
    model = _Net()
    twin = copy.deepcopy(model)
    fast = specularch.optimize(model, backend=backend)
    for n in (4, 6, 9, 1, 13, 5):
        x = torch.randn(n, 6)
        out, ref = fast(x), twin(x)
        torch.testing.assert_close(out, ref)
        out.square().sum().backward()
        ref.square().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    return specularch.explain(fast).graphs


def test_a_forward_whose_result_needs_autograd_is_compiled_for_every_size():
    """Through AOT autograd: forward and backward graphs scripted once, the backward taking
    the batch size as an ``int``; a batch of one runs ``fx``."""
    graphs = _forward_and_backward("torchscript")
    assert [(g.backend, g.note) for g in graphs] == [("torchscript", "")], graphs
    assert graphs[0].sizes == ("compiled for every size where L['x'].is_contiguous() and "
                               "(2 <= L['x'].size()[0]); 1 call(s) outside ran fx"), graphs[0].sizes


@pytest.mark.slow
def test_inductor_compiles_a_forward_whose_result_needs_autograd_for_every_size():
    graphs = _forward_and_backward("inductor")
    assert [(g.backend, g.note) for g in graphs] == [("inductor", "")], graphs
    assert graphs[0].sizes.endswith("; 1 call(s) outside ran fx"), graphs[0].sizes


def test_a_second_run_loads_the_graph_compiled_for_every_size(tmp_path):
    """The compile cache's key leaves out the dynamic sizes: a run whose sizes differ from the
    first run's loads its compiled graph, and checks it as the first run did."""
    first = [_rows(4, 4), _rows(5, 5), _rows(9, 9)]
    second = [_rows(7, 3), _rows(8, 11), _rows(1, 6), _rows(20, 2)]
    lines = []
    for calls in (first, second):
        specularch.reset()
        with specularch.config.patch(profile_calls=0, compile_cache_dir=str(tmp_path)):
            opt = _optimized(_pair_sums, "torchscript", calls)
        (graph,) = specularch.explain(opt).graphs
        lines.append((graph.backend, graph.cached, graph.sizes.rsplit("; ", 1)[-1]))
    assert lines == [("torchscript", False, "0 call(s) outside ran fx"),
                     ("torchscript", True, "1 call(s) outside ran fx")], lines


def test_a_dynamic_graph_compiled_per_value_of_a_number_checks_sizes_in_each():
    """``clamp(max=k)`` takes the number itself: one compile per value of ``k``, each for
    every batch size, each size-checked."""
    def clipped(x, k, lr):
        with torch.no_grad():
            return x.clamp(max=k) * lr + torch.full((x.shape[0], 1), 2.0)
    calls = [(torch.randn(n, 3), (0.5, 1.0)[i % 2], 0.1 * i)
             for i, n in enumerate((3, 4, 5, 6, 1, 9, 12))]
    with specularch.config.patch(profile_calls=2):
        opt = _optimized(clipped, "torchscript", calls)
    (graph,) = specularch.explain(opt).graphs
    assert (graph.backend, graph.note) == ("torchscript", ""), graph
    assert graph.sizes == ("compiled for every size where L['x'].is_contiguous() and "
                           "(2 <= L['x'].size()[0]) (2 compiles, one per value of a number); "
                           "1 call(s) outside ran fx"), graph.sizes
