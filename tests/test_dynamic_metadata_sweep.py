"""Adversarial differential sweep of metadata and size-dependent behaviour of tensors whose sizes
are dynamic (docs/semantics.md, "Relaxation: dynamic sizes"). After the 3 profiled calls a
dimension that varied is dynamic: sizes flow through the graph symbolically and are guarded where
they steer Python. Sizes 0, 1 and 2 are where eager's answers change (a transposed tensor is
contiguous, ``squeeze`` drops a dimension, ``reshape`` is a view, ``max(dim)`` raises, ``mean``
is nan, ``chunk`` gives fewer pieces), so every case runs 10 calls whose sizes vary and reach 0, 1
and 2 *after* call 4 (the capture, at a typical size). Each case is differential
(``differential.check`` / ``check_module``): values, dtypes, shapes, Python results (ints, bools,
``torch.Size``, tuples), exceptions (type and message), gradients; strides, storage offsets and
aliasing are compared where the program observes them (it returns them, or writes through a
result and returns the written tensor) and, in ``test_layout_of_results``, on the returned
tensors themselves. A recompile or an eager call is fine; a wrong answer or an
``internal_error`` fallback is not."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from differential import A, T, assert_same, check, check_module

CALLS = 10
# n for call i: calls 0-2 profile (they vary: the dimension becomes dynamic), call 3 captures at
# a typical size; then an empty size, a size of one, two, and both again later.
SIZES = [4, 5, 6, 5, 0, 1, 2, 7, 1, 3]
# a second size varying independently of n
OTHER = [3, 4, 2, 3, 1, 0, 5, 2, 2, 1]
# a size that equals n on some calls and is 1 (broadcastable) on others
ONE_OR_N = [4, 1, 6, 5, 0, 1, 1, 7, 1, 3]


def n_of(i):
    return SIZES[i % len(SIZES)]


def m_of(i):
    return OTHER[i % len(OTHER)]


def vec(grad=False):
    return lambda i: A(T(n_of(i), requires_grad=grad))


def vec6():
    """``x`` of a fixed shape (6,): only the data varies (how many elements are positive)."""
    return lambda i: A(T(6))


def mat(cols=3, grad=False):
    """``x`` of shape ``(n, cols)``."""
    return lambda i: A(T(n_of(i), cols, requires_grad=grad))


def wide(rows=3):
    """``x`` of shape ``(rows, n)``."""
    return lambda i: A(T(rows, n_of(i)))


def mat_t(cols=3):
    """``x`` of shape ``(n, cols)``, a transposed (non-contiguous unless n <= 1) input."""
    return lambda i: A(T(cols, n_of(i)).t())


def pair(cols=3):
    """``(x, y)``: ``(n, cols)`` and ``(m, cols)``."""
    return lambda i: A(T(n_of(i), cols), T(m_of(i), cols))


def nm():
    """``x`` of shape ``(n, m)``: both dimensions dynamic."""
    return lambda i: A(T(n_of(i), m_of(i)))


def summary(name, report):
    s = report.stats
    kinds = sorted({f.kind for f in report.fallbacks})
    print(f"SWEEP {name}: captures={s.captures} recompiles={s.recompiles} graphs={len(report.graphs)} "
          f"hits={s.graph_hits} fallback_calls={s.fallback_calls} "
          f"assumption_failures={s.assumption_failures} fallbacks={kinds}")
    assert not [f for f in report.fallbacks if f.kind == "internal_error"], report
    return report


def run(fn, make, *, grad=False, atol=0.0, rtol=0.0):
    return summary(fn.__name__, check(fn, make, calls=CALLS, grad=grad, atol=atol, rtol=rtol))


# --------------------------------------------------------------------------- sizes as Python values

def shape_tuples(x):
    return x.shape, x.size(), tuple(x.size()), x.size(0), x.shape[-1], list(x.shape), x.size(-2)


def shape_compare(x, y):
    return (x.shape == y.shape, x.size(0) == 1, x.shape[0] != y.shape[0], x.shape == (1, 3),
            x.shape[0] < y.shape[0], x.size() == torch.Size([0, 3]), x.shape[0] == 0)


def size_arithmetic(x):
    s = x.shape
    return (s + (2,), s[1:], s[::-1], torch.Size([s[0] * 2, s[1]]), (2,) + s, x.new_zeros(s + (2,)),
            x.new_ones(s[:1]), torch.ones(s), torch.zeros(*s[::-1]), x.reshape(s[:-1] + (-1,)))


def size_numel(x):
    return x.shape.numel()  # torch.Size.numel()


def size_tuple_ops(x, y):
    s = x.shape
    return (s > y.shape, s < (3, 3), s.count(3), s.index(3), len(s), sorted(s), s[0] in (0, 1),
            s == torch.Size([]), list(reversed(s)), (*s, 1))


def counts(x):
    return (x.numel(), len(x), x.dim(), x.ndim, x.nelement(), x[0:0].numel(), x.sum() / x.numel(),
            x.sum(0) / len(x), x.view(-1)[: x.numel() // 2])


def python_ints(x, y):
    n, m = x.size(0), y.size(0)
    return (n * 2 + m // 3, n % 2, divmod(n + 7, 3), max(x.shape), min(n, m), sum(x.shape),
            math.prod(x.shape), abs(n - m), n ** 2, -n, n // max(m, 1), float(n) / 2, n > m)


def size_key(x):
    table = {(0, 3): "empty", (1, 3): "one", (2, 3): "two"}
    return table.get(tuple(x.shape), "other"), x.shape in [(1, 3), (0, 3)], hash(x.shape) == hash((len(x), 3))


def branch_on_size(x):
    if x.shape[0] > 3:
        return x.sum(0), "big"
    if x.size(0) == 1:
        return x[0] * 2, "one"
    if not x.shape[0]:
        return x.new_zeros(3), "empty"
    return x.mean(0), "small"


def branch_on_numel(x):
    if x.numel():
        return x.amax()
    return x.new_full((), -1.0)


def one_or_sum(x):
    return x[0] if x.size(0) == 1 else x.sum(0)


def truthiness(x, y):
    return bool(x.shape[0]), bool(len(y)), x.shape[0] and y.shape[0], x.shape[0] or 7


# --------------------------------------------------------------------------- strides and layout

def python_div_zero(x, y):
    return len(x) / len(y), x.size(0) // y.size(0)  # m == 0: ZeroDivisionError, as eager


def python_mod_zero(x, y):
    return len(x) % y.size(0)  # m == 0: ZeroDivisionError


def python_pow_zero(x):
    return x * x.size(0) ** -1  # n == 0: ZeroDivisionError


def attention_scale(x):
    return x / math.sqrt(x.size(-1)), x.new_tensor(x.shape), torch.tensor(len(x)), x + x.size(0)


def int_types(x):
    n = x.size(0)
    return (type(n) is int, isinstance(x.shape, torch.Size), type(len(x)).__name__, isinstance(x.shape[0], int),
            type(x.shape).__name__, str(n), f"{n:03d}", hex(n), n.bit_length())


def int_types_plain(x):
    n = x.size(0)
    return (type(n) is int, isinstance(x.shape, torch.Size), type(len(x)).__name__, isinstance(x.shape[0], int),
            type(x.shape).__name__, str(n), f"{n:03d}", hex(n), int(n), len({*x.shape}))


def size_strings(x):
    print(x.shape, tuple(x.shape), len(x))
    return f"{x.shape}", repr(x.size()), str(x.shape[0]) + "rows", "%d x %d" % tuple(x.shape)


def python_repeats(x):
    n = len(x)
    return [0] * n, "ab" * n, list(range(n)), tuple(range(n))[-1:], [x[i].sum() for i in range(min(n, 2))]


def range_index_raises(x):
    return range(len(x))[-1]  # n == 0: IndexError, as eager


def item_of_sized(x):
    return x.item()  # raises unless n == 1, as eager


def bool_of_sized(x):
    return bool(x > 0)  # raises unless n == 1 (RuntimeError, two messages)


def empty_any_all(x):
    return x.any(), x.all(), (x > 0).all(0), x.median(), x.amax(0) if len(x) else x.new_full((3,), float("-inf"))


def quantile_empty(x):
    return x.quantile(0.5)  # n == 0: raises


def strides(x):
    return (x.stride(), x.t().stride(), x[:, 1:].stride(), x[1:].stride(), x.unsqueeze(1).stride(),
            x.unsqueeze(-1).stride(), x[::2].stride(), x.stride(0), x.t().stride(-1))


def contiguity(x):
    return (x.is_contiguous(), x.t().is_contiguous(), x[:, :1].is_contiguous(), x[::2].is_contiguous(),
            x[:, ::2].is_contiguous(), x.narrow(1, 0, 2).is_contiguous(), x.t().t().is_contiguous(),
            x.unsqueeze(1).is_contiguous())


def contiguity_permute(x):
    return (x.permute(2, 0, 1).is_contiguous(), x.permute(1, 0, 2).is_contiguous(),
            x.transpose(0, 2).is_contiguous(), x.mT.is_contiguous(), x.permute(1, 0, 2).contiguous().is_contiguous())


def contiguity_expand(x):
    e = x[:, :1].expand(-1, 4)
    f = x[:1].expand(5, -1)
    return e.is_contiguous(), f.is_contiguous(), x.unsqueeze(0).expand(2, -1, -1).is_contiguous(), e.contiguous().is_contiguous()


def expand_fixed(x):
    return x.expand(5, 3)  # (n, 3): raises unless n is 1 or 5, as eager


def branch_on_contiguity(x):
    y = x.t()
    if y.is_contiguous():
        return y.view(-1), "view"
    return y.reshape(-1), "reshape"


def channels_last(x):
    return (x.is_contiguous(memory_format=torch.channels_last), x.is_contiguous(),
            x.contiguous(memory_format=torch.channels_last).is_contiguous(),
            x.permute(0, 2, 3, 1).is_contiguous(), x.permute(0, 2, 3, 1).permute(0, 3, 1, 2).is_contiguous())


def storage_offsets(x):
    return (x[1:].storage_offset(), x[:, 1:].storage_offset(), x[-1:].storage_offset(),
            x[2:].storage_offset(), x.t()[1:].storage_offset(), x.narrow(1, 1, 2).storage_offset())


def same_size(x, y):
    return x.is_same_size(y), x.t().is_same_size(y.t()), x[:1].is_same_size(y[:1]), x.is_same_size(x[:, :3])


def contiguous_identity(x):
    """``x`` is a transposed input: ``contiguous()`` returns ``x`` itself when it is contiguous
    already (n <= 1), a copy otherwise; the harness checks identity with the input."""
    return x.contiguous(), x.is_contiguous()


def contiguous_is_self(x):
    y = x.t()
    return y.contiguous() is y, x.contiguous() is x, x.reshape(x.shape) is x


def like_factories(x):
    a = torch.empty_like(x.t())  # keeps the transposed layout: contiguous only when n <= 1
    b = torch.zeros_like(x[:, ::2])
    c = x.new_empty(x.shape)
    return (a.shape, a.is_contiguous(), b, b.is_contiguous(), c.shape, torch.ones_like(x.t()).t().is_contiguous(),
            torch.full_like(x, 2.0), x.new_zeros(x.shape), x.new_full((len(x),), 3.0))


def like_strides(x):
    return torch.empty_like(x.t()).stride(), torch.ones_like(x.t()).stride()


# --------------------------------------------------------------------------- views and copies

def views(x):
    return x.view(-1), x.view(x.size(0), -1), x.view(-1, 2, 3), x.view(x.shape), x.view(1, -1, 6)


def view_zero_raises(x):
    return x.view(x.size(0), -1)  # x is (n, 0, 3): n == 0 raises (the -1 could be anything)


def view_of_transposed(x):
    return x.t().view(-1)  # a view only when n <= 1; raises otherwise, as eager


def view_of_noncontig_input(x):
    return x.view(-1)  # x is a transposed input: viewable only when n <= 1


def view_half(x):
    return x.view(x.size(0) // 2, -1)  # odd n: the size is invalid, raises as eager


def reshape_write_through(x):
    """``reshape`` of a transposed tensor is a view at n <= 1 and a copy otherwise: whether the
    write reaches ``z`` is observable."""
    z = x.clone()
    r = z.t().reshape(-1)
    r[:2] = 100.0
    return z, r


def reshape_write_through_slice(x):
    z = x.clone()
    r = z[:, 1:].reshape(-1)
    r.mul_(-1)
    f = z[:, :1].flatten()
    f.add_(10)
    return z, r, f


def reshape_grad(x):
    return x.t().reshape(-1, 1).sum(1) * torch.arange(x.numel(), dtype=x.dtype)


# --------------------------------------------------------------------------- expand, squeeze, unsqueeze

def expands(x):
    return x.expand(2, -1, -1), x[:, :1].expand(-1, 5), x[:1].expand(x.size(0), -1), x.expand(*x.shape)


def expand_to_other(x, y):
    return x[:1].expand(y.size(0), -1), x[:1].expand_as(y), torch.broadcast_to(x[:1], y.shape)


def squeezes(x):
    """``squeeze`` drops a dimension only when its size is 1."""
    return x.squeeze(0), x.squeeze(0).shape, x.squeeze().shape, x.squeeze(0).sum(0), x.squeeze(-1).dim()


def squeeze_all(x):
    return x.squeeze(), x.squeeze().dim(), x.squeeze((0, 1)).shape


def unsqueezes(x):
    return x.unsqueeze(0).shape, x.unsqueeze(-1).squeeze(0).shape, x[None].squeeze(1).shape, x.unsqueeze(1)


def flatten_unflatten(x):
    return x.flatten(), x.flatten(0, 1), x.flatten(1).shape, x.unflatten(1, (2, 2)), x.flatten().unflatten(0, (-1, x.size(1)))


def unflatten_odd_raises(x):
    return x.unflatten(0, (2, -1))  # odd n: raises, as eager


def unfolds(x):
    return x.unfold(0, 2, 1)  # n < 2: raises, as eager


def unfold_last(x):
    return x.unfold(1, 2, 2).shape, x.unfold(0, 1, 1)


def broadcast_shapes(x, y):
    return torch.broadcast_shapes(x.shape, y.shape)  # (n, 3) and (m, 3): raises unless n == m or one is 1


def broadcast_ops(x, y):
    return x + y, (x * y).shape, torch.broadcast_tensors(x, y)[1].is_contiguous(), (x - y).sum(0, keepdim=True)


def outer_broadcast(x, y):
    return x[:, None] * y[None, :], (x[:, None] - y).shape


# --------------------------------------------------------------------------- empty and tiny reductions

def max_dim(x):
    return x.max(0)  # n == 0: IndexError, as eager


def min_dim_keep(x):
    return x.min(1, keepdim=True)  # (3, n): n == 0 raises


def mean_empty(x):
    return x.mean(), x.mean(0), x.sum(0), x.prod(0), x.amax(1), x.std(1)


def var_one(x):
    return x.var(0), x.std(0, correction=0), torch.var_mean(x, 0)


def argmaxes(x):
    return x.argmax()  # n == 0: raises, as eager


def argmax_dim(x):
    return x.argmax(1), x.argmin(1, keepdim=True)


def sum_keepdim(x):
    return x.sum(0, keepdim=True), x.sum(1, keepdim=True).shape, x.sum((0, 1), keepdim=True), x.mean(-1).shape


def topk_small(x):
    return x.topk(3, dim=0)  # n < 3: raises, as eager


def kth(x):
    return x.kthvalue(1, dim=0)  # n == 0: raises


def softmaxes(x):
    return F.softmax(x, dim=0), F.log_softmax(x, dim=1), x.softmax(-1).sum(-1)


# --------------------------------------------------------------------------- concatenation, splitting

def cat_empty(x, y):
    return torch.cat([x, y]), torch.cat([x, x[:0]]), torch.cat([y, torch.tensor([])]), torch.stack([x[:0].sum(0), y.sum(0)])


def stack_mismatch(x, y):
    return torch.stack([x, y])  # raises unless n == m


def splits(x):
    parts = x.split(2)
    return len(parts), [p.shape for p in parts], parts[-1]


def chunks(x):
    parts = x.chunk(3)  # 4 rows: 2 chunks; 5 rows: 3 chunks; 0 rows: 1
    return len(parts), tuple(p.size(0) for p in parts), parts


def chunk_last_dim(x):
    a, b = x.chunk(2, dim=1)  # the second dim is fixed (4): the first stays dynamic
    return a * b, a.shape


def unbinds(x):
    return len(x.unbind(0)), [r.sum() for r in x.unbind(0)]


def iterate_rows(x):
    total = x.new_zeros(3)
    for row in x:
        total = total + row
    return total, [float(v) for v in x.sum(1)]


# --------------------------------------------------------------------------- data-dependent

def tolists(x):
    return x.tolist(), x.shape[0], x.sum(0).tolist()


def masked(x):
    return x[x > 0], (x > 0).sum(), x[x > 0].shape


def nonzeros(x):
    return x.nonzero(), torch.where(x > 0), torch.nonzero(x > 0, as_tuple=True), x.nonzero().shape[0]


def masked_grad(x):
    return x[x > 0] * 2


def index_bad(x):
    return x[-1]  # n == 0: IndexError, as eager


# --------------------------------------------------------------------------- linear algebra

def einsums(x, y):
    return torch.einsum("ij,kj->ik", x, y), torch.einsum("ij->j", x), torch.einsum("ij,ij->", x, x)


def matmul_inner(x, y):
    """``x`` (3, n) @ ``y`` (n, 2): the inner dimension is dynamic (0: zeros)."""
    return x @ y, torch.mm(x, y).shape, (x @ x.t()).shape


def gram(x):
    return x @ x.t(), torch.eye(len(x)), torch.arange(len(x)).to(x.dtype) @ x


def matmul_mismatch(x, y):
    return x @ y  # (n, 3) @ (m, 3): raises, as eager


# --------------------------------------------------------------------------- functional ops

def pads(x):
    return F.pad(x, (1, 2)), F.pad(x, (0, 0, 1, 1)), F.pad(x, (0, 0, -1, 0)).shape


def pad_reflect(x):
    return F.pad(x[None], (0, 0, 2, 2), mode="reflect")  # rows < 3: raises, as eager


def interpolates(x):
    return (F.interpolate(x, size=x.size(-1) * 2), F.interpolate(x, scale_factor=2.0, mode="linear"),
            F.interpolate(x, size=3))


def layer_norms(x):
    return F.layer_norm(x, x.shape[-1:]), F.layer_norm(x, (3,)), F.normalize(x, dim=0)


def index_ops(x):
    idx = torch.arange(max(len(x) - 1, 0))
    return x.index_select(0, idx), x.flip(0), x.roll(1, 0), x.repeat(2, 1), x.repeat_interleave(2, 0)


def arange_ops(x):
    return torch.arange(x.size(0)), torch.zeros(x.size(0), x.size(0)), torch.ones(len(x), 2).cumsum(0), torch.linspace(0, 1, len(x))


def diag_ops(x):
    return x.diagonal(), x.diagonal().shape, torch.diag(x[:, 0]), x.tril(), x.triu(1)


def meshgrids(x, y):
    return torch.meshgrid(x, y, indexing="ij")


def sorts(x):
    return x.sort(0), x.cumsum(0), x.cummax(0), x.msort()


def narrows(x):
    return x.narrow(0, 1, x.size(0) - 1)  # n == 0: a negative length raises, as eager


def split_sizes(x):
    n = x.size(0)
    return x.split([min(n, 2), n - min(n, 2)]), x.tensor_split(3), len(x.tensor_split(3))


def split_bad_sizes(x):
    return x.split([2, 2])  # raises unless n == 4


def reshape_ambiguous(x):
    return x.reshape(-1, x.size(0))  # n == 0: ambiguous -1, raises


def last_flat(x):
    return x.view(-1)[x.numel() - 1]  # n == 0: index -1 of an empty tensor raises


def float_math(x, y):
    n, m = len(x), len(y)
    return (n / 2, round(n / 2), math.ceil(n / 3), math.floor(n / 3), int(n / 3), float(n) ** 0.5,
            round(n * 0.5 + m), math.log2(n + 1), math.isqrt(n), n * 1.5 > m)


def scalar_promotion(x):
    n = x.size(0)
    ints = torch.ones(2, dtype=torch.int32)
    return (torch.full((2,), n), x.new_full((2,), n), torch.arange(n), torch.arange(0.0, n), ints * n,
            ints * (n / 2), torch.tensor([n, 2.5]), torch.tensor(n / 2), torch.as_tensor(n),
            torch.ones(2, dtype=torch.uint8) - n, (x > 0) + n, torch.linspace(0, n, 3), torch.full((n,), n / 4))


def int_tensor_div_zero(x, y):
    return x.long() // len(y)  # m == 0: integer division by zero raises, as eager


def int_tensor_mod_zero(x, y):
    return x.long() % y.size(0), torch.remainder(x.long(), max(len(y), 1))


def intermediate_sizes(x, y):
    h = torch.cat([x, y])
    k = h[h.sum(1) > 0]
    if h.size(0) > 5:
        h = h * 2
    return h, h.size(0), torch.zeros(h.size(0) * 2), len(k), k.shape, torch.zeros(len(k) + 1)


def data_dependent_branch(x):
    k = x[x > 0]
    if len(k) > 4:
        return k.sum(), "many"
    return k.new_zeros(len(k) + 1), "few"


def unique_sizes(x):
    u = torch.unique(x.long())
    return u, u.numel(), torch.zeros(u.size(0), 2)


def contiguous_write_through(x):
    """``contiguous()`` returns the tensor itself when it is contiguous (a transpose at n <= 1):
    then the write reaches ``z``."""
    z = x.clone()
    c = z.t().contiguous()
    c[0] = -100.0
    return z, c


def channels_last_identity(x):
    """``x`` (2, m, n, 2): contiguous, and channels-last contiguous too when m == 1 or n * 2 == 1:
    then ``contiguous(channels_last)`` returns ``x`` itself."""
    return x.contiguous(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)


def expand_inplace(x):
    """An in-place op on an expanded tensor raises (internal overlap) only when the expand
    repeats an element: n > 1."""
    z = x.clone()[:1].expand(len(x), 3)
    z.add_(1)
    return z


def inplace_broadcast(x, y):
    z = y.clone()
    z += x  # (m, 3) += (n, 3): raises unless n == m or n == 1, as eager
    return z


def reshape_as_ops(x, y):
    return x[:1].expand_as(y).reshape_as(y), x.view_as(x), y.type_as(x) is y, x.float() is x, x.to(torch.float32) is x


# Data-dependent sizes of a tensor whose input shape is fixed (the input's sizes never vary, so
# they are static): the count of a mask's true elements changes from call to call.

def masked_len_static(x):
    k = x[x > 0]
    return len(k), k.shape, x.new_zeros(len(k))


def nonzero_count_static(x):
    return torch.arange((x > 0).nonzero().shape[0]), torch.zeros(len(torch.where(x > 0)[0]))


def masked_select_numel_static(x):
    return torch.masked_select(x, x > 0).numel(), torch.ones(torch.unique((x > 0).long()).numel())


def masked_slice_static(x):
    return x[:len(x[x > 0])]


def data_shaped_ops_static(x):
    return torch.repeat_interleave((x > 0).long()).shape, torch.bincount(x.clamp(0, 4).long()).shape[0]


def data_branch_static(x):
    k = x[x > 0]
    if len(k) > 4:
        return k.sum(), "many"
    return k.new_zeros(len(k) + 1), "few"


# --------------------------------------------------------------------------- the cases

CASES = [
    # sizes as Python values
    (shape_tuples, mat()), (shape_compare, pair()), (size_arithmetic, mat()), (size_numel, mat()),
    (size_tuple_ops, pair()), (counts, mat()), (python_ints, pair()), (size_key, mat()), (branch_on_size, mat()),
    (branch_on_numel, mat()), (one_or_sum, mat()), (truthiness, pair()), (python_div_zero, pair()),
    (python_mod_zero, pair()), (python_pow_zero, mat()), (attention_scale, mat()), (int_types, mat()),
    (size_strings, mat()), (python_repeats, mat()), (range_index_raises, mat()), (item_of_sized, vec()),
    (bool_of_sized, vec()), (empty_any_all, mat()), (quantile_empty, vec()), (int_types_plain, mat()),
    (float_math, pair()), (scalar_promotion, mat()), (int_tensor_div_zero, pair()), (int_tensor_mod_zero, pair()),
    (intermediate_sizes, pair()), (unique_sizes, mat()),
    (contiguous_write_through, mat()), (channels_last_identity, lambda i: A(T(2, m_of(i), n_of(i), 2))),
    (expand_inplace, mat()), (inplace_broadcast, lambda i: A(T(ONE_OR_N[i % 10], 3), T(n_of(i), 3))),
    (reshape_as_ops, pair()),
    # strides and layout
    (strides, mat()), (contiguity, mat()), (contiguity_permute, lambda i: A(T(2, n_of(i), 3))),
    (contiguity_expand, mat()), (expand_fixed, mat()), (branch_on_contiguity, mat()), (channels_last, lambda i: A(T(2, m_of(i), n_of(i), 2))),
    (storage_offsets, mat()), (same_size, pair()), (contiguous_identity, mat_t()),
    (contiguous_is_self, mat_t()), (like_factories, mat()), (like_strides, mat()),
    # views and copies
    (views, mat(6)), (view_zero_raises, lambda i: A(T(n_of(i), 0, 3))), (view_of_transposed, mat()),
    (view_of_noncontig_input, mat_t()), (view_half, mat()), (reshape_write_through, mat()),
    (reshape_write_through_slice, mat()),
    # expand, squeeze, unsqueeze, broadcasting
    (expands, mat()), (expand_to_other, pair()), (squeezes, mat()), (squeeze_all, lambda i: A(T(n_of(i), m_of(i), 1))),
    (unsqueezes, mat()), (flatten_unflatten, mat(4)), (unflatten_odd_raises, mat()), (unfolds, mat()),
    (unfold_last, wide(4)), (broadcast_shapes, lambda i: A(T(n_of(i), 3), T(ONE_OR_N[i % 10], 3))),
    (broadcast_ops, lambda i: A(T(n_of(i), 3), T(ONE_OR_N[i % 10], 3))), (outer_broadcast, lambda i: A(T(n_of(i)), T(m_of(i)))),
    # empty and tiny reductions
    (max_dim, mat()), (min_dim_keep, wide()), (mean_empty, mat()), (var_one, mat()), (argmaxes, mat()),
    (argmax_dim, wide()), (sum_keepdim, mat()), (topk_small, mat()), (kth, mat()), (softmaxes, mat()),
    # concatenation, splitting
    (cat_empty, pair()), (stack_mismatch, pair()), (splits, mat()), (chunks, mat()), (chunk_last_dim, mat(4)),
    (unbinds, mat()), (iterate_rows, mat()),
    # data-dependent
    (tolists, mat()), (masked, mat()), (nonzeros, mat()), (index_bad, mat()), (data_dependent_branch, mat()),
    (masked_len_static, vec6()), (nonzero_count_static, vec6()), (masked_select_numel_static, vec6()),
    (masked_slice_static, vec6()), (data_shaped_ops_static, vec6()), (data_branch_static, vec6()),
    # linear algebra
    (einsums, pair()), (matmul_inner, lambda i: A(T(3, n_of(i)), T(n_of(i), 2))), (gram, mat()),
    (matmul_mismatch, pair()),
    # functional ops
    (pads, mat()), (pad_reflect, mat()), (interpolates, lambda i: A(T(2, 3, n_of(i) + 1))),
    (layer_norms, lambda i: A(T(n_of(i), 3))), (index_ops, mat()), (arange_ops, mat()), (diag_ops, nm()),
    (meshgrids, lambda i: A(T(n_of(i)), T(m_of(i)))), (sorts, mat()), (narrows, mat()), (split_sizes, mat()),
    (split_bad_sizes, mat()), (reshape_ambiguous, mat()), (last_flat, mat()),
]

# Sizes made from data (x[mask], nonzero, torch.where(c), masked_select, unique,
# repeat_interleave(counts), bincount) were read as constants when the op's inputs had static
# sizes (new_zeros(len(k)) kept the capture's count, unguarded); tracer._data_shaped marks
# such results dynamic: the *_static cases and data_dependent_branch below.


def _param(fn, make):
    return pytest.param(fn, make, id=fn.__name__)


@pytest.mark.parametrize("fn, make", [_param(fn, make) for fn, make in CASES])
def test_dynamic_metadata(fn, make):
    run(fn, make)


# --------------------------------------------------------------------------- gradients

GRAD_CASES = [
    (reshape_grad, mat(grad=True)),
    (masked_grad, mat(grad=True)),
    (lambda x: (x.squeeze(0) * 2, x.unsqueeze(1).expand(-1, 2, -1).sum(1)), mat(grad=True)),
    (lambda x: (F.softmax(x, dim=0), F.layer_norm(x, (3,)), x.mean(0)), mat(grad=True)),
    (lambda x: (torch.cat([x, x[:0], x[:1]]), x.t() @ x, x.flatten().unflatten(0, (-1, 3))), mat(grad=True)),
    (lambda x: (F.cross_entropy(x, torch.arange(len(x)) % 3), x.t().reshape(-1) * 2, x.expand(2, -1, -1) * 3), mat(grad=True)),
    (lambda x: (x.squeeze(), x.view(x.size(0), -1), x.sum(0, keepdim=True).expand_as(x) * x), lambda i: A(T(n_of(i), 1, 2, requires_grad=True))),
]


@pytest.mark.parametrize("fn, make", GRAD_CASES, ids=["reshape", "masked", "squeeze_expand", "softmax_norm", "cat_matmul", "cross_entropy", "squeeze_all"])
def test_dynamic_metadata_grad(fn, make):
    run(fn, make, grad=True, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- modules

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = self.norm(self.proj(x))
        if h.size(0) == 1:
            h = h * 2
        return h.softmax(0), h.shape, h.squeeze(0).dim(), h.mean(0)


class Norms(nn.Module):
    """BatchNorm in training raises (ValueError, from Python) for a batch of 1; InstanceNorm for a
    length of 1; a convolution for a length below its kernel."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.conv = nn.Conv1d(3, 2, kernel_size=2)

    def forward(self, x):  # (b, 3, t): both dynamic
        h = self.bn(x)
        return self.conv(h), F.instance_norm(h), F.max_pool1d(h, 2).shape


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):  # (b, t, 4): both dynamic
        b, t, _ = x.shape
        y = self.lin(x).reshape(b * t, -1).view(b, t, 2)
        return y.sum(1) / max(t, 1), y.flatten(1).shape, y.transpose(0, 1).is_contiguous()


