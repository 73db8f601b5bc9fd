"""Training inside a captured graph: ``loss.backward()``, ``.grad``, ``.item()`` for logging.

``loss.backward()`` becomes one ``torch.autograd.grad`` node over the graph inputs that
require grad (parameters and leaf arguments); each gradient is accumulated into ``.grad``
through the shadow heap exactly as eager accumulates it (a new tensor when ``.grad`` was
None, an in-place add otherwise), so nothing changes before the call has succeeded.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ...guards import NoTensorHooksGuard
from ...guards.sources import AttrSource
from ...records import Unsupported
from .._torch_dispatch import storage_key, write_key
from ..values import ConstV, TensorV, Value
from ..values.scalar import ScalarV
from ..models import provides
from ..values import ListV
from ..speculation.view_writes import refuse_stale_read


def item(tracer, t: TensorV) -> Value:
    if t.example.numel() != 1:
        raise Unsupported("exception_handling", "item() of a tensor with more than one element")
    refuse_stale_read(tracer, t, "item()")
    return ScalarV(t.node, t.example.item(), read_after=tracer.graph._root.prev)


def item_snapshot(node: torch.fx.Node, read_after: torch.fx.Node) -> torch.fx.Node:
    """The graph output a ``t.item()`` is read from after the run. ``t`` itself only while
    nothing can change it before that read: a tensor from outside the call (or a view of one)
    may be written by the commit, and an in-place op after the ``.item()`` call (after the
    graph node ``read_after``) may write ``t``'s storage; then the value is copied there, where
    ``.item()`` was called (in-place ops between making ``t`` and ``.item()`` count)."""
    snapshots = node.meta.setdefault("item_snapshots", {})
    if read_after in snapshots:
        return snapshots[read_after]
    example = node.meta["example"]
    key = storage_key(example)
    graph = node.graph
    inputs = {storage_key(n.meta["example"]) for n in graph.nodes if n.op == "placeholder"
              and isinstance(n.meta.get("example"), torch.Tensor)}
    later, written = read_after.next, key in inputs
    while not written and later.op != "output" and later is not graph._root:
        # a node with no tensor inputs (a grad-mode switch) cannot write ``t``'s storage
        written = (bool(later.meta.get("mutates")) and bool(later.all_input_nodes)
                   and (key in later.meta.get("writes", ()) or not later.meta.get("writes")))
        later = later.next
    snapshot = node
    if written:
        at = read_after
        while at.next.op == "placeholder":
            at = at.next
        with graph.inserting_after(at):
            snapshot = graph.call_method("clone", (node,))
        snapshot.meta.update(example=example.clone(), where=node.meta.get("where"),
                             mutates=False, writes=frozenset())
    snapshots[read_after] = snapshot
    return snapshot


@provides("read_grad")
def read_grad(tracer, t: TensorV) -> Value:
    if t.real is None or t.source is None:
        raise Unsupported("unsupported_call", "reading .grad of a tensor computed in the function")
    written = tracer.heap.read_attr(t.real, "grad")
    if written is not None:
        return written
    return tracer.wrap(t.real.grad, AttrSource(t.source, "grad"))


@provides("write_grad")
def write_grad(tracer, t: TensorV, value: Value | None) -> None:
    if t.real is None or t.source is None:
        raise Unsupported("side_effect", "assigning .grad of a tensor computed in the function")
    if value is None:
        raise Unsupported("side_effect", "`del tensor.grad` is not captured")
    g = getattr(value, "example", None)
    if isinstance(g, torch.Tensor) and (g.shape, g.dtype, g.device, g.layout) != (
            t.real.shape, t.real.dtype, t.real.device, t.real.layout):
        # eager raises here (the commit would refuse it too: shadow_heap/checks.py)
        raise Unsupported("exception_handling", f"RuntimeError: assigning a gradient of shape "
                          f"{tuple(g.shape)} ({g.dtype}) to {t.source} of shape "
                          f"{tuple(t.real.shape)} ({t.real.dtype})")
    tracer.heap.write_grad(t, t.real, value, tracer.where())


def backward(tracer, loss: TensorV, args: list, kwargs: dict) -> Value:
    if args or any(not (isinstance(v, ConstV) and v.value in (None, False)) for v in kwargs.values()):
        raise Unsupported("unsupported_call", "backward() with arguments (gradient, retain_graph, "
                          "inputs, ...) is not captured; call it as loss.backward()")
    if loss.example.numel() != 1:
        raise Unsupported("exception_handling", "grad can be implicitly created only for scalar outputs")
    if not loss.example.requires_grad:
        raise Unsupported("exception_handling", "element 0 of tensors does not require grad")
    # a leaf written in place earlier in the call (under no_grad, through .data) is still the
    # leaf: its gradient is the original tensor's (reads after the write route to it too)
    leaves = [v for v in tracer.graph_inputs() if v.real is not None and v.real.requires_grad
              and v.real.is_leaf and (v.example is v.real or v.stale_leaf is not None)]
    if not leaves:
        raise Unsupported("exception_handling", "backward(): no leaf tensor requires grad")
    _refuse_outside_history(tracer, loss)
    for leaf in leaves:  # checked before capture runs backward (hooks must not run here)
        if leaf.real._backward_hooks or leaf.real._post_accumulate_grad_hooks:
            raise Unsupported("module_hooks", f"{leaf.source} has gradient hooks (register_hook "
                              "/ register_post_accumulate_grad_hook); a captured backward "
                              "would not run them as eager does")
        tracer.add_guard(NoTensorHooksGuard, leaf.source)
    from ... import distributed
    if distributed.active():
        # In the graph: once the ranks agreed to run this step, gradients averaged across
        # ranks, all-reduce overlapped with backward. While capturing: plain local gradients
        # (no collectives during capture). The leaves' sources identify the buckets.
        from ...distributed import agreement, eager
        tracer.distributed_leaves = [leaf.real for leaf in leaves]
        eager.note_backward_captured()
        ids = {"step": ConstV(tracer.code.co_qualname),
               "layout": ConstV(agreement.layout_hash([str(leaf.source) for leaf in leaves]))}
        grads = tracer.call_op("call_function", distributed.grad_and_allreduce,
                               [loss, _list(map(_leaf_tensor, leaves))], ids, name="autograd.grad",
                               fn=lambda l, p, **_: torch.autograd.grad(l, p, allow_unused=True))
    else:
        grads = tracer.call_op("call_function", torch.autograd.grad,
                               [loss, _list(map(_leaf_tensor, leaves))], {"allow_unused": ConstV(True)},
                               name="autograd.grad")
    if tracer.template_calls and not distributed.active():  # (see there; a distributed step
        _assume_which_get_gradients(tracer, grads)            # takes no in-graph assumption yet)
    shared = _shared_positions(tracer, grads.items)
    for k, (leaf, grad) in enumerate(zip(leaves, grads.items)):
        if isinstance(grad, ConstV):  # unused leaf: eager leaves its .grad alone
            continue
        # Autograd gives a gradient its input's shape (it checks), so a gradient of a leaf
        # with static sizes has them too, in a graph with dynamic sizes as well: nothing to
        # check of its sizes (a clipped step's norms read them).
        grad.dynamic = grad.dynamic and leaf.dynamic
        if grad.example.layout is not torch.strided:
            raise Unsupported("unsupported_call", f"the gradient of {leaf.source} is sparse "
                              "(e.g. nn.Embedding(sparse=True)); sparse gradients are not captured")
        current = read_grad(tracer, leaf)
        if isinstance(current, ConstV) and current.value is None:
            write_grad(tracer, leaf, _as_accumulated(tracer, leaf, grad, k in shared))
        else:  # in-place accumulation into the existing .grad (committed by the heap)
            tracer.call_op("call_method", "add_", [current, grad], {}, name="add_")
    return ConstV(None)


def _shared_positions(tracer, grads: list) -> set:
    """The gradients (their positions) whose tensor another leaf after them also gets
    (``autograd.grad`` hands one tensor to both sides of ``a + b``: eager's accumulation
    copies it for the first, the last keeps it), or that the graph reads as an input."""
    inputs = {write_key(v.example) for v in tracer.graph_inputs()
              if isinstance(getattr(v, "example", None), torch.Tensor)}
    keys = [write_key(g.example) if isinstance(g, TensorV) else None for g in grads]
    return {k for k, key in enumerate(keys) if key is not None and (key in inputs
                                                                    or key in keys[k + 1:])}


def _as_accumulated(tracer, leaf: TensorV, grad: TensorV, shared: bool) -> Value:
    """The tensor eager's gradient accumulation stores as ``leaf.grad`` when it was None:
    autograd's gradient itself where it keeps the leaf's layout and nothing else holds it,
    else a copy in the leaf's layout (torch's layout contract: ``obeys_layout_contract``,
    ``clone_obey_contract``): an expanded ``ones`` of ``(w + x).sum()`` has stride 0, the
    two sides of ``a + b`` get one tensor. Decided at capture for a leaf of static sizes,
    when the graph runs for one whose sizes vary."""
    if not shared and not leaf.dynamic and obeys_layout_contract(grad.example, leaf.real):
        return grad
    return tracer.call_op("call_function", grad_in_layout, [grad, _leaf_tensor(leaf), ConstV(shared)],
                          {})


def obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    """Whether autograd would store ``grad`` as ``variable.grad`` as it is: dense and with
    ``variable``'s strides where ``variable`` is dense (sizes of 1 excepted), else contiguous."""
    if not _dense(variable):
        return grad.is_contiguous()
    if not _dense(grad):
        return False
    return all(size == 1 or a == b for size, a, b in zip(grad.shape, grad.stride(), variable.stride()))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlaps in some order of its
    dimensions (torch's ``is_non_overlapping_and_dense``, which Python does not reach)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def grad_in_layout(grad: torch.Tensor, variable: torch.Tensor, shared: bool) -> torch.Tensor:
    """``grad`` as ``variable.grad``: itself where it obeys the layout contract and is not
    ``shared``, else a copy in ``variable``'s layout."""
    if not shared and obeys_layout_contract(grad, variable):
        return grad
    if _dense(variable):
        return grad.new_empty_strided(variable.shape, variable.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def gradients_present(grads: tuple) -> tuple:
    """Which of ``torch.autograd.grad``'s results are tensors (the others: None, unused)."""
    return tuple(g is not None for g in grads)


def _assume_which_get_gradients(tracer, grads) -> None:
    """The graph checks that the leaves that got a gradient at capture get one when it runs,
    and only those: the rest of the step (``.grad`` writes, the optimizer's updates the commit
    replays) was captured for that set. Where a recursion template runs other paths (the only
    part of a graph that chooses at run time what it reads: so only graphs with one check),
    another set would leave some parameter without its update, or make a replayed update
    raise half-way through the commit; the call runs eagerly instead (nothing written)."""
    tensors = [g for g in grads.items if isinstance(g, TensorV)]
    if not tensors:
        return
    node = tensors[0].node.args[0]  # (each gradient is ``getitem`` of the autograd node)
    expected = tuple(isinstance(g, TensorV) for g in grads.items)
    present = tracer.graph.call_function(gradients_present, (node,))
    present.meta.update(example=expected, where=tracer.where(), mutates=False, writes=frozenset())
    check = tracer.graph.call_function(operator.eq, (present, expected))
    check.meta.update(example=True, where=tracer.where(), mutates=False, writes=frozenset())
    tracer.assertions.append((check, True, tracer.where(), ("gradients", id(check))))


def _refuse_outside_history(tracer, loss: TensorV) -> None:
    """A loss whose autograd history runs into a tensor made before the call (an input that is
    not a leaf: a log-prob saved by an earlier call) is not captured: capture's own backward
    would free that history (the graph's backward would then fail), and eager's backward
    can reach leaves through it that the call never sees."""
    outside = {v.real.grad_fn for v in tracer.graph_inputs()
               if v.real is not None and v.real.grad_fn is not None}
    seen, pending = set(), [loss.example.grad_fn] if outside else []
    while pending:
        fn = pending.pop()
        if fn is None or fn in seen:
            continue
        if fn in outside:
            raise Unsupported("unsupported_call", "backward() through autograd history made "
                              "before the call (a tensor that requires grad computed outside it, "
                              "e.g. saved by an earlier call) is not captured")
        seen.add(fn)
        pending.extend(f for f, _ in fn.next_functions)


def _leaf_tensor(v: TensorV) -> TensorV:
    """The leaf autograd sends ``v``'s gradient to: ``v`` itself, or the tensor a write
    replaced by a copy (``TensorV.stale_leaf``, see leaf_writes.py)."""
    return v if v.stale_leaf is None else TensorV(*v.stale_leaf)


def _list(values):
    return ListV(list(values))
