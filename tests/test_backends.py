"""Backends in the registry, differential against eager: values and gradients for each CPU
backend, whole training steps (SGD with momentum and weight decay, Adam, AdamW) on every
backend with the backend that ran each graph asserted, the fallback to `fx` (with a note
saying why) for graphs a backend cannot take, and the CUDA graphs backend: its decision and
its static-buffer replay are checked on CPU (a stand-in recorder re-runs the flattened graph
into the same output buffers, as a replay overwrites them); the real capture only on a GPU."""
import copy
import os

import pytest
import torch
from torch import nn

import specularch
from specularch.fx_lower import cudagraphs
from specularch.fx_lower.backends import BACKENDS, get_backend, register_backend

pytestmark = pytest.mark.usefixtures("no_profiling")

CG_ON_CPU = "cudagraphs_replay_on_cpu"


class RerunRecorder:
    """Stands in for ``cudagraphs.CudaGraphRecorder`` on CPU: ``replay()`` runs the captured
    function again (it reads the static input buffers) and copies its results into the same
    static output buffers, as a CUDA graph replay does."""

    def __init__(self, fn):
        self.fn = fn
        self.outputs = fn()

    def replay(self):
        for buffer, value in zip(self.outputs, self.fn()):
            buffer.copy_(value)


@pytest.fixture
def cudagraphs_on_cpu():
    """The cudagraphs backend with the CPU stand-in recorder and every check but the device."""
    register_backend(CG_ON_CPU, lambda gm, inputs: cudagraphs.compile_cudagraph(
        gm, inputs, recorder=RerunRecorder), supports=cudagraphs.reason_without_device,
        help="test only: cudagraphs' flattening and static buffers, replayed by re-running")
    yield CG_ON_CPU
    BACKENDS.pop(CG_ON_CPU)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _train_compare(backend, steps=3):
    model = _mlp()
    ref = copy.deepcopy(model)
    specularch.optimize(model, backend=backend)
    for step in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        out, expected = model(x), ref(x)
        torch.testing.assert_close(out, expected)
        out.square().mean().backward()
        expected.square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    return specularch.explain(model)


@pytest.mark.parametrize("backend", ["fx", "torchscript"])
def test_backend_values_and_gradients(backend):
    e = _train_compare(backend)
    assert e.fallbacks == [] and e.graphs, str(e)
    assert e.graphs[0].backend == backend and e.graphs[0].note == "", str(e)


