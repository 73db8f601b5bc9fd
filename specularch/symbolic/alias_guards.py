"""Guards the deferred writes need: a write is committed to what the capture reached it
through, so nothing else may reach the same memory or object by another path.
"""
from __future__ import annotations

import torch

from ..guards import AliasGuard, DistinctGuard, InferenceGuard, ListDistinctGuard
from ..guards.aliasing import storages_distinct
from ..guards.lists import list_tensors
from ..records import Unsupported

_OBJECT_WRITES = ("setattr", "delattr", "container", "item", "append")


def guard_writes(tracer) -> None:
    """The deferred writes assume that what they write is reached only through the
    sources that reached it at capture: guard that written tensors share no memory with
    other tensor inputs, and that written lists, dicts and objects are still the same
    object as their capture-time aliases and not the same as other sources of their type."""
    pending = tracer.heap.pending()
    _guard_tensor_writes(tracer, pending)
    _guard_object_writes(tracer, pending)


def _guard_tensor_writes(tracer, pending: list) -> None:
    written = list(dict.fromkeys(w.target.source for w in pending if w.kind == "tensor"
                                 and w.target.source is not None))
    if written:
        excluded = set(written)  # a set: every input is checked against every written one
        others = tuple(v.source for v in tracer.graph_inputs() if v.source not in excluded)
        tracer.add_guard(DistinctGuard, None, written=tuple(written), others=others)
        _guard_whole_lists(tracer, pending, tuple(written))
        if not torch.is_inference_mode_enabled():  # the commit's writes would be refused
            for w in pending:
                if w.kind == "tensor" and w.target.source is not None \
                        and w.target.real is not None and w.target.real.is_inference():
                    raise Unsupported("input_mutation", f"{w.target.source} is an inference "
                                      "tensor written inside torch.inference_mode(): the "
                                      "graph's commit runs outside it, where torch refuses")
            for source in written:
                tracer.add_guard(InferenceGuard, source, expected=False)


def _guard_whole_lists(tracer, pending: list, written: tuple) -> None:
    """Lists passed whole (``rolled/lists.py``) and linked walks (``rolled/walk.py``): the
    rolled body reads their tensors when the graph runs, before the commit, so none may share
    memory with a written tensor. Sharing now refuses the capture (it starts again with the
    loops unrolled, where the reads are ordinary inputs); later, the guard fails."""
    whole = {(s, ""): tracer._by_source[s] for s, _, _ in tracer.assumptions.rolled_lists
             if s in tracer._by_source}
    whole.update(((w.source, w.walk), w) for w in tracer.walks)
    if not whole:
        return
    reals = tuple(w.target.real for w in pending if w.kind == "tensor"
                  and w.target.source is not None and w.target.real is not None)
    for (source, link), value in whole.items():
        if not storages_distinct(reals, tuple(list_tensors(getattr(value, "examples", ())))):
            raise Unsupported("input_mutation", f"a tensor of the items of {source}"
                              f"{f' (walked by .{link})' if link else ''} shares memory with "
                              "a tensor the call writes in place (a rolled loop reads the items "
                              "when the graph runs, before the write is committed)")
    tracer.add_guard(ListDistinctGuard, None, written=written, others=tuple(s for s, _ in whole),
                     walks=tuple(link for _, link in whole))


def _guard_object_writes(tracer, pending: list) -> None:
    targets = dict.fromkeys(w.target.source for w in pending if w.kind in _OBJECT_WRITES
                            and getattr(w.target, "source", None) in tracer._mutable)
    for source in targets:
        oid, typ = tracer._mutable[source]
        others = []
        for other, (other_id, other_type) in tracer._mutable.items():
            if other == source:
                continue
            if other_id == oid:
                tracer.add_guard(AliasGuard, other, other=source)
            elif other_type is typ:
                others.append(other)
        if others:
            tracer.add_guard(DistinctGuard, None, written=(source,), others=tuple(others),
                             memory=False)
