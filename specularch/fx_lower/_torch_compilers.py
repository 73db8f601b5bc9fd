"""Compat: the private/semi-private torch compiler entry points our backends use.

* ``functorch.compile.aot_module_simplified`` + ``ts_compile`` (AOT autograd: forward and
  backward graphs, each compiled by TorchScript);
* ``torch._inductor.compile_fx.compile_fx`` (Inductor; it runs AOT autograd itself);
* ``torch.fx.experimental.proxy_tensor.make_fx`` (flattening a graph, autograd included, to
  ATen ops) and ``torch._functorch.compile_utils.strip_overloads`` (ATen graphs TorchScript
  can compile).

Imports are lazy: importing Inductor costs seconds and pulls in ``torch._dynamo``, which
specularch never needs unless that backend is chosen.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
from typing import Callable

import torch
import torch.fx

from . import _torch_aoti, _torch_shapes, compile_cache
from ._torch_background import compiling_in_background
from .dynamic_sizes import checked, dynamic_inputs, size_hints
from .passes import (as_tensor_input, graph_outputs, number_outputs, number_outputs_as_tensors,
                     scalar_inputs_as_tensors)


def compile_threads_from_environment() -> None:
    """Inductor's compile threads as ``TORCHINDUCTOR_COMPILE_THREADS`` says, where its config
    was imported before the variable was set (a worker forked from a program that had
    imported Inductor: the config read the program's environment)."""
    config = sys.modules.get("torch._inductor.config")
    value = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    if config is not None and value and value.isdigit():
        config.compile_threads = int(value)


def _quiet_torchscript():
    """TorchScript's deprecation and annotation warnings silenced, except in a background
    compile (``compile_cache.quiet_warnings``)."""
    return compile_cache.quiet_warnings(not compiling_in_background())


def aot_torchscript(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """AOT autograd's forward and backward graphs, each scripted (``ts_compile``); for dynamic
    sizes traced with symbols (``_aot_dynamic``), where the backward graph takes sizes as
    ``int`` inputs."""
    from functorch.compile import aot_module_simplified, ts_compile

    def compile_one(graph: torch.fx.GraphModule, inputs: list):
        sizes = [node for node in graph.graph.nodes  # (TorchScript takes an unannotated
                 if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.SymInt)]
        for node in sizes:                          # input for a Tensor)
            node.type = int
        if sizes:
            graph.recompile()
        # Outside AOT autograd's fake mode: freezing compares the graph's tensor constants
        # (real tensors) with torch.equal, which the fake mode refuses as data-dependent
        # (an nn.LSTM forward's graph: DataDependentOutputException: aten.equal.default).
        # The inputs stay fake, so ts_compile does not run the graph.
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            return ts_compile(graph, inputs)

    traced = _generic_lstms(gm)  # (oneDNN's rnn layer scripted raises: see there)

    def compile_with(inputs: list) -> Callable:
        return aot_module_simplified(traced, inputs, fw_compiler=compile_one, bw_compiler=compile_one)
    return _aot_dynamic(gm, example_inputs, compile_with) or compile_with(example_inputs)


def _aot_dynamic(gm: torch.fx.GraphModule, example_inputs: list,
                 compile_with: Callable[[list], Callable]) -> Callable | None:
    """For a graph with dynamic sizes whose results need autograd: ``compile_with`` (an AOT
    autograd compile of ``gm``) called on fake inputs whose dynamic dimensions are symbols,
    in their shape environment, the backward graph compiled now too; the result checked
    against what the compile assumed of the sizes (``dynamic_sizes.SizeChecked``). None for
    a graph without dynamic sizes."""
    from torch._functorch import config as functorch_config
    dynamic = dynamic_inputs(gm)
    if not dynamic:
        return None
    fallback = gm.forward  # (before Inductor's passes rewrite ``gm``)
    example_inputs = _torch_shapes.hinted(example_inputs, dynamic, size_hints(gm))
    fakes = _torch_shapes.symbolic_inputs(example_inputs, dynamic)
    with _torch_shapes.traced_with(fakes), \
            functorch_config.patch(force_non_lazy_backward_lowering=True):
        compiled = compile_with(fakes)
    meta = {"size_guards": _torch_shapes.size_guards(
        fakes, dynamic, _torch_shapes.contiguous_inputs(example_inputs, dynamic))}
    return checked(compiled, meta, fallback)


_INDUCTOR_POINTER = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


@contextlib.contextmanager
def _no_leaked_pointer():
    """Inductor publishes an address in this process through ``os.environ`` for the compiled
    modules it loads while compiling; child processes (torchrun workers, subprocesses) would
    inherit it and crash when they load a compiled module of their own. Put the variable back
    as it was once the compile is done."""
    before = os.environ.get(_INDUCTOR_POINTER)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_INDUCTOR_POINTER, None)
        else:
            os.environ[_INDUCTOR_POINTER] = before