@pytest.mark.parametrize("backend", ["torchscript", pytest.param("inductor", marks=pytest.mark.slow)])
def test_lstm_forward_through_aot_autograd_is_compiled_quietly(recwarn, backend):
    """An ``nn.LSTM`` optimized alone (its results need autograd: AOT autograd, then
    TorchScript or Inductor) compiles and matches eager within rounding: traced with oneDNN's
    layer, TorchScript's failed to freeze (its constants compared under AOT's fake mode) and
    then, scripted, raised "strides() called on an undefined Tensor", Inductor's raised a
    TypeError; each sent it to fx. Avoiding oneDNN's layer in the trace must not warn in the
    program (``torch.backends.mkldnn.flags`` did)."""
    torch.manual_seed(0)
    model = nn.LSTM(8, 12, num_layers=2)
    ref = copy.deepcopy(model)
    opt = specularch.optimize(model, backend=backend)
    for i in range(6):
        x = torch.randn(5, 3, 8)
        (out, (h, c)), (e_out, (e_h, e_c)) = opt(x), ref(x)
        for got, expected in ((out, e_out), (h, e_h), (c, e_c)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        (out.sum() + c.sum()).backward()
        (e_out.sum() + e_c.sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    e = specularch.explain(opt)
    assert [(g.backend, g.note) for g in e.graphs] == [(backend, "")], str(e)
    assert torch.backends.mkldnn.enabled
    assert not [w for w in recwarn if "oneDNN" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.slow
def test_inductor_values_and_gradients(monkeypatch):
    pointer = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"
    monkeypatch.delenv(pointer, raising=False)
    e = _train_compare("inductor", steps=2)
    assert e.graphs[0].backend == "inductor", str(e)
    # Inductor publishes an address of this process there; a child process inheriting it
    # crashes when it loads a compiled module (torchrun workers started later, e.g.)
    assert pointer not in os.environ


def test_compiling_backend_compiles_a_dynamic_graph_once_for_every_size():
    """Batch size and a number both varied while profiling: one TorchScript compile serves
    every batch size its trace holds for; size 1 (traced as at least 2) runs the fx code."""
    def scaled(x, s):
        return torch.relu(x) * s
    opt = specularch.optimize(scaled, backend="torchscript")
    with specularch.config.patch(profile_calls=2):
        for i, s in enumerate([0.5, 2.0, 3.0, 1.5, 2.5, 0.25]):
            x = torch.randn((2, 3, 4, 9, 1, 17)[i], 3)
            torch.testing.assert_close(opt(x, s), scaled(x, s))
    e = specularch.explain(opt)
    assert [g.backend for g in e.graphs] == ["torchscript"] and e.graphs[0].note == "", str(e)
    assert e.graphs[0].sizes == ("compiled for every size where L['x'].is_contiguous() and "
                                 "(2 <= L['x'].size()[0]); 1 call(s) outside ran fx"), str(e)


def test_clipped_training_step_with_a_short_last_batch_is_compiled_for_every_size():
    """A step whose batch size changed is dynamic; its gradients keep their parameters'
    static sizes (the clipping reads them), so nothing about them is checked in the graph,
    and TorchScript compiles the whole step once for every batch size."""
    def make():
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss.item()
        return model, train_step

    model, train_step = make()
    twin, eager = make()
    step = specularch.optimize(train_step, backend="torchscript")
    with specularch.config.patch(profile_calls=0):
        for batch in (4, 4, 3, 3, 5, 1, 7):
            x, y = torch.randn(batch, 3), torch.randn(batch, 2)
            assert step(x, y) == pytest.approx(eager(x, y), rel=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    e = specularch.explain(step)
    assert e.graphs[0].backend == "torchscript" and e.graphs[0].note == "", str(e)
    assert "specularch_guards_guard_same_value" not in e.graphs[0].code, str(e)
    assert e.graphs[0].sizes.endswith("1 call(s) outside ran fx"), str(e)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cudagraphs_without_cuda_says_so_and_stays_correct():
    e = _train_compare("cudagraphs", steps=1)
    assert e.graphs[0].backend == "fx"
    assert "CUDA" in e.graphs[0].note, str(e)


def _retained_outputs_compare(model, ref, device, calls=4):
    """Outputs kept across calls must stay valid: a replay overwrites the static outputs."""
    with torch.no_grad():
        pairs = [(model(x), ref(x)) for x in (torch.randn(5, 6, device=device) for _ in range(calls))]
    for out, expected in pairs:
        torch.testing.assert_close(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cudagraphs_replays_inference_graph_on_gpu():
    """Parameters require grad even in eval mode under no_grad: the graph needs no autograd,
    so CUDA graphs take it."""
    model = _mlp().cuda().eval()
    ref = copy.deepcopy(model)
    specularch.optimize(model, backend="cudagraphs")
    _retained_outputs_compare(model, ref, "cuda")
    e = specularch.explain(model)
    assert e.graphs[0].backend == "cudagraphs" and e.graphs[0].note == "", str(e)


def test_cudagraphs_static_buffers_replayed_on_cpu(cudagraphs_on_cpu):
    model = _mlp().eval()
    ref = copy.deepcopy(model)
    specularch.optimize(model, backend=cudagraphs_on_cpu)
    _retained_outputs_compare(model, ref, "cpu")
    e = specularch.explain(model)
    assert e.graphs[0].backend == cudagraphs_on_cpu and e.fallbacks == [], str(e)


def _captured_graph(fn, *args):
    """The GraphModule specularch captures for ``fn(*args)`` (fx backend)."""
    from specularch.api import _state_of
    fn = specularch.optimize(fn, backend="fx")
    fn(*args)
    return _state_of(fn).entries[0].capture.graph_module


def test_cudagraphs_decides_by_what_needs_autograd_not_by_requires_grad():
    model = _mlp()
    x = torch.randn(5, 6)
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        inference = _captured_graph(lambda x: model.eval()(x), x)
    assert cudagraphs.reason_without_device(inference) is None
    forward_with_grad = _captured_graph(lambda x: model.eval()(x), x)
    assert "autograd" in cudagraphs.reason_without_device(forward_with_grad)
    dropout = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5)).train()
    with torch.no_grad():
        random = _captured_graph(lambda x: dropout(x), x)
    assert "random" in cudagraphs.reason_without_device(random)
    step, _ = _training_step("sgd_momentum", _mlp())
    assert cudagraphs.reason_without_device(_captured_graph(step, *_batch(0))) is None
    if not torch.cuda.is_available():
        assert "CUDA" in cudagraphs.supports(inference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_cudagraphs_replays_whole_training_step_on_gpu(opt_name):
    """Forward, backward and the optimizer update in one CUDA graph; the commit copies the
    results (cloned out of the static buffers) into parameters, .grad and optimizer state."""
    _compare_training("cudagraphs", opt_name, device="cuda")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(specularch.fx_lower.UnknownBackendError, match="available"):
        specularch.optimize(_mlp(), backend="nope")


# Modules of the corpus a backend does not run itself, and a word of the note that says why.
_CORPUS_EXCEPTIONS = {  # module -> why its graph ran fx (none since AOT's TorchScript graphs
    # are frozen outside its fake mode: CausalSelfAttention's raised at run time before)
    "torchscript": {},
    "inductor": {},
}


def _module_corpus(backend, grad=True):
    """(module name, [(backend, note) of each graph]) for every module of the corpus, each
    checked against eager (values, gradients, buffers) within float tolerance."""
    from differential import check_module
    from test_programs_modules import MODULES
    ran = {}
    for make_module, make_args in MODULES:
        e = check_module(make_module, make_args, grad=grad, expect="graph", backend=backend,
                         atol=1e-5, rtol=1e-4)
        assert e.fallbacks == [], str(e)
        ran[make_module.__name__] = [(g.backend, g.note) for g in e.graphs]
    return ran


@pytest.mark.parametrize("backend", ["torchscript", pytest.param("inductor", marks=pytest.mark.slow)])
def test_module_corpus_gradients_with_compiling_backend(backend):
    """Every module of the corpus, with gradients, through a compiling backend: values and
    gradients within float tolerance of eager, and the backend ran every graph except the
    listed ones, which say why."""
    for name, graphs in _module_corpus(backend).items():
        assert graphs, name
        expected = _CORPUS_EXCEPTIONS[backend].get(name)
        for ran, note in graphs:
            if expected is None:
                assert (ran, note) == (backend, ""), (name, note)
            else:
                assert ran == "fx" and expected in note, (name, note)


def test_module_corpus_on_cudagraphs_replayed_on_cpu(cudagraphs_on_cpu):
    """Under no_grad every module runs flattened from static buffers; with grad enabled the
    results need autograd and every graph is left to fx, saying so."""
    with torch.no_grad():
        for name, graphs in _module_corpus(cudagraphs_on_cpu, grad=False).items():
            assert graphs and all(g == (cudagraphs_on_cpu, "") for g in graphs), (name, graphs)
    for name, graphs in _module_corpus(cudagraphs_on_cpu, grad=True).items():
        assert all(ran == "fx" and "need autograd" in note for ran, note in graphs), (name, graphs)


# --------------------------------------------------------------------------- training steps

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3,
                                              dampening=0.1),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99)),
}