@pytest.mark.parametrize("make_module, make", [
    (Head, mat()), (Pool, lambda i: A(T(n_of(i), m_of(i), 4))), (Norms, lambda i: A(T(n_of(i), 3, m_of(i))))],
    ids=["head", "pool", "norms"])
@pytest.mark.parametrize("grad", [False, True])
def test_dynamic_metadata_module(make_module, make, grad):
    args = make
    if grad:
        def args(i):
            (x,), kw = make(i)
            return A(x.requires_grad_(True), **kw)
    summary(make_module.__name__, check_module(make_module, args, calls=CALLS, grad=grad, atol=1e-6, rtol=1e-5))


# --------------------------------------------------------------------------- layout of results

def _layout(t: torch.Tensor, inputs):
    shares = [j for j, a in enumerate(inputs) if isinstance(a, torch.Tensor)
              and t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and t.numel() and a.numel()]
    return t.shape, t.stride(), t.storage_offset(), shares


def _flat(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


def returns_views(x):
    return x.t(), x[1:], x.reshape(-1), x.squeeze(0), x.expand(2, -1, -1), x.contiguous(), x[:, :1].flatten()


LAYOUT_CASES = [(returns_views, mat_t()), (returns_views, mat()), (lambda x: x.view(-1, 3).t(), mat(6)),
                (lambda x: (x.unsqueeze(1), x.permute(1, 0), x.diagonal()), nm())]


@pytest.mark.parametrize("fn, make", LAYOUT_CASES, ids=["views_of_transposed", "views", "view_t", "nm_views"])
def test_layout_of_results(fn, make):
    """Strides, storage offsets and aliasing (which input a result shares memory with) of the
    returned tensors, which the harness does not compare: a graph must return views where eager
    does and copies where eager does."""
    opt = specularch.optimize(fn)
    for i in range(CALLS):
        torch.manual_seed(i)
        args_e, _ = make(i)
        torch.manual_seed(i)
        args_o, _ = make(i)
        eager, optimized = fn(*args_e), opt(*args_o)
        assert_same(eager, optimized, f"call #{i + 1}")
        le = [_layout(t, args_e) for t in _flat(eager)]
        lo = [_layout(t, args_o) for t in _flat(optimized)]
        assert le == lo, f"call #{i + 1}: layout differs\neager     {le}\noptimized {lo}"
    summary(getattr(fn, "__name__", "layout"), specularch.explain(opt))
