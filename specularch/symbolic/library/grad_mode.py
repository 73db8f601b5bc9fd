"""Grad mode, inference mode and ``requires_grad_`` inside a capture.

``torch.no_grad()``, ``enable_grad()``, ``set_grad_enabled(b)`` and ``inference_mode(b)``, as
``with`` blocks and as decorators of inlined functions, switch the grad mode during capture as
eager does and record ``torch.set_grad_enabled`` nodes, so the graph switches it at the same
points. Their flags are Python bools read (and guarded) at capture.

* ``set_grad_enabled(b)`` switches the mode when it is *constructed*, like torch's. Used
  without ``with``, it leaves the mode changed after the call returns: a graph does not
  carry that out of the call, so such a call runs eagerly (``unsupported_call``).
* ``inference_mode()``: the block runs in real inference mode during capture, so every
  tensor it creates is an inference tensor and any error eager would raise with them (in
  place outside the block, saved for backward) is raised during capture, which falls back.
  The graph computes the block under ``no_grad`` (the same values; the graph stays
  compilable); tensors the block created, and views of them taken after it, that the call
  returns or stores are turned into inference tensors over the same storage after the graph
  ran (``shadow_heap.render.as_inference``), so the caller gets what eager gives; arguments that are
  inference tensors are guarded to stay so. Refused: views of tensors from outside the
  block used after it (eager gives them inference-mode view metadata the graph cannot),
  tensors made in the block that require grad, enabling grad inside the block, and
  ``inference_mode(False)`` while inference mode is on.
* ``t.requires_grad_(b)`` on a tensor created in the call is a graph node; on a tensor from
  outside the call it is captured only when it changes nothing (the flag is guarded).
"""
from __future__ import annotations

import torch

from ...guards import GlobalStateGuard
from ...records import Unsupported
from ...shadow_heap.rebuild import AsInference, GraphOutput, Rebuild
from ._torch_grad_mode import inference_mode_guard, tracing_mode_active
from ..values import ConstV, GradModeV, TensorV, Value
from ..models import provides
from ..values.symint import SymV

_REGION = "inference_region"  # node meta: created inside a `with torch.inference_mode():`


def _refuse(why: str):
    raise Unsupported("unsupported_call", why)


def _bool_arg(what: str, args: list, kwargs: dict, name: str, default: bool | None) -> bool:
    """The one bool argument of ``what`` (positional or ``name=``), guarded where it came
    from; refused when it is anything but a Python bool (eager may raise or decorate)."""
    if len(args) + len(kwargs) > 1 or set(kwargs) - {name}:
        _refuse(f"{what}() with unexpected arguments")
    v = args[0] if args else kwargs.get(name)
    if v is None:
        if default is None:
            _refuse(f"{what}() without its flag")
        return default
    value = v.concrete() if isinstance(v, (ConstV, SymV)) else None
    if type(value) is not bool:
        _refuse(f"{what}({v!r}): only a Python bool flag is captured")
    return value


def construct(tracer, cls: type, args: list, kwargs: dict) -> GradModeV | None:
    """The value of ``cls(*args)`` for torch's grad-mode classes (None for other classes)."""
    if cls is torch.no_grad and not args and not kwargs:
        return GradModeV(False)
    if cls is torch.enable_grad and not args and not kwargs:
        return GradModeV(True)
    if cls is torch.set_grad_enabled:
        mode = _bool_arg("torch.set_grad_enabled", args, kwargs, "mode", None)
        prior = torch.is_grad_enabled()
        set_grad(tracer, mode)  # the constructor switches the mode at once
        return GradModeV(mode, prior=prior, switched=True)
    if cls is torch.inference_mode:
        mode = _bool_arg("torch.inference_mode", args, kwargs, "mode", True)
        return GradModeV(not mode, inference=mode)
    return None


@provides("grad_decorator_context")
def decorator_context(owner) -> GradModeV | None:
    """The context a ``@torch.no_grad()``-style decorator enters around its function, from
    the context-manager object it was made from (None when it is not a grad-mode one)."""
    kind = type(owner)
    if kind is torch.no_grad:
        return GradModeV(False)
    if kind is torch.enable_grad:
        return GradModeV(True)
    mode = getattr(owner, "mode", None)
    if type(mode) is not bool:
        return None
    if kind is torch.set_grad_enabled:  # the clone sets the mode and restores it at exit
        return GradModeV(mode)
    if kind is torch.inference_mode:
        return GradModeV(not mode, inference=mode)
    return None


@provides("grad_mode_enter")
def enter(tracer, ctx: GradModeV) -> None:
    if ctx.inference:
        ctx.prior = torch.is_grad_enabled()
        ctx.nodes_before = set(tracer.graph.nodes)
        ctx.context = inference_mode_guard()
        ctx.context.__enter__()
        tracer.inference_regions.append(ctx)
        set_grad(tracer, False)
        return
    if ctx.inference is False and torch.is_inference_mode_enabled():
        _refuse("torch.inference_mode(False) while inference mode is on: the graph cannot "
                "leave inference mode")
    if not ctx.switched:  # set_grad_enabled's prior is the mode at its construction
        ctx.prior = torch.is_grad_enabled()
    set_grad(tracer, ctx.enabled)


