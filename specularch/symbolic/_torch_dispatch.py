"""Compat: the one place the symbolic executor touches torch's Python dispatch mode.

Capture runs real torch ops on real inputs (so every value is concrete). To make that safe,
``MutationCheck`` watches every ATen op below autograd and refuses, *before it runs*, any op
that writes into a tensor whose storage was not created during this capture: arguments,
parameters, buffers, globals. Refusal raises ``ExternalMutation``; nothing was written.

``_should_skip_dynamo`` returns False so that torch does not wrap our ``__torch_dispatch__``
in ``torch._disable_dynamo`` (which would import ``torch._dynamo``, ~2 s, for nothing).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class ExternalMutation(Exception):
    def __init__(self, op_name: str, key: int):
        super().__init__(op_name)
        self.op_name = op_name
        self.key = key  # storage key of the tensor the op would have written


# Ops whose schema does not declare that they write some arguments (a known schema gap):
# op name -> (written argument positions, position of the `training` flag that enables it).
UNDECLARED_WRITES = {
    "aten::native_batch_norm": ((3, 4), 5),
    "aten::_batch_norm_impl_index": ((3, 4), 5),
    "aten::cudnn_batch_norm": ((3, 4), 5),
    "aten::miopen_batch_norm": ((3, 4), 5),
}


def storage_key(t: torch.Tensor) -> int:
    if t.layout is not torch.strided:  # sparse, nested, ...: no single storage; keyed by object
        return -id(t)
    return t.untyped_storage().data_ptr()


def version_bumps(t: torch.Tensor) -> int | None:
    """Autograd's version counter of ``t``: how many in-place writes autograd saw since ``t``
    was made (0 for a fresh ``clone``); None for an inference tensor, which has none. Ops
    with undeclared writes (``batch_norm``'s running stats) do not bump it, in eager or
    during capture."""
    return None if t.is_inference() else t._version


def write_key(t: torch.Tensor):
    """``storage_key``, but a tensor of no storage by itself (every empty storage has address
    0: one of the caller's and one the call made would look alike) is keyed by itself: what
    ``MutationCheck`` and ``Tracer._external`` key writes by (a write into an empty tensor
    changes no element, but bumps its version, and an ``out=`` resizes it)."""
    if t.layout is torch.strided and not t.untyped_storage().nbytes():
        return ("empty", id(t))
    return storage_key(t)


class MutationCheck(TorchDispatchMode):
    """Allows writes only into storages in ``fresh``; records storages ops create."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, fresh: set[int]):
        super().__init__()
        self.fresh = fresh
        self.wrote = False  # did any op write in place (into a fresh tensor)?
        self.written: set[int] = set()  # the storages written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Reached whole only below autograd (inside inference mode): check the ops it is
            # made of, as elsewhere (aten::batch_norm writes running stats undeclared).
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        schema = func._schema
        if schema.name == "aten::lift_fresh":  # torch.tensor(data): new storage made outside
            self.fresh.add(storage_key(args[0]))
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            self.wrote = True
            val = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for t in tree_leaves(val):
                if isinstance(t, torch.Tensor) and write_key(t) not in self.fresh:
                    raise ExternalMutation(str(func), write_key(t))
                if isinstance(t, torch.Tensor):
                    self.written.add(storage_key(t))
        undeclared = UNDECLARED_WRITES.get(schema.name)
        if undeclared is not None and len(args) > undeclared[1] and args[undeclared[1]]:
            self.wrote = True
            for i in undeclared[0]:
                t = args[i] if i < len(args) else None
                if isinstance(t, torch.Tensor) and write_key(t) not in self.fresh:
                    raise ExternalMutation(str(func), write_key(t))
                if isinstance(t, torch.Tensor):
                    self.written.add(storage_key(t))
        out = func(*args, **kwargs)
        inputs = {write_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = write_key(t)
                if key not in inputs:
                    self.fresh.add(key)
        return out


def custom_op_overload(obj):
    """The ``OpOverload`` a ``torch.library.custom_op`` function stands for (its ``__call__``
    only forwards to it, autograd included), or None for anything else."""
    from torch._library.custom_ops import CustomOpDef
    if isinstance(obj, CustomOpDef) and type(obj).__call__ is CustomOpDef.__call__:
        return obj._opoverload
    return None


# What capture treats as a torch function by type: ``torch.ops.aten.add`` (a packet) and
# ``torch.ops.aten.add.Tensor`` (one overload) are id-guarded like any function.
OPERATOR_TYPES = (torch._ops.OpOverloadPacket, torch._ops.OpOverload)


def is_tensor_class(cls: type) -> bool:
    """Whether ``cls`` is torch's C tensor base (or a subclass): the owner of the tensor
    methods implemented in C (``Tensor.add`` has ``__objclass__`` ``TensorBase``)."""
    return issubclass(cls, torch._C.TensorBase)