@contextlib.contextmanager
def _inductor_caches(tracing: bool = True):
    """Inductor's own on-disk caches (FX graph cache, AOT autograd cache) on, in
    ``<compile cache>/inductor`` unless the program chose a directory itself
    (``TORCHINDUCTOR_CACHE_DIR``). Yields a function telling whether the compile was
    answered from the FX graph cache. ``tracing=False``: without the static-shape tracing
    context (``torch.export`` makes its own)."""
    from torch._dynamo.utils import counters
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    folder = compile_cache.directory("inductor")
    if folder is None:
        yield lambda: False
        return
    hits = counters["inductor"]["fxgraph_cache_hit"]
    with inductor_config.patch(fx_graph_cache=True), \
            functorch_config.patch(enable_autograd_cache=True), \
            (contextlib.nullcontext() if compile_cache.inductor_dir_chosen()
             else temporary_cache_dir(folder)), \
            (_static_shape_env() if tracing else contextlib.nullcontext()):
        yield lambda: counters["inductor"]["fxgraph_cache_hit"] > hits


@contextlib.contextmanager
def _no_inductor_caches():
    """Inductor's FX graph cache and AOT autograd's cache off (whatever the program's
    settings); yields ``hit``, always False."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield lambda: False


@contextlib.contextmanager
def _static_shape_env():
    """The tracing context Inductor's caches look for (they bypass a compile whose context
    has no shape environment, as one outside ``torch.compile`` has), with static shapes:
    the shapes the graph was captured with, as without it. Static only together with
    ``_compile_static``: the mode's ``static_shapes`` alone does not keep AOT autograd from
    making every input size a symbol of this ShapeEnv."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    if TracingContext.try_get() is not None:
        yield
        return
    with tracing(TracingContext(FakeTensorMode(static_shapes=True, shape_env=ShapeEnv()))):
        yield


