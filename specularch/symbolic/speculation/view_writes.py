"""In-place writes into a tensor from outside the call that has views, and writes through
``.data``.

``Tracer._functionalize`` runs a write into a tensor that outlives the call on a fresh copy
of it (the commit copies the copy back). A view of the tensor taken before the write still
views the graph's input, so in the graph it keeps the values from before the write, while in
eager it sees the write. That is harmless while the view is dead after the write, the common
case: GAT's ``self.a[:n]`` read in forward, then ``self.a`` updated by Adam after backward.
``check`` runs when the capture ends and refuses a graph in which such a view is read after
the write (by a later op, returned, stored, printed). Autograd's saved views are covered by
saved_versions.py (a backward after a write raises in eager as in capture, or is refused).

``p.data`` is a tensor sharing ``p``'s memory with no autograd history and a version counter
of its own: manual SGD (``p.data.add_(p.grad, alpha=-lr)``) writes ``p`` without bumping
``p._version``. The write runs on ``copy.data`` (``data_target``), so the copy's counter,
which the commit replays on ``p`` (``entry._tensor_commit``), is not bumped either, and that
``.data`` value is rebound to it (later writes through it update the copy).
"""
from __future__ import annotations

import torch

from ...guards.sources import AttrSource
from ...records import Unsupported
from .._torch_dispatch import storage_key
from .leaf_writes import written_leaf
from ..values import ConstV, TensorV


def data_alias(external: TensorV, args: list, kwargs: dict) -> TensorV | None:
    """The argument of a write into ``external``'s memory that is ``external.data`` taken
    from its current value (a ``.data`` taken before an earlier write is a stale view)."""
    for a in [*args, *kwargs.values()]:
        if isinstance(a, TensorV) and a.node.op == "call_function" and a.node.target is getattr \
                and a.node.args == (external.node, "data"):
            return a
    return None


def data_target(tracer, copy: TensorV) -> TensorV:
    """``copy.data``: the tensor a write through ``.data`` runs on in the graph."""
    return tracer.call_op("call_function", getattr, [copy, ConstV("data")], {}, name="data")


def rebind_data(alias: TensorV, into: TensorV, external: TensorV) -> None:
    """After a write through ``alias`` (``p.data``): in the graph it reads and writes the
    copy's memory from now on; returned or stored, it is ``p.data`` read after the commit
    (the real ``p``'s memory, as eager's)."""
    alias.node, alias.example = into.node, into.example
    alias.source, alias.updated = AttrSource(external.source, "data"), True


def note_write(tracer, key: int, write: torch.fx.Node, external: TensorV, label: str,
               through_data: bool = False) -> None:
    """Remember a functionalized write (``write``: the node copying the tensor) for ``check``
    and ``copies``."""
    tracer.view_writes.append((key, write, external.source, label, tracer.where(), external,
                               through_data))


def copies(tracer) -> dict:
    """The storage of each graph copy of a tensor written in place -> (the tensor's source,
    the copy's example, the real tensor), for ``rebased``: the tensors whose copy has their
    layout (a dense tensor's ``clone``), written other than through ``.data``."""
    found = {}
    for _, write, source, _, _, external, through_data in tracer.view_writes:
        copy, real = write.meta.get("example"), external.real
        if through_data or source is None or not isinstance(copy, torch.Tensor) or real is None \
                or copy.stride() != real.stride() or copy.storage_offset() != 0 \
                or real.is_inference() or copy.is_inference():
            continue
        found.setdefault(storage_key(copy), (source, copy, real))
    return found


def rebased(v: TensorV, written: tuple | None):
    """For a tensor leaving the graph that views the copy of a tensor written in place
    (``x.mul_(2); return x[1:]``): the real tensor's source, to hand out the same view of it
    (the commit fills it with the copy's values), as eager's is; else None."""
    if written is None:
        return None
    source, copy, real = written
    t = v.example
    if t is copy or t.dtype != copy.dtype or t.is_conj() or t.is_neg() \
            or t.requires_grad and not (real.is_leaf and real.requires_grad):
        return None
    if not t._is_view() and (t.shape, t.stride(), t.storage_offset()) != (
            real.shape, real.stride(), 0):
        return None
    return source


def on_written(real: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out``, a view of the graph's copy of ``real`` (same strides, offset 0), as the same
    view of ``real``: taken with ``out``'s autograd (a view of a parameter under grad mode
    differentiates into it); an alias that is not a view (``x.detach()``) is ``real.detach()``."""
    if not out._is_view():
        return real.detach()
    with torch.set_grad_enabled(out.requires_grad):
        return real.as_strided(out.shape, out.stride(), real.storage_offset() + out.storage_offset())


def check(tracer, outputs: list[torch.fx.Node]) -> None:
    """Refuse the capture if a value aliasing a tensor's memory from before a deferred write
    into it is read after the write (the graph would read the old values, eager the new)."""
    if not tracer.view_writes:
        return
    writes = {}
    for record in tracer.view_writes:  # (one per tensor: later writes update the copy)
        writes.setdefault(record[0], record[:5])
    order = {node: i for i, node in enumerate(tracer.graph.nodes)}
    returned = set(outputs)
    for node in tracer.graph.nodes:
        for key in _storages(node.meta.get("example")) & writes.keys():
            _, write, source, label, where = writes[key]
            read = any(order[u] > order[write] and not _reads_no_values(u, node)
                       for u in node.users)
            if read or node in returned:
                raise Unsupported("input_mutation", f"`{label}` writes in place into {source} "
                                  f"(at {where}), and a view of it taken before the write is "
                                  f"{'returned or stored' if node in returned else 'read after it'}"
                                  ": the graph would read the values from before the write")


def refuse_stale_read(tracer, t: TensorV, what: str) -> None:
    """A read recorded at a node's place in the graph rather than where it happens
    (``t.item()`` is snapshotted where ``t`` is made): refuse it now if ``t`` views memory
    a deferred write has already replaced (``check`` cannot see it)."""
    if not t.example.numel():
        return
    for key, _, source, label, where, _, _ in tracer.view_writes:
        if storage_key(t.example) == key:
            raise Unsupported("input_mutation", f"`{label}` writes in place into {source} (at "
                              f"{where}), and {what} then reads a view of it taken before the "
                              "write: the graph would read the values from before the write")


def _reads_no_values(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Uses that do not read the values: a written leaf routes gradients to the old tensor
    (see leaf_writes.py), a backward names it as the leaf its gradient is for (training.py),
    ``size`` reads metadata, which writes in place do not change."""
    if user.op == "call_function" and user.target is written_leaf:
        return user.args[0] is node and node not in user.args[1:]
    if user.op == "call_function" and user.target in _backward_ops():
        return node is not user.args[0] and node in user.args[1]
    return user.op == "call_method" and user.target == "size"


def _backward_ops() -> tuple:
    from ...distributed import grad_and_allreduce  # (imports torch.distributed: not at import)
    return torch.autograd.grad, grad_and_allreduce


def _storages(example) -> set[int]:
    if isinstance(example, torch.Tensor):
        return {storage_key(example)} if example.numel() else set()
    if isinstance(example, (tuple, list)):
        return set().union(*(_storages(x) for x in example)) if example else set()
    return set()
