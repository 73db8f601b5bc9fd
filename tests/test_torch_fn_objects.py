"""torch Python functions called with plain objects (``F.linear_cross_entropy(...,
options=LinearCrossEntropyOptions(...))``): inlined like user code instead of becoming one graph
node, and what that needs: torch dataclasses and ``__slots__`` classes made in the call, dicts
keyed by ``(str, dtype)`` tuples, and ``torch.library.custom_op`` functions as graph nodes."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from differential import A, T, check, check_module

pytestmark = pytest.mark.usefixtures("no_profiling")

LCEOptions = torch.nn.LinearCrossEntropyOptions


def _lce_args():
    return A(T(6, 4, requires_grad=True), torch.randint(0, 5, (6,)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [
    LCEOptions(),
    LCEOptions(batch_chunk_size=2),
    LCEOptions(chunking_method="aspect_ratio", acc_policy="accurate"),
    LCEOptions(allow_retain_graph=True, chunking_method=None),
], ids=["default", "chunk2", "aspect_accurate", "retain_nochunk"])
def test_linear_cross_entropy_options(reduction, options):
    def make():
        return nn.LinearCrossEntropyLoss(4, 5, reduction=reduction, options=options)
    check_module(make, _lce_args, expect="graph", grad=True)


def test_linear_cross_entropy_unbatched_with_bias_and_weight():
    def make():
        m = nn.LinearCrossEntropyLoss(4, 5, bias=True, weight=torch.rand(5), options=LCEOptions())
        return m
    check_module(make, lambda: A(T(4, requires_grad=True), torch.tensor(3)), expect="graph", grad=True)


def test_options_swapped_between_calls_are_guarded():
    """The options object's attributes are read at capture: another object (other chunking)
    must not reuse the graph built for the first one."""
    def between(m, i):
        m.options = LCEOptions(batch_chunk_size=1 + i)
    explanation = check_module(lambda: nn.LinearCrossEntropyLoss(4, 5, options=LCEOptions()), _lce_args,
                               expect="graph", grad=True, between=between)
    assert explanation.recompiles, explanation  # the first options failed a guard
    # ... then the chunk size is a graph input: `min`/`max` over it are decided by
    # comparisons, so one graph serves every chunk size (two graphs before)


# --------------------------------------------------------------------------- the mechanisms

@dataclasses.dataclass(slots=True, frozen=True)
class _Config:
    scale: float = 2.0
    shift: float = 0.0


def test_slotted_frozen_dataclass_made_and_returned():
    def f(x, cfg):
        new = dataclasses.replace(cfg, shift=1.5)
        return x * new.scale + new.shift, new
    check(f, lambda: A(T(3), _Config(3.0)), expect="graph")


class _Slots:
    __slots__ = ("a", "b")

    def __init__(self, a):
        self.a = a


def test_slotted_object_unset_slot_and_unknown_attribute():
    """Eager raises AttributeError for both; a model that stored ``o.c`` or read ``o.b`` as
    unset-but-present would differ (these fall back, raising as eager does)."""
    def read_unset(x):
        o = _Slots(x)
        try:
            return o.b
        except AttributeError:
            return o.a + 1

    def write_unknown(x):
        o = _Slots(x)
        o.c = 1
        return o.a

    check(read_unset, lambda: A(T(3)))
    check(write_unknown, lambda: A(T(3)))


_TABLE = {("cpu", torch.float32): 2.0, ("cpu", torch.float64): 3.0}


def test_dict_with_dtype_tuple_keys():
    def f(x):
        return x * _TABLE.get((x.device.type, x.dtype), 1.0)
    check(f, lambda: A(T(3)), expect="graph")
    check(f, lambda i: A(T(3, dtype=torch.float64 if i == 1 else torch.float32)), expect="graph")


@torch.library.custom_op("specularch_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


_scaled.register_fake(lambda x, k: torch.empty_like(x))
_scaled.register_autograd(lambda ctx, g: (g * ctx.k, None),
                          setup_context=lambda ctx, inputs, output: setattr(ctx, "k", inputs[1]))


def test_custom_op_is_a_graph_node():
    check(lambda x: _scaled(x, 3.0).sin(), lambda: A(T(4, requires_grad=True)), expect="graph", grad=True)


# --------------------------------------------------------------------------- float(tensor) as a value

@pytest.mark.parametrize("dims", [1, 2, 3])
def test_batchnorm_cumulative_average_is_captured(dims):
    """``momentum=None``: ``1.0 / float(self.num_batches_tracked)``, read right after the
    in-place increment, is F.batch_norm's momentum: the graph computes it on every call
    (1, 1/2, 1/3, ...: one graph, the running stats bit-identical to eager's)."""
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
    shape = (4, 3) if dims == 1 else (4, 3) + (2,) * dims
    e = check_module(lambda: bn(3, momentum=None), lambda: A(T(*shape, requires_grad=True)),
                     calls=4, expect="graph", grad=True)
    assert len(e.graphs) == 1, e


def test_float_of_tensor_as_an_op_value():
    def f(x):
        k = float(x.max())
        return x / (abs(k) + 1)
    check(f, lambda: A(T(3)), expect="graph")


def test_float_of_tensor_used_as_a_size_falls_back():
    def f(x):
        return x.repeat(int(float(x.abs().max())) % 2 + 1)
    check(f, lambda: A(T(3)), expect="fallback", fallback_kind="data_dependent_value")


def test_higher_order_torch_function_given_a_function_still_falls_back():
    """Only plain data objects make a torch function run as Python: given a function
    (``tree_map``, ``vmap``, ``checkpoint``) it transforms how that runs, which is not modelled."""
    def f(x):
        return torch.utils._pytree.tree_map(lambda y: y * 2, [x, x])[1]
    check(f, lambda: A(T(3)), expect="fallback", fallback_kind="unsupported_call")