@provides("grad_mode_exit")
def exit(tracer, ctx: GradModeV) -> None:
    if ctx.inference:
        regions = tracer.inference_regions
        if not regions or regions[-1] is not ctx:
            _refuse("torch.inference_mode() blocks left out of order")
        regions.pop()
        ctx.context.__exit__(None, None, None)
        ctx.context = None
        for node in tracer.graph.nodes:
            if node.op in ("call_function", "call_method") and node not in ctx.nodes_before:
                node.meta[_REGION] = True
        ctx.nodes_before = None
    set_grad(tracer, ctx.prior)


def set_grad(tracer, enabled: bool) -> None:
    """Switch the grad mode now (capture) and at this point of the graph."""
    if enabled and torch.is_inference_mode_enabled():
        _refuse("enabling grad inside torch.inference_mode(): the graph computes the block "
                "under no_grad, where that would record autograd eager does not")
    torch.set_grad_enabled(enabled)
    node = tracer.graph.call_function(torch.set_grad_enabled, (enabled,))
    node.meta["mutates"] = True


def unwind(tracer) -> None:
    """Leave the inference-mode blocks a failed capture is still inside (innermost first)."""
    regions = tracer.inference_regions
    while regions:
        ctx = regions.pop()
        ctx.context.__exit__(None, None, None)
        ctx.context = None


def check_at_return(tracer) -> None:
    """After the optimized function returned during capture: refuse what a graph cannot
    reproduce of the grad-mode state it leaves behind."""
    entry = next(g for g in tracer.guards if isinstance(g, GlobalStateGuard))
    if torch.is_grad_enabled() is not entry.grad_enabled:
        _refuse(f"the call leaves grad mode {'on' if torch.is_grad_enabled() else 'off'} "
                "(torch.set_grad_enabled(...) without `with`): that setting outlives the call, "
                "and a graph does not carry it out")
    for node in tracer.graph.nodes:
        example = node.meta.get("example")
        if not node.meta.get(_REGION) or not isinstance(example, torch.Tensor):
            continue
        if not example.is_inference() and any(not user.meta.get(_REGION) for user in node.users):
            _refuse("a view of a tensor from outside a torch.inference_mode() block, taken in "
                    "the block, is used after it (eager marks it as an inference-mode view)")
        if example.is_inference() and example.requires_grad and not torch.is_inference_mode_enabled():
            # the graph makes it a leaf under no_grad: handed out as an inference tensor it
            # would lose the flag, and autograd after the block would reach the graph's leaf
            _refuse("a tensor made inside a torch.inference_mode() block requires grad "
                    "(requires_grad=True or requires_grad_() in the block)")


def output_spec(v: TensorV, spec: GraphOutput) -> Rebuild:
    """How the commit/return rebuilds graph output ``spec`` for tensor ``v``: made an
    inference tensor again when eager's is one, i.e. when the capture's is: a tensor the
    block created, or a view of one taken after the block (``y[0]``, ``y.detach()``).
    Inputs that were inference tensors are guarded to stay so (their views are too)."""
    t = v.example
    if torch.is_inference_mode_enabled():  # the caller's: the graph makes inference tensors
        return spec
    if v.node.meta.get(_REGION) and not t.is_inference():
        _refuse("a view of a tensor from outside a torch.inference_mode() block, taken in "
                "the block, is returned or stored (eager marks it as an inference-mode view)")
    if not t.is_inference() or v.node.op == "placeholder":
        return spec
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_conj() or t.is_neg():
        _refuse("an inference tensor that is not a plain strided tensor is returned or stored")
    # keyed by the tensor: `y.contiguous()` is `y` in eager, and must stay one object
    return AsInference(spec, id(t))


def requires_grad_(tracer, t: TensorV, args: list, kwargs: dict) -> Value:
    flag = _bool_arg("Tensor.requires_grad_", args, kwargs, "requires_grad", True)
    if t.source is not None or t.node.op == "placeholder" or t.updated:
        real = t.real if t.real is not None else t.example
        if t.node.op == "placeholder" and real.requires_grad is flag:
            return t  # changes nothing: the flag is guarded with the input
        _refuse("requires_grad_() on a tensor from outside the call changes a flag the caller "
                "sees")
    out = tracer.call_op("call_function", set_requires_grad, [t, ConstV(flag)], {},
                         fn=torch.Tensor.requires_grad_, name="requires_grad_")
    out.node.meta["mutates"] = True  # changes `t` itself: kept in the graph, in order
    return out


def set_requires_grad(t: torch.Tensor, flag: bool) -> torch.Tensor:
    """``t.requires_grad_(flag)`` as a graph node. A tensor made a leaf in the middle of a
    graph cannot be compiled by AOT autograd or flattened (its later gradients would be
    lost); raising while such a backend traces the graph makes the graph run with ``fx``."""
    if type(t) is not torch.Tensor or tracing_mode_active():
        raise NotImplementedError("requires_grad_() on a tensor the graph created runs with "
                                  "the 'fx' backend only")
    return t.requires_grad_(flag)
