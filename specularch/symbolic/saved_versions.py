"""Autograd's "modified by an inplace operation" error for writes the graph defers.

Eager: ``y = x * self.s`` saves ``self.s`` for backward; ``self.s.add_(1)`` bumps its version;
a backward through ``y`` later *in the same call* raises. Capture runs the write on a copy
(``Tracer._functionalize``) and the commit bumps the real tensor only after the graph ran,
so the capture-time backward would pass, and the graph would return gradients where eager
raises. While capturing, every tensor autograd saves is packed with its *logical* version
(its own counter plus the bumps its deferred writes made so far); unpacking it with another
logical version raises the error eager raises, which makes the call fall back to eager.

Hooks replace autograd's own version check, so this check covers every saved tensor (fresh
ones too). A backward outside the call needs nothing: the commit bumps the counters as
eager does (``entry._tensor_commit``).
"""
from __future__ import annotations

import weakref

import torch

from ._torch_dispatch import storage_key, version_bumps


def tracking(tracer) -> torch.autograd.graph.saved_tensors_hooks:
    """A context that makes capture-time backward see the deferred writes of ``tracer``.

    The hooks are stored in autograd's C++ nodes, which the garbage collector cannot see
    through: they reach the tracer only weakly, or a captured
    model would stay alive through tracer -> example tensors -> grad_fn -> hook -> tracer."""
    tracer_ref = weakref.ref(tracer)

    def deferred(key: int) -> int:
        live = tracer_ref()
        written = live._external.get(key) if live is not None else None
        return _own_version(written.example) if written is not None and written.updated else 0

    def key_of(t: torch.Tensor):
        return storage_key(t) if t.layout is torch.strided and t.numel() else None

    def pack(t: torch.Tensor):
        # detached (same storage and version counter): a saved *output* packed as itself
        # would hold its own grad_fn, a cycle through C++ that gc cannot collect
        key = key_of(t)
        return t.detach(), key, _own_version(t) + (deferred(key) if key is not None else 0)

    def unpack(packed):
        t, key, saved = packed
        now = _own_version(t) + (deferred(key) if key is not None else 0)
        if now != saved:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{t.type()} {list(t.shape)}] is at version {now}; "
                f"expected version {saved} instead")
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _own_version(t: torch.Tensor) -> int:
    return version_bumps(t) or 0  # an inference tensor has no version (autograd saves none)