def _compile_static(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """``compile_fx`` for the example inputs' shapes, as ``standalone_compile`` does for
    ``dynamic_shapes="from_example_inputs"``. Without ``ignore_shape_env``, AOT autograd
    fakes every input with ``static_shapes=False`` in the tracing context's ShapeEnv (a
    symbol per distinct size, whatever the mode's ``static_shapes`` says), and a size that
    reaches float arithmetic (BatchNorm's ``n / (n - 1)``) is a SymFloat that Inductor's
    ``tensorify_python_scalars`` pass cannot rebuild from a symbol no graph node binds:
    ``KeyError: s36``. The graph's guards hold its sizes fixed anyway."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs, ignore_shape_env=True)


def _tagged(compiled: Callable, cached: bool) -> Callable:
    return compile_cache.mark_cached(compiled) if cached else compiled


def inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor with eager-identical random numbers (``fallback_random``); the backward graph
    is compiled now too, not lazily in the first ``backward()``."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    dynamic = bool(dynamic_inputs(gm))
    traced = _generic_lstms(gm)  # (oneDNN's rnn layer compiled raises: see there)
    # Inductor's on-disk caches only for static shapes: a dynamic compile answered from them
    # can be code specialised on a size (nn.GRU's decomposition loops over the sequence)
    # whose assumption our shape environment never sees (``size_guards`` would let every
    # size through; measured: a second run's GRU raised "expected size 4==4, stride 5==11")
    with inductor_config.patch(fallback_random=True), \
            functorch_config.patch(force_non_lazy_backward_lowering=True), _no_leaked_pointer(), \
            (_no_inductor_caches() if dynamic else _inductor_caches()) as hit:
        compiled = _aot_dynamic(gm, example_inputs, lambda fakes: compile_fx(traced, fakes)) \
            if dynamic else _compile_static(traced, example_inputs)
        return _tagged(compiled, hit())


class Flattened:
    """A captured graph flattened to ATen ops without autograd (see ``flatten``): ``graph``
    takes ``inputs`` (the example inputs with Python numbers at positions ``converted`` made
    0-d tensors) and returns what the captured graph returns, but the Python numbers at
    positions ``numbers``, which it returns as 0-d tensors (``captured_outputs``)."""

    def __init__(self, graph: torch.fx.GraphModule, inputs: list, converted: list[int],
                 dynamic: dict[int, list[int]] | None = None, fakes: list | None = None,
                 numbers: list[int] | None = None):
        self.graph, self.inputs, self.converted = graph, inputs, converted
        self.dynamic, self.fakes, self.numbers = dynamic or {}, fakes, numbers or []

    def meta(self) -> dict:
        """What the compiled form's caller needs: positions of converted numbers and their
        devices, and, for dynamic sizes, what the trace (and the compile, which may add to
        it) assumed of them (``dynamic_sizes``)."""
        meta = {"converted": self.converted,
                "devices": [str(self.inputs[i].device) for i in self.converted]}
        if self.numbers:
            meta["number_outputs"] = self.numbers
        if self.dynamic:
            placeholders = [n.meta["val"] for n in self.graph.graph.nodes if n.op == "placeholder"]
            meta["size_guards"] = _torch_shapes.size_guards(
                placeholders, self.dynamic, _torch_shapes.contiguous_inputs(self.inputs, self.dynamic))
        return meta

    def arguments(self, args) -> list:
        """The call's graph inputs as the flattened graph takes them."""
        args = list(args)
        for i in self.converted:
            args[i] = as_tensor_input(args[i], self.inputs[i].device)
        return args


def flatten(gm: torch.fx.GraphModule, example_inputs: list, *, tracing_mode: str = "symbolic",
            scalar_device=None) -> Flattened:
    """For graphs whose outputs need no autograd (inference, whole training steps with an
    in-graph ``autograd.grad``): trace the graph to ATen ops with ``make_fx`` (``symbolic``:
    every size a symbol; ``fake``: shapes specialised), so that the backward pass becomes
    explicit ops and the result runs under ``no_grad``. Python-number inputs become 0-d
    tensors (on ``scalar_device``), so their values are inputs, not constants. A graph with
    dynamic sizes (``dynamic_sizes.dynamic_inputs``) is traced with those dimensions, and
    only those, as symbols (``_torch_shapes``), whatever ``tracing_mode`` says: one compile
    for every size, checked against what the trace assumed (``Flattened.meta``); an example
    size of 0 or 1 there is traced as 2 (``_torch_shapes.hinted``). Python numbers the graph
    returns are returned as 0-d tensors (``passes.number_outputs_as_tensors``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    dynamic, hints = dynamic_inputs(gm), size_hints(gm)
    gm, converted = scalar_inputs_as_tensors(gm)
    inputs = list(example_inputs)
    for i in converted:
        inputs[i] = as_tensor_input(inputs[i], scalar_device)
    if dynamic:
        inputs = _torch_shapes.hinted(inputs, dynamic, hints)
    numbers = number_outputs(gm) if gm.meta.get("non_tensor_outputs") else []
    if numbers is None:
        raise TypeError("the graph returns a value that is neither a tensor nor a number")
    if numbers:
        number_outputs_as_tensors(gm, numbers)
    fakes = _torch_shapes.symbolic_inputs(inputs, dynamic) if dynamic else None
    _generic_lstms(gm, in_place=True)  # (gm is scalar_inputs_as_tensors' copy)
    with torch.enable_grad():
        if dynamic:
            flat = make_fx(gm, tracing_mode="symbolic")(*fakes)
        else:
            flat = make_fx(gm, tracing_mode=tracing_mode)(*inputs)
    flat.meta["constructed_by"] = "specularch.fx_lower._torch_compilers.flatten (make_fx)"
    _same_output_dtypes(gm, flat)
    return Flattened(flat, inputs, converted, dynamic, fakes, numbers)


def _generic_lstms(gm: torch.fx.GraphModule, in_place: bool = False) -> torch.fx.GraphModule:
    """``gm`` (a copy, unless ``in_place``) with each ``nn.LSTM`` kernel call (``torch.lstm``,
    its ``input`` overload) made a call of ``_generic_lstm``, so that a trace records the
    layer as its cells' ops, not as oneDNN's ``aten.mkldnn_rnn_layer``: a kernel that makes
    the workspace its backward needs only while grad mode is on. A flattened graph runs under
    ``no_grad`` (so did Inductor's compiled forward): there it returned no workspace,
    Inductor's compiled code failed its size check ("expected Tensor()"), an AOTInductor
    package its backward call ("Expected IntList but got None"), a scripted AOT forward
    raised "strides() called on an undefined Tensor" and Inductor's AOT forward a TypeError,
    so those graphs never ran compiled. Every tracing path takes it: ``flatten`` and both
    AOT-autograd compilers (``aot_torchscript``, ``inductor``).
    Only the traced copy changes: eager and ``fx`` keep torch's choice of kernel. (This was
    oneDNN switched off while tracing: a process-wide flag, which the program's own LSTMs,
    on its thread beside a background compile, then saw too. GRU and plain RNN layers have
    no oneDNN kernel to avoid.)"""
    def is_lstm(node: torch.fx.Node) -> bool:
        return node.op == "call_function" and node.target is torch.lstm and len(node.args) == 9 \
            and isinstance(node.args[1], (tuple, list)) and not node.kwargs
    if not any(map(is_lstm, gm.graph.nodes)):
        return gm
    if not in_place:
        gm = copy.deepcopy(gm)
    for node in gm.graph.nodes:
        if is_lstm(node):
            node.target = _generic_lstm
    gm.recompile()
    return gm


def _generic_lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                  batch_first):
    """``torch.lstm(input, (h, c), params, ...)`` computed as torch's own decomposition of it
    computes it where oneDNN is off (``torch._decomp.decompositions.lstm_impl``, each layer by
    ``one_layer_lstm``)."""
    from torch._decomp import decompositions as decomp
    params = decomp.gather_params(params, has_biases, hx[0].size(2) != hx[1].size(2))
    out, final = decomp._rnn_helper(input, list(zip(hx[0], hx[1])), params, has_biases,
                                    num_layers, dropout, train, bidirectional, batch_first,
                                    decomp.one_layer_lstm)
    h, c = zip(*final)
    return out, torch.stack(h, 0), torch.stack(c, 0)


def _same_output_dtypes(gm: torch.fx.GraphModule, flat: torch.fx.GraphModule) -> None:
    """Raises where the flattened graph returns another dtype than capture saw (a number
    input made a 0-d tensor that promoted a result, ``scalar_inputs_as_tensors``): values
    within rounding of eager's, in the wrong dtype, would be silently wrong."""
    captured, traced = _output_values(gm, "example"), _output_values(flat, "val")
    if len(captured) == len(traced):
        _raise_on_changed_dtype(captured, traced, "flattening changed")


def _output_values(gm: torch.fx.GraphModule, key: str) -> list:
    """The values the graph returns, as its nodes' ``meta[key]`` (constants as they are)."""
    return [v.meta.get(key) if isinstance(v, torch.fx.Node) else v for v in graph_outputs(gm)]


def _raise_on_changed_dtype(captured: list, got: list, what: str) -> None:
    for i, (a, b) in enumerate(zip(captured, got)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
            raise TypeError(f"{what} output {i}'s dtype from {a.dtype} to {b.dtype}")


def captured_outputs(outputs, numbers: list[int] = ()) -> list:
    """A compiled flattened graph's outputs as the captured graph returns them: the Python
    numbers at ``numbers`` (returned as 0-d tensors, ``Flattened``) made numbers again, and
    every value once (each output is its own object; the commit makes each one a separate
    ``.grad``, state tensor, ...), where a compiler may return one tensor for two equal
    outputs (TorchScript does for the gradients of an LSTM's two bias vectors): repeated
    objects are copied."""
    outputs, seen = list(outputs), set()
    for i in numbers:
        outputs[i] = outputs[i].item()
    for i, out in enumerate(outputs):
        if isinstance(out, torch.Tensor):
            if id(out) in seen:
                outputs[i] = out.clone()
            else:
                seen.add(id(out))
    return outputs


def _without_autograd(flat: Flattened, compiled: Callable) -> Callable:
    converted, numbers = flat.converted, flat.numbers

    def run(*args):
        if converted:
            args = flat.arguments(args)
        with torch.no_grad():
            return captured_outputs(compiled(*args), numbers)

    return run


def inductor_without_autograd(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """``flatten`` (symbolic) compiled with Inductor, run under ``no_grad``."""
    from torch._inductor import config as inductor_config

    flat = flatten(gm, example_inputs, tracing_mode="symbolic")
    with torch.no_grad(), inductor_config.patch(fallback_random=True), _no_leaked_pointer(), \
            _inductor_caches(tracing=not flat.dynamic) as hit:
        compiled = _compile_dynamic(flat) if flat.dynamic else _compile_static(flat.graph, flat.inputs)
        cached = hit()
    return _tagged(checked(_without_autograd(flat, compiled), flat.meta(), gm.forward), cached)


def _compile_dynamic(flat: Flattened) -> Callable:
    """Inductor's compile of a graph flattened with symbolic dynamic sizes, for every size
    (in the shape environment of the flattening's fake inputs: ``_torch_shapes.traced_with``)."""
    from torch._inductor import standalone_compile
    with _torch_shapes.traced_with(flat.fakes):
        return standalone_compile(flat.graph, flat.fakes, dynamic_shapes="from_tracing_context")


def script_aten_graph(gm: torch.fx.GraphModule) -> torch.jit.ScriptModule:
    """An ATen-level GraphModule (from ``make_fx``) as a frozen TorchScript module: overloads
    stripped and device keywords made strings (what TorchScript accepts, as functorch's
    ``ts_compile`` does), in-place ops on fresh copies turned functional, then frozen (the
    only attributes are capture-time constants; parameters are inputs). Unlike
    ``ts_compile`` it never runs the graph (that would draw random numbers at compile time)."""
    from torch._functorch.compile_utils import strip_overloads
    strip_overloads(gm)
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._to_copy and len(node.args) == 1 and \
                set(node.kwargs) == {"dtype"}:
            node.target = torch.ops.aten.to
        node.kwargs = {k: v.type if isinstance(v, torch.device) else v
                       for k, v in node.kwargs.items()}
    gm.graph.lint()
    gm.recompile()
    with _quiet_torchscript():
        scripted = torch.jit.script(gm)
        torch._C._jit_pass_remove_mutation(scripted.graph)
        return torch.jit.freeze(scripted.eval())


def scripted_flattened(gm: torch.fx.GraphModule, example_inputs: list) -> tuple:
    """``flatten`` (fake tensors: static shapes, but for dynamic sizes) and
    ``script_aten_graph``: the frozen module and what ``run_scripted`` needs to call it
    (``Flattened.meta``)."""
    flat = flatten(gm, example_inputs, tracing_mode="fake")
    meta = flat.meta()
    return script_aten_graph(flat.graph), meta


def inductor_artifact(gm: torch.fx.GraphModule, example_inputs: list, path: str,
                      threads: int | None = None, aoti: bool = True) -> dict:
    """``flatten`` (static shapes, but for dynamic sizes) compiled by Inductor and saved to
    ``path`` (for ``load_inductor_artifact`` in another process); returns the metadata that
    call needs (for dynamic sizes, ``size_guards``: the trace's assumptions and, for a
    package, the ranges export gave its dimensions).
    The artefact is an AOTInductor package (``_torch_aoti``: the program loads it without
    importing Inductor), or, where export or AOTInductor fails for the graph (or ``aoti`` is
    False: the program cannot load packages), a ``standalone_compile`` artefact, whose load
    imports Inductor; ``meta["aoti_failed"]`` then says why. Inductor's own caches are used
    as in ``inductor_without_autograd``. ``threads``: the thread count the kernels are
    written for (Inductor's default is this process's ``torch.get_num_threads()``, one in
    a worker)."""
    from torch._inductor import config as inductor_config, standalone_compile
    flat = flatten(gm, example_inputs, tracing_mode="fake")
    why = _aoti_refusal(gm, flat) if aoti else "the program's torch cannot load its packages"
    package_guards = ""  # what a package for dynamic sizes holds for, besides the trace's
    if why is None:
        try:
            with _no_leaked_pointer(), _inductor_caches(tracing=False):
                if flat.dynamic:
                    data, package_guards = _torch_aoti.package_dynamic(
                        flat.graph, flat.inputs, threads, flat.dynamic)
                else:
                    data = _torch_aoti.package(flat.graph, flat.inputs, threads)
            with open(path, "wb") as f:
                f.write(data)
        except Exception as e:
            why = compile_cache.error_line(e)
    if why is None:
        try:
            _torch_aoti.test_run(path, flat.inputs)
            meta = flat.meta()
            if package_guards:
                meta["size_guards"] = f"{meta['size_guards']} and ({package_guards})"
            return {**meta, "format": AOTI}
        except Exception as e:
            why = f"its package compiled but raised when run: {compile_cache.error_line(e)}"
    with torch.no_grad(), inductor_config.patch(fallback_random=True, **{"cpp.threads": threads or -1}), \
            _no_leaked_pointer(), _inductor_caches(tracing=not flat.dynamic):
        if flat.dynamic:
            artifact = _compile_dynamic(flat)
        else:
            artifact = standalone_compile(flat.graph, flat.inputs,
                                          dynamic_shapes="from_example_inputs")
        artifact.save(path=path, format="binary")
    return {**flat.meta(), "format": STANDALONE, "aoti_failed": why}


AOTI, STANDALONE = "aoti", "standalone"  # meta["format"] of an Inductor artefact


def _aoti_refusal(gm: torch.fx.GraphModule, flat: Flattened) -> str | None:
    # On a GPU the package's kernels are loaded from the loader's folder on first use, and
    # nothing of it was measured there: such graphs keep the standalone artefact.
    devices = {t.device.type for t in flat.inputs if isinstance(t, torch.Tensor)}
    if devices - {"cpu"}:
        return f"used for CPU graphs only, not on {', '.join(sorted(devices - {'cpu'}))}"
    strided = set(flat.dynamic) - _torch_shapes.contiguous_inputs(flat.inputs, flat.dynamic)
    if strided:  # export's ``Dim.AUTO`` would decide their strides without our check
        return f"graph input(s) {sorted(strided)} with dynamic sizes are not contiguous"
    updated = _torch_aoti.updated_inputs(flat.graph)
    if updated:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return f"the graph updates its input {', '.join(names[i] for i in updated)} in place"
    return None


def load_inductor_artifact(path: str, meta: dict, fallback: Callable | None = None) -> Callable:
    """What ``inductor_artifact`` saved, as the captured graph's compiled form (run under
    ``no_grad``, Python numbers at ``meta["converted"]`` made 0-d tensors; ``fallback``, the
    captured graph's ``fx`` code, for sizes a dynamic graph was not compiled for). An AOTInductor
    package is loaded by the C++ loader (milliseconds, ``torch._inductor`` not imported); a
    ``standalone_compile`` artefact's load imports Inductor (seconds, holding the GIL), and
    the returned function's ``artefact_note`` says why it is one."""
    if meta.get("format") == AOTI:
        package = _torch_aoti.load(path)

        def compiled(*args):
            return package(list(args))
        note = ""
    else:
        from torch._inductor import CompiledArtifact
        with _no_leaked_pointer():
            compiled = CompiledArtifact.load(path=path, format="binary")
        note = f"standalone_compile artefact (AOTInductor: {meta.get('aoti_failed', '?')})"
    converted, devices, numbers = meta["converted"], meta["devices"], meta.get("number_outputs", [])

    def run(*args):
        if converted:
            args = _numbers_as_tensors(args, converted, devices)
        with torch.no_grad():
            return captured_outputs(compiled(*args), numbers)

    run.artefact_note = note
    if meta.get("format") == AOTI:
        # Its kernels are in the library the loader opened: the first call is not the slow
        # one (LeNet's step: three warm-up calls took 24-26 ms, a step's time each), and
        # each warm-up call runs its kernels beside the program's (tiering/worker.py).
        run.warm_calls = 1
    return checked(run, meta, fallback)


def run_scripted(scripted, meta: dict, fallback: Callable | None = None) -> Callable:
    """A flattened scripted graph as the captured graph's compiled form (``fallback``: see
    ``load_inductor_artifact``)."""
    return checked(_run_scripted(scripted, meta["converted"], meta["devices"],
                                 meta.get("number_outputs", [])), meta, fallback)


def load_cached(backend: str, key: str, fallback: Callable | None = None) -> tuple[Callable, dict] | None:
    """``backend``'s compiled flattened graph an earlier run saved under ``key`` (a TorchScript
    module or an Inductor artefact), callable as ``run_scripted`` / ``load_inductor_artifact``
    make it (``fallback``: see there), and its metadata; None where none is saved or it
    cannot be loaded (logged by the cache, and left for the next save to replace)."""
    if backend == "torchscript":
        loaded = compile_cache.load_script(key, quiet=False)
        return None if loaded is None else (run_scripted(*loaded, fallback), loaded[1])
    entry = compile_cache.artifact(key)
    if entry is None:
        return None
    try:
        return load_inductor_artifact(*entry, fallback), entry[1]
    except Exception as e:
        compile_cache.ignore(entry[0], e)
        return None


def has_cached(backend: str, key: str) -> bool:
    """A compiled form of ``backend`` is saved under ``key`` (not loaded: ``load_cached``)."""
    if backend == "torchscript":
        return compile_cache.has_script(key)
    return compile_cache.artifact(key) is not None


def torchscript_without_autograd(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """``flatten`` (fake tensors: static shapes) compiled by TorchScript, or loaded from the
    compile cache where an earlier run saved it. It runs in grad mode, as it was traced (some
    kernels, e.g. oneDNN's LSTM, keep what the flattened backward reads only in grad mode),
    on detached inputs, so autograd records nothing."""
    key = compile_cache.entry_key(gm, example_inputs, "torchscript", "flattened")
    quiet = not compiling_in_background()
    loaded = compile_cache.load_script(key, quiet)
    if loaded is not None:
        scripted, meta = loaded
        return compile_cache.mark_cached(run_scripted(scripted, meta, gm.forward))
    scripted, meta = scripted_flattened(gm, example_inputs)
    compile_cache.save_script(key, scripted, meta, quiet)
    return run_scripted(scripted, meta, gm.forward)


def with_number_inputs(gm: torch.fx.GraphModule, example_inputs: list,
                       compile_fn: Callable[[torch.fx.GraphModule, list], Callable]) -> Callable:
    """A graph with Python-number inputs whose results need autograd (a ``forward(x, scale)``
    optimized alone: not flattened) compiled by ``compile_fn`` (through AOT autograd) with
    those numbers as 0-d tensor inputs (``passes.scalar_inputs_as_tensors``): their values are
    inputs, not constants, so one compile serves every value, and each call makes them
    tensors. Its first call checks that the results have capture's dtypes (a number made a
    tensor must not promote one): raising there sends the graph to ``fx``, before anything
    was committed."""
    converted_gm, converted = scalar_inputs_as_tensors(gm)
    devices = [None] * len(converted)
    compiled = compile_fn(converted_gm, _numbers_as_tensors(example_inputs, converted, devices))
    captured = _output_values(gm, "example")
    unchecked = [True]

    def run(*args):
        out = compiled(*_numbers_as_tensors(args, converted, devices))
        if unchecked[0]:
            got = list(out) if isinstance(out, (list, tuple)) else [out]
            _raise_on_changed_dtype(captured, got, "a number input made a tensor changed")
            unchecked[0] = False
        return out

    run.wrapped = compiled  # (explain's sizes line: dynamic_sizes.describe)
    return _tagged(run, compile_cache.from_cache(compiled))


def _numbers_as_tensors(args, converted: list[int], devices: list) -> list:
    """A call's graph inputs with the Python numbers at ``converted`` made 0-d tensors on
    ``devices`` (None: the default device), as a flattened graph takes them."""
    args = list(args)
    for i, device in zip(converted, devices):
        args[i] = as_tensor_input(args[i], device)
    return args


def _run_scripted(scripted, converted: list[int], devices: list[str],
                  numbers: list[int]) -> Callable:
    """The flattened scripted graph called with the captured graph's inputs: Python numbers
    at ``converted`` made 0-d tensors on ``devices``; ``numbers``: see ``captured_outputs``."""
    def run(*args):
        if converted:
            args = _numbers_as_tensors(args, converted, devices)
        with torch.enable_grad():
            return captured_outputs(
                scripted(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args]), numbers)

    return run


def torch_compile_original(obj) -> object | None:
    """The module or function ``torch.compile`` wrapped into ``obj`` (an ``OptimizedModule``
    or the function it returns), or None when ``obj`` is not what ``torch.compile`` returned.
    ``torch._dynamo`` is not imported for this: before it is, nothing made by it exists."""
    import sys
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return None
    if isinstance(obj, eval_frame.OptimizedModule):
        return obj._orig_mod
    return getattr(obj, "_torchdynamo_orig_callable", None)
