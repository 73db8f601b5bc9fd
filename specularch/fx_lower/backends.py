"""The backend registry: plain callables that turn a captured GraphModule into something
to call with the graph's inputs.

A backend is ``compile(gm, example_inputs) -> callable``; ``supports(gm)`` may return a
reason string when it cannot handle a graph (the runtime then falls back to ``fx``).
Register more with ``register_backend``. ``fx`` takes every graph; the compiling backends
(``torchscript``, ``inductor``, ``cudagraphs``) say in ``supports`` which graphs they refuse.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from . import _torch_fx_sources as fx_sources
from .passes import number_outputs
from .randomness import generator_states, restore_generators


@dataclass(frozen=True)
class Backend:
    name: str
    compile: Callable[[torch.fx.GraphModule, list], Callable]
    help: str
    supports: Callable[[torch.fx.GraphModule], str | None] = lambda gm: None


BACKENDS: dict[str, Backend] = {}
# One compile at a time in the process: AOT autograd and Inductor keep state of their own
# (functorch's interpreter levels, config patches) that two compiles on two threads, one of
# them the background tier compiler, would interleave ("Expected current_level > 0").
COMPILE_LOCK = threading.RLock()


class UnknownBackendError(ValueError):
    """``optimize(fn, backend="nope")`` or ``SPECULARCH_BACKEND=nope``: no such backend.

    The message lists the registered backends; pick one of them.
    """


def register_backend(name: str, compile_fn: Callable, *, help: str,
                     supports: Callable | None = None, replace: bool = False) -> Backend:
    if name in BACKENDS and not replace:
        raise ValueError(f"backend {name!r} is already registered (pass replace=True to override)")
    backend = Backend(name, _drawing_nothing(compile_fn), help, supports or (lambda gm: None))
    BACKENDS[name] = backend
    return backend


def _drawing_nothing(compile_fn: Callable) -> Callable:
    """``compile_fn`` with the random-number state put back afterwards: a compiler that runs
    the graph while compiling (warm-up runs, autotuning, ``ts_compile`` on real inputs) would
    otherwise advance the generators, and the call would then draw other numbers than eager."""
    @functools.wraps(compile_fn)
    def compile(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        states = generator_states()
        since = fx_sources.mark()
        try:
            with COMPILE_LOCK:
                return compile_fn(gm, example_inputs)
        finally:
            fx_sources.release_with(gm, since)  # torch.fx's copies of the compiled code's text
            restore_generators(states)
    return compile


def compile_in_background(backend: Backend, gm: torch.fx.GraphModule, example_inputs: list,
                          later: Callable | None = None) -> Callable:
    """``backend.compile`` for a thread other than the user's (``tiering/worker.py``): without
    ``_drawing_nothing``'s save and restore of the global random-number state, which would put
    back, in the middle of the user's program, a state from before draws it made meanwhile.
    So a graph that draws random numbers comes here only in a form whose compile never runs
    it (flattened, traced with fake tensors: ``tiering/policy.py``); other compilers may
    run their graph while compiling, which draws nothing only when the graph draws nothing.
    ``later(job)``: runs a compile job on the background thread afterwards (a rolled loop's
    body meeting other sizes, ``rolled/compiled.py``)."""
    from ._torch_background import background_tracing
    since = fx_sources.mark()
    try:
        with COMPILE_LOCK, background_tracing(later):
            return backend.compile.__wrapped__(gm, example_inputs)
    finally:
        fx_sources.release_with(gm, since)


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}") from None


def list_backends() -> dict[str, str]:
    return {name: b.help for name, b in sorted(BACKENDS.items())}


def _fx(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    # The GraphModule's generated Python, called without nn.Module.__call__'s overhead;
    # in-place updates of fresh copies (parameters, optimizer state) folded into their
    # out-of-place ops first (``passes.fold_clones``: the same bits, one pass fewer), then
    # the same op over many tensors (an optimizer update) batched into one
    # ``torch._foreach_*`` call (``foreach.batch_foreach``: the same per-tensor kernels).
    from ._torch_fx_names import bind_renamed_targets
    # Both passes run on one copy of the graph, whose code is generated once.
    from .foreach import BATCH_FOREACH
    from .passes import FOLD_CLONES, rewritten_copy
    return bind_renamed_targets(rewritten_copy(gm, FOLD_CLONES, BATCH_FOREACH)).forward


def flattened(gm: torch.fx.GraphModule) -> bool:
    """Graphs compiled as one ATen graph without autograd (``_torch_compilers.flatten``):
    whole training steps (an in-graph ``autograd.grad``), and graphs with Python-number inputs
    or dynamic sizes whose results need no autograd. (Others go through AOT autograd, dynamic
    sizes and number inputs included: ``_torch_compilers.with_number_inputs``.)"""
    return _has_autograd(gm) or bool(
        (gm.meta.get("scalar_inputs") or gm.meta.get("dynamic_dims"))
        and not gm.meta.get("outputs_require_grad"))


def autograd_forward(gm: torch.fx.GraphModule) -> bool:
    """A forward graph whose results need autograd, the backward left to the program (not
    ``flattened``): compiled through AOT autograd or split (``split.py``)."""
    return bool(gm.meta.get("outputs_require_grad")) and not flattened(gm)


# Python-number graph inputs may flow only into arithmetic: a torch function that branched
# on one while being flattened would leave a specialisation we do not guard.
_SCALAR_SAFE_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "addcdiv_",
                        "addcmul_", "lerp_", "pow"}


def _scalars_only_in_arithmetic(gm: torch.fx.GraphModule) -> bool:
    return not specialised_numbers(gm)


def specialised_numbers(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of the Python-number graph inputs that reach more than arithmetic: a
    compiling backend compiles the graph per value of them (``specialise.py``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if isinstance(n.meta.get("example"), (int, float))
            and not _only_in_arithmetic(n)]


def _only_in_arithmetic(placeholder: torch.fx.Node) -> bool:
    pending, seen = [placeholder], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op == "call_function" and getattr(user.target, "__module__", "") in ("_operator", "operator"):
                if not isinstance(user.meta.get("example"), torch.Tensor):
                    pending.append(user)  # still a Python number: follow it
            elif not (user.op == "call_method" and user.target in _SCALAR_SAFE_METHODS
                      or user.op == "output"):  # returned: a 0-d tensor, ``number_outputs``
                return False
    return True


def _has_autograd(gm: torch.fx.GraphModule) -> bool:
    return any(n.target is torch.autograd.grad for n in gm.graph.nodes)


def gradient_hooks(gm: torch.fx.GraphModule) -> str | None:
    """A graph with an in-graph backward whose differentiated inputs (parameters) have
    gradient hooks: a flattened backward computes the gradients as plain ops and would skip
    the hooks (wrong gradients). Capture refuses such steps already; this is the backends'
    own check, in case a hook reaches a graph anyway."""
    if not _has_autograd(gm):
        return None
    for node in gm.graph.nodes:
        t = node.meta.get("example") if node.op == "placeholder" else None
        if isinstance(t, torch.Tensor) and (t._backward_hooks or
                                            getattr(t, "_post_accumulate_grad_hooks", None)):
            return (f"graph input {node.name} has gradient hooks (register_hook / "
                    f"register_post_accumulate_grad_hook), which a flattened backward would skip")
    return None


_OPAQUE = "a graph input is neither a tensor nor a number (e.g. a torch.Generator)"


def flattening_reason(gm: torch.fx.GraphModule, compiler: str, *,
                      specialises: bool = False) -> str | None:
    """Why ``gm`` cannot be compiled as one static-shape ATen graph by ``compiler`` (or be
    compiled at all, for what every compiling backend refuses); None when it can.
    ``specialises``: the backend compiles per value of Python numbers that reach a torch
    function (``specialise.py``)."""
    if gm.meta.get("opaque_inputs"):
        return _OPAQUE
    if gm.meta.get("rolled_loops"):
        return f"it runs a rolled loop ({compiler} would unroll it at one trip count)"
    # Dynamic sizes are compiled for every size (``dynamic_sizes.py``) when they are sizes of
    # graph inputs; a size that only an intermediate value has is not.
    if gm.meta.get("dynamic_dims") and not gm.meta.get("dynamic_inputs"):
        return f"it has dynamic sizes that are not sizes of its inputs ({compiler} would specialise on them)"
    if gm.meta.get("sizes_below_two"):
        return ("it serves dynamic sizes below 2 only (a batch or length of 1; another graph "
                "serves the others), where a compile for every size, traced at 2 or more, never runs")
    if any(n.op == "call_method" and n.target == "item" for n in gm.graph.nodes):
        return "it reads `.item()` values inside the graph (numbers passed to torch ops)"
    # An in-graph assumption is a tensor output the entry function checks after the graph
    # ran (a speculated branch); compiled or not, the graph computes the same values, and
    # when the check fails they are dropped and the original runs.
    if gm.meta.get("non_tensor_outputs"):
        # A flattened graph returns them as 0-d tensors (``passes.number_outputs_as_tensors``).
        if number_outputs(gm) is None:
            return "it returns a value that is neither a tensor nor a Python number"
        why = None if flattened(gm) else _not_split(gm)
        if why:
            return ("it returns Python numbers computed inside the graph and results that need "
                    f"autograd, and its forward and backward cannot be compiled apart ({why})")
    if gm.meta.get("scalar_inputs") and not specialises and not _scalars_only_in_arithmetic(gm):
        return "a Python-number graph input reaches a torch function (it could be specialised)"
    if flattened(gm) and gm.meta.get("outputs_require_grad"):
        spent = spent_outputs(gm)
        if isinstance(spent, str):
            return ("it is compiled without autograd (it runs a backward inside) but returns "
                    f"or stores tensors that need autograd ({spent})")
    return gradient_hooks(gm)


def _not_split(gm: torch.fx.GraphModule) -> str | None:
    """Why ``split.py`` does not take ``gm`` (whose number outputs it returns as numbers);
    None where it does. (AOT autograd's own form returns tensors and sizes only.) Dynamic sizes are
    not a reason here: tiering compiles such a graph for the sizes of most calls, where the
    split takes it (``tiering/hot_sizes.py``); where it cannot, the compile fails and says
    why, and ``fx`` runs the graph."""
    from .split import refusal
    return refusal(gm, fixed_sizes=True)


def spent_outputs(gm: torch.fx.GraphModule) -> list | str:
    """The outputs of a flattened graph that need eager's used-up history (``spent.py``), or
    why one needs a history that can still run. Only a graph with an in-graph backward can
    have used one up."""
    if "spent_outputs" not in gm.meta:
        from . import spent
        if not _has_autograd(gm) or "value_outputs" not in gm.meta:
            found = "nothing in the graph ran their backward"
        else:
            found = spent.plan(gm, gm.meta["value_outputs"])
        gm.meta["spent_outputs"] = found
    return gm.meta["spent_outputs"]


def _with_spent_history(gm: torch.fx.GraphModule, compiled: Callable) -> Callable:
    from .spent import attach
    return attach(spent_outputs(gm), compiled) if gm.meta.get("outputs_require_grad") else compiled


def _rolled_bodies(gm: torch.fx.GraphModule, example_inputs: list, backend: str) -> Callable:
    """A graph with rolled loops: the graph runs as ``fx``, each loop body compiled by
    ``backend`` (``rolled/compiled.py``)."""
    from .rolled.compiled import compile_bodies, with_own_loops
    gm = with_own_loops(gm)
    compile_bodies(gm, backend)
    return _fx(gm, example_inputs)


def _torchscript_supports(gm: torch.fx.GraphModule) -> str | None:
    return None if gm.meta.get("rolled_loops") else flattening_reason(gm, "TorchScript", specialises=True)


def _per_value(gm: torch.fx.GraphModule, example_inputs: list, backend: str) -> Callable | None:
    """``gm`` compiled by ``backend`` once per value of the numbers that reach a torch
    function (``specialise.py``), or None when it has none. Compiled at first for the example
    values; later for new values in the call that brings them, unless this compile runs in
    the background (the tier compiler: no call may wait), where they run the ``fx`` code."""
    from ._torch_background import compiling_in_background
    from .specialise import PerValue
    positions = specialised_numbers(gm) if gm.meta.get("scalar_inputs") else []
    if not positions:
        return None
    lazily = not compiling_in_background()
    compile_one = get_backend(backend).compile if lazily else BACKENDS[backend].compile.__wrapped__
    per_value = PerValue(gm, positions, compile_one, _fx(gm, example_inputs), lazily=lazily)
    per_value.add(example_inputs)
    return per_value


def _compiled_by(name: str, gm, example_inputs, without_autograd: Callable, with_autograd: Callable):
    """What a compiling backend makes of ``gm``: rolled loops' bodies compiled, or one compile
    per value of the numbers that reach torch functions, or the graph flattened to ATen
    without autograd (whole steps, dynamic graphs), or a forward graph's forward and backward
    each flattened and glued (``split.py``), else compiled through AOT autograd."""
    if gm.meta.get("rolled_loops"):
        return _rolled_bodies(gm, example_inputs, name)
    per_value = _per_value(gm, example_inputs, name)
    if per_value is not None:
        return per_value
    if flattened(gm):
        return _with_spent_history(gm, without_autograd(gm, example_inputs))
    from .split import compile_here  # forward and backward compiled as flattened graphs, glued
    glued, why = compile_here(name, gm, example_inputs, without_autograd)
    if glued is not None:
        return glued
    if gm.meta.get("scalar_inputs"):  # (whose results need autograd)
        from ._torch_compilers import with_number_inputs
        compiled = with_number_inputs(gm, example_inputs, with_autograd)
    else:
        compiled = with_autograd(gm, example_inputs)
    if why is None:
        return compiled
    from .compile_cache import with_attributes  # (explain() shows a compiled graph's note)
    return with_attributes(compiled, note=f"AOT autograd's form, not split: {why}")


def _torchscript(gm, example_inputs):
    from ._torch_compilers import aot_torchscript, torchscript_without_autograd
    return _compiled_by("torchscript", gm, example_inputs, torchscript_without_autograd, aot_torchscript)


def _inductor_supports(gm: torch.fx.GraphModule) -> str | None:
    return None if gm.meta.get("rolled_loops") else flattening_reason(gm, "Inductor", specialises=True)


def _inductor(gm, example_inputs):
    from ._torch_compilers import inductor, inductor_without_autograd
    return _compiled_by("inductor", gm, example_inputs, inductor_without_autograd, inductor)


def _cudagraphs(gm, example_inputs):
    from .cudagraphs import compile_cudagraph
    return compile_cudagraph(gm, example_inputs)


def _cudagraphs_supported(gm):
    from .cudagraphs import supports
    return supports(gm)


register_backend("fx", _fx, help="Run the FX graph's generated Python code (no compilation).")
register_backend("auto", _fx,
                 help="Tiered (the default): each graph runs at once with 'fx'; a graph that keeps "
                      "being hit is compiled in the background by the compiling backends that "
                      "take it, each timed on live calls and kept only if faster "
                      "(docs/tiering.md). Equal to eager within float rounding.")
register_backend("torchscript", _torchscript, supports=_torchscript_supports,
                 help="TorchScript: forward graphs through AOT autograd (functorch), forward and "
                      "backward each scripted; whole training steps flattened to one ATen graph "
                      "and scripted (frozen). Dynamic sizes compiled once for every size.")
register_backend("inductor", _inductor, supports=_inductor_supports,
                 help="Inductor (torch._inductor.compile_fx): fused C++/Triton kernels; slow to compile. "
                      "Whole training steps and dynamic graphs are flattened to ATen first.")
register_backend("cudagraphs", _cudagraphs, supports=_cudagraphs_supported,
                 help="CUDA graph capture and replay (static input/output buffers) of static-shape "
                      "graphs that need no autograd: inference and whole training steps (CUDA only).")