def _batch(step, device="cpu"):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)


def _training_step(opt_name, model):
    opt = OPTIMIZERS[opt_name](model.parameters())

    def train_step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step, opt


def _compare_training(backend, opt_name, device="cpu", steps=5):
    """Eager vs optimized training (an LR schedule changes the learning rate, a graph input,
    between steps): loss, parameters, gradients and optimizer state after every step."""
    exact = backend == "fx"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    model, ref = _mlp().to(device), _mlp().to(device)
    fast, opt = _training_step(opt_name, model)
    slow, ref_opt = _training_step(opt_name, ref)
    fast = specularch.optimize(fast, backend=backend)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    with specularch.config.patch(profile_calls=1):
        for step in range(steps):
            x, y = _batch(step, device)
            loss, expected = fast(x, y), slow(x, y)
            assert loss == expected if exact else abs(loss - expected) < 1e-5, (step, loss, expected)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, **tol)
                torch.testing.assert_close(p.grad, q.grad, **tol)
                state, ref_state = opt.state[p], ref_opt.state[q]
                assert state.keys() == ref_state.keys()
                for key in state:
                    torch.testing.assert_close(state[key], ref_state[key], **tol)
            for schedule in schedules:
                schedule.step()
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.stats.graph_hits >= steps - 2, str(e)
    assert e.graphs and all((g.backend, g.note) == (backend, "") for g in e.graphs), str(e)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("backend", ["fx", "torchscript", CG_ON_CPU,
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_training_step_on_every_cpu_backend(backend, opt_name, request):
    """The whole step (forward, backward, optimizer update) compiled by each backend
    available on CPU (torchscript, inductor and cudagraphs flatten it to one ATen graph)."""
    if backend == CG_ON_CPU:
        request.getfixturevalue("cudagraphs_on_cpu")
    _compare_training(backend, opt_name)


@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate"])
def test_flattening_backends_refuse_parameters_with_gradient_hooks(kind):
    """A flattened backward would skip hooks on the parameters (wrong gradients). Capture
    refuses such steps first; the backends refuse them too, should one reach them."""
    model = _mlp()
    step, _ = _training_step("sgd_momentum", model)
    gm = _captured_graph(step, *_batch(0))
    deciders = {name: get_backend(name).supports for name in ("torchscript", "inductor")}
    deciders["cudagraphs"] = cudagraphs.reason_without_device
    assert all(decide(gm) is None for decide in deciders.values())
    if kind == "register_hook":
        model[0].weight.register_hook(lambda g: g * 2)
    else:
        model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    for name, decide in deciders.items():
        assert "gradient hooks" in (decide(gm) or ""), name


def test_default_backend_per_device():
    """The default: tiered (``auto``: fx, then what measures fastest; docs/tiering.md) on CPU
    and CUDA; the configuration's default agrees with it."""
    from specularch.fx_lower import default_backend
    assert default_backend(None) == default_backend("cpu") == default_backend(torch.device("cpu")) == "auto"
    assert default_backend("cuda:1") == default_backend(torch.device("cuda", 0)) == "auto"
    assert default_backend("mps") == "fx"  # not measured: the backend that takes every graph
    from specularch.config import OPTIONS
    assert OPTIONS["backend"].default == default_backend("cpu")
