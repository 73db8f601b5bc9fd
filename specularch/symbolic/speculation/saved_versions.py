"""Autograd's "modified by an inplace operation" error for writes the graph defers.

Eager: ``y = x * self.s`` saves ``self.s`` for backward; ``self.s.add_(1)`` bumps its version;
a backward through ``y`` later *in the same call* raises. Capture runs the write on a copy
(``Tracer._functionalize``) and the commit bumps the real tensor only after the graph ran,
so the capture-time backward would pass, and the graph would return gradients where eager
raises. While capturing, every tensor autograd saves is packed with its *logical* version
(its own counter plus the bumps its deferred writes made so far); unpacking it with another
logical version raises the error eager raises, which makes the call fall back to eager.

A write that bumps no version (through ``p.data``, see view_writes.py; batch_norm's running
statistics) leaves eager's backward reading the new values without an error, while the
graph's reads the values saved before the deferred write: such a backward is refused
(``input_mutation``).

Hooks replace autograd's own version check, so this check covers every saved tensor (fresh
ones too). A backward outside the call needs nothing: the commit bumps the counters as
eager does (``entry._tensor_commit``).
"""
from __future__ import annotations

import weakref

import torch

from ...records import Unsupported
from .._torch_dispatch import storage_key, version_bumps


def tracking(tracer) -> torch.autograd.graph.saved_tensors_hooks:
    """A context that makes capture-time backward see the deferred writes of ``tracer``.

    The hooks are stored in autograd's C++ nodes, which the garbage collector cannot see
    through: they reach the tracer only weakly, or a captured
    model would stay alive through tracer -> example tensors -> grad_fn -> hook -> tracer."""
    tracer_ref = weakref.ref(tracer)

    def written(key: int | None):
        live = tracer_ref()
        external = live._external.get(key) if live is not None and key is not None else None
        return external if external is not None and external.updated else None

    def deferred(key: int | None) -> int:
        external = written(key)
        return _own_version(external.example) if external is not None else 0

    def key_of(t: torch.Tensor):
        return storage_key(t) if t.layout is torch.strided and t.numel() else None

    def pack(t: torch.Tensor):
        # detached (same storage and version counter): a saved *output* packed as itself
        # would hold its own grad_fn, a cycle through C++ that gc cannot collect
        key = key_of(t)
        return t.detach(), key, _own_version(t) + deferred(key), written(key) is not None

    def unpack(packed):
        t, key, saved, was_written = packed
        now = _own_version(t) + deferred(key)
        if now != saved:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{t.type()} {list(t.shape)}] is at version {now}; "
                f"expected version {saved} instead")
        if not was_written and written(key) is not None:
            raise Unsupported("input_mutation", f"{written(key).source} is written in place "
                              "without a version bump (through `.data`, or batch_norm's "
                              "running statistics) after autograd saved it, then backward "
                              "runs: eager's backward reads the new values, the graph's would "
                              "read the old ones")
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _own_version(t: torch.Tensor) -> int:
    return version_bumps(t) or 0  # an inference tensor has no version (autograd saves none)
