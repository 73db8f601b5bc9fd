"""Adversarial differential sweep of slices with a symbolic bound (``values.SliceV``, see
``tests/test_symbolic_slices.py``): ``x[:n]`` with ``n`` a dynamic size and ``x[t:t + k]`` with
``t`` a rolled loop's index are graph ops on those numbers. Every case is differential
(``differential.check`` / ``check_module``): eager and optimized run on identical inputs over
10 calls whose sizes vary (the 3 profiled calls make the dimensions dynamic) and everything a
user can observe must be the same: values, dtypes, shapes, exceptions, arguments written in
place, parameters after an optimizer step, gradients. The sizes include 0, 1 and a size past
the sliced dimension (empty slices, clamped bounds, ``-0``), negative bounds, steps, several
dimensions with ``...`` and ``None``, chains, views / reshapes / cats of the slices, writes
through slices, slices returned (view or copy, strides), loops sliced by their index, Python
lists and strings sliced by a size. Where the feature applies the case also asserts one graph
for every size; elsewhere only that the results match (eager or a recompile is fine, a wrong
answer or an internal error is not)."""
import pytest
import torch
from torch import nn

import specularch
from differential import A, T, check, check_module

CALLS = 10
# n for call i: calls 0-2 profile (they vary: the dimension becomes dynamic), call 3 captures;
# then an empty size, a size of one, and a size past every sliced dimension (25 > 20).
SIZES = [5, 6, 7, 8, 0, 1, 9, 25, 3, 6]
# a second dynamic size (m), varying independently of n
OTHER = [3, 4, 9, 2, 6, 0, 12, 1, 7, 5]


def n_of(i):
    return SIZES[i % len(SIZES)]


def m_of(i):
    return OTHER[i % len(OTHER)]


def sized(*shape, grad=False):
    """``(x, y)``: ``x`` of a fixed shape, ``y`` of length ``n`` (its size is the bound)."""
    return lambda i: A(T(*shape, requires_grad=grad), T(n_of(i), requires_grad=grad))


def two_sized(*shape):
    """``(x, y, w)``: ``len(y)`` is n, ``len(w)`` is m."""
    return lambda i: A(T(*shape), T(n_of(i)), T(m_of(i)))


def summary(name, report):
    s = report.stats
    kinds = sorted({f.kind for f in report.fallbacks})
    print(f"SWEEP {name}: captures={s.captures} recompiles={s.recompiles} graphs={len(report.graphs)} "
          f"fallback_calls={s.fallback_calls} fallbacks={kinds} backends={[g.backend for g in report.graphs]}")
    assert not [f for f in report.fallbacks if f.kind == "internal_error"], report
    return report


def one_graph(report):
    """One graph for every size, no fallback."""
    assert report.stats.captures == 1 and not report.stats.recompiles and not report.fallbacks, report


def run(fn, make, *, calls=CALLS, grad=False, backend=None, atol=0.0, rtol=0.0):
    return summary(fn.__name__, check(fn, make, calls=calls, grad=grad, backend=backend, atol=atol, rtol=rtol))


# --------------------------------------------------------------------------- bounds

def neg_bounds(x, y):
    n = y.shape[0]
    return x[-n:], x[:-n], x[-n:-1], x[-2 * n:n], x[n - 30:]  # n == 0: x[-0:] is all of x


def past_end(x, y):
    n = y.shape[0]
    return x[:3 * n], x[2 * n:], x[n + 100:], x[n:n + 100]


def empty(x, y):
    n = y.shape[0]
    return x[n:n - 2], x[n:2], x[n:n], x[n + 1:n], x[n:n - 2].sum(0)


def steps(x, y):
    n = y.shape[0]
    return x[1:n:2], x[n::3], x[::2][:n], x[-n::4], x[n:1:5]


def symbolic_step(x, y):
    n = y.shape[0]
    return x[::max(n, 1)], x[1::n + 1], x[n // 4::n // 4 + 2]


def zero_step_raises(x, y):
    n = y.shape[0]
    return x[::n]  # n == 0: ValueError (slice step cannot be zero)


def negative_step_raises(x, y):
    n = y.shape[0]
    return x[::-n - 1]  # tensors take no negative step: ValueError


def arithmetic_bounds(x, y):
    n = y.shape[0]
    return (x[n // 2:], x[:n - 1], x[:max(n, 3)], x[min(n, 4):], x[n % 4:], x[:-(n // 3)],
            x[2 * n - 5:], x[abs(n - 8):])


def two_sizes(x, y, w):
    n, m = y.shape[0], w.shape[0]
    return x[n:m], x[min(n, m):max(n, m)], x[:n + m], x[:n, :m], x[m - n:]


def python_int_bound(x, n):
    return x[:n], x[n:2 * n], x[-n:]


def len_and_size_bounds(x):
    return x[:len(x) // 2], x[-x.size(0) // 3:], x[:, :x.size(-1) - 1], x[1:x.shape[0] - 1]


@pytest.mark.parametrize("fn, make", [
    (neg_bounds, sized(20)), (past_end, sized(20)), (empty, sized(20, 2)), (steps, sized(20)),
    (symbolic_step, sized(20)), (arithmetic_bounds, sized(20)), (two_sizes, two_sized(12, 12))],
    ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("backend", [None, "torchscript"])
def test_bounds(fn, make, backend):
    run(fn, make, backend=backend)


@pytest.mark.parametrize("fn", [zero_step_raises, negative_step_raises], ids=lambda f: f.__name__)
def test_bad_steps_raise_as_eager(fn):
    run(fn, sized(20))


def test_a_python_int_argument_as_bound():
    run(python_int_bound, lambda i: A(T(20), n_of(i)))


def test_bounds_from_len_and_size_of_the_sliced_tensor():
    run(len_and_size_bounds, lambda i: A(T(n_of(i) + 1, n_of(i) % 4 + 1)))


# --------------------------------------------------------------------------- several dimensions

def several_dims(x, y):
    n = y.shape[0]
    return (x[None, :n], x[:n, None, 1:n], x[..., :n], x[n // 2:, ..., :n],
            x[:, :n][None, ..., None], x[..., None, -n:])


def chains(x, y, w):
    n, m = y.shape[0], w.shape[0]
    return x[:n][:, :m], x[:n][1:][:-1], x[m:][:n], x[:n][m:][:, -m:]


def int_and_slice(x, y):
    n = y.shape[0]
    return x[:n, n % 12], x[n % 12, :n], x[-1, n:]


def int_index_out_of_range(x, y):
    n = y.shape[0]
    return x[:n, n]  # n >= 12: IndexError, as eager


def tensor_index_and_slice(x, y):
    n = y.shape[0]
    idx = torch.tensor([0, 2, 1])
    return x[idx, :n], x[:n][:, idx]


@pytest.mark.parametrize("fn, make", [
    (several_dims, sized(12, 12)), (chains, two_sized(12, 12)), (int_and_slice, sized(12, 12)),
    (int_index_out_of_range, sized(12, 12)), (tensor_index_and_slice, sized(12, 12))],
    ids=lambda v: getattr(v, "__name__", ""))
def test_several_dims(fn, make):
    run(fn, make)


def test_several_dims_torchscript():
    run(several_dims, sized(12, 12), backend="torchscript")


# --------------------------------------------------------------------------- slices then ops

def views(x, y):
    n = y.shape[0]
    return x[:n].reshape(-1), x[:n].view(-1, 2), x[:n].flatten(), x[:n].unsqueeze(0).view(1, -1, 4)


def view_by_n_raises(x, y):
    n = y.shape[0]
    return x[:n].view(n, 2, 2)  # n == 25 > 20 rows: the view's size is invalid, as eager


def expands(x, y):
    n = y.shape[0]
    return x[:n, :1].expand(-1, 5), x[:1, :n].expand(n, -1), x[:n, None].expand(-1, 3, -1)


def cats(x, y):
    n = y.shape[0]
    return torch.cat([x[:n], x[n:]]), torch.cat([x[:n], y.unsqueeze(1).expand(-1, 4)], 1)  # n == 25: raises


def matmuls(x, y, w):
    n, m = y.shape[0], w.shape[0]
    a = x[:n]
    return a @ x[:m].t(), a.t() @ a, (a[:, :m] @ x[:m, :n]).sum()


def non_contiguous(x, y):
    n = y.shape[0]
    xt = x.t()
    return xt[:n].contiguous().view(-1), xt[:n].reshape(-1), xt[:, :n].sum(0)


def contiguity_of_a_slice(x, y):
    n = y.shape[0]
    return x.t()[:n].is_contiguous()  # n == 0: True (an empty tensor is contiguous); else False


def non_contiguous_view_raises(x, y):
    n = y.shape[0]
    return x.t()[:, :n].view(-1)  # not viewable (n >= 2), as eager


def layout_of_the_slice(x, y):
    n = y.shape[0]
    v = x[1:n:2, n // 3:]
    return v.stride(), v.storage_offset(), v.is_contiguous(), v.shape, v.numel(), v.dim()


@pytest.mark.parametrize("fn, make", [
    (views, sized(20, 4)), (view_by_n_raises, sized(20, 4)), (expands, sized(20, 20)),
    (cats, sized(20, 4)), (matmuls, two_sized(20, 20)), (non_contiguous, sized(12, 12)),
    (non_contiguous_view_raises, sized(12, 12)), (layout_of_the_slice, sized(20, 20))],
    ids=lambda v: getattr(v, "__name__", ""))
def test_ops_on_slices(fn, make):
    run(fn, make)


def test_contiguity_of_a_slice():
    """``x.t()[:n].is_contiguous()`` is True in eager at ``n == 0`` (empty) and False at 8: the
    graph checks the answer it assumed (``Tracer._assume_layout``; it was baked in, unguarded)."""
    run(contiguity_of_a_slice, sized(12, 12))


def test_ops_on_slices_torchscript():
    run(matmuls, two_sized(20, 20), backend="torchscript")


# --------------------------------------------------------------------------- writes through slices

def inplace_on_clone(x, y):
    n = y.shape[0]
    z = x.clone()
    z[:n].mul_(2)
    z[n:] += 1
    z[::3][:n] = -1
    z[-n:].clamp_(max=0.5)
    return z


def setitem_tensor(x, y):
    n = y.shape[0]
    z = x.clone()
    z[:n] = y  # n > 20: the shapes differ, as eager
    z[n:] = y[:1]
    return z


def setitem_2d(x, y):
    n = y.shape[0]
    z = x.clone()
    z[None, :n][..., n // 2:] = 1
    z[:, -n:] *= 3
    return z


def write_argument(x, y):
    n = y.shape[0]
    x[:n] = 0
    x[n:].add_(1)
    return x.sum()


def write_argument_2d(x, y):
    n = y.shape[0]
    x[:, :n] = y.sum()
    x[n:, ...].zero_()


def write_argument_augmented(x, y):
    n = y.shape[0]
    x[:n] += y.sum()  # iadd through a view of an argument: eager is fine


def write_then_read_view(x, y):
    n = y.shape[0]
    z = x.clone()
    v = z[:n]
    z.add_(1)  # the view sees it
    w = z[n:]
    w.mul_(-1)  # z sees it
    return v, v.sum(), z


def setitem_with_grad(x, y):
    n = y.shape[0]
    z = x * 1
    z[:n] = y * 2  # n > 20: raises, as eager
    return z


def grad_through_slices(x, y):
    n = y.shape[0]
    return (x[:n] * 2).sum() + x[-n:].pow(2).sum() + x[n // 2:n].sin().sum() + (x[:n][:y.shape[0]] * y[:20]).sum()


@pytest.mark.parametrize("fn, make, grad", [
    (inplace_on_clone, sized(20), False), (setitem_tensor, sized(20), False),
    (setitem_2d, sized(12, 12), False), (write_argument, sized(20), False),
    (write_argument_2d, sized(12, 12), False), (write_argument_augmented, sized(20), False),
    (write_then_read_view, sized(20), False), (setitem_with_grad, sized(20, grad=True), True),
    (grad_through_slices, sized(20, grad=True), True)],
    ids=lambda v: getattr(v, "__name__", "") if callable(v) else "")
def test_writes_and_grads(fn, make, grad):
    run(fn, make, grad=grad)


@pytest.mark.parametrize("fn, make, grad", [
    (inplace_on_clone, sized(20), False), (write_argument, sized(20), False),
    (grad_through_slices, sized(20, grad=True), True)],
    ids=lambda v: getattr(v, "__name__", "") if callable(v) else "")
def test_writes_and_grads_torchscript(fn, make, grad):
    run(fn, make, grad=grad, backend="torchscript")


# --------------------------------------------------------------------------- a returned slice

def returned_views(x, y):
    n = y.shape[0]
    return x[:n], x[n:, 1:], x[None, -n:], x[::2][:n], x[1:n:3, n // 2:]


def returned_view_of_a_local(x, y):
    n = y.shape[0]
    z = x * 2
    return z[:n], z


def _layout(t):
    return (t.shape, t.stride(), t.storage_offset(), t.is_contiguous(), t.dtype)


def _base_index(t, args):
    """Which argument ``t`` is a view of (by ``_base``), or which output shares its storage."""
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor) and t._base is a:
            return k
    return None


@pytest.mark.parametrize("fn", [returned_views, returned_view_of_a_local], ids=lambda f: f.__name__)
def test_a_returned_slice_is_a_view_as_in_eager(fn):
    """The harness compares values; here also what a view shows: its layout, whose view it is
    (``_base``), whether outputs share memory, and that a write into the returned tensor
    reaches the argument (and a write into the argument reaches the returned tensor)."""
    opt = specularch.optimize(fn)
    for i in range(CALLS):
        torch.manual_seed(i)
        args_e = (T(20, 6), T(n_of(i)))
        args_o = tuple(a.clone() for a in args_e)
        out_e, out_o = fn(*args_e), opt(*args_o)
        for k, (a, b) in enumerate(zip(out_e, out_o)):
            where = f"call {i} output {k}"
            assert _layout(a) == _layout(b), (where, _layout(a), _layout(b))
            assert torch.equal(a, b), where
            assert _base_index(a, args_e) == _base_index(b, args_o), where
            assert (a._base is None) == (b._base is None), where
            for j in range(len(out_e)):
                same_e = a.untyped_storage().data_ptr() == out_e[j].untyped_storage().data_ptr()
                same_o = b.untyped_storage().data_ptr() == out_o[j].untyped_storage().data_ptr()
                assert same_e == same_o, (where, "shares memory with output", j)
        for a, b in zip(out_e, out_o):
            a.add_(1)  # (overlapping outputs are written twice on both sides)
            b.add_(1)
        for a, b in zip(args_e + out_e, args_o + out_o):
            assert torch.equal(a, b), f"call {i}: a write into a returned slice"
        args_e[0].mul_(3)
        args_o[0].mul_(3)
        for a, b in zip(out_e, out_o):
            assert torch.equal(a, b), f"call {i}: a write into the argument"
    summary(fn.__name__, specularch.explain(opt))


# --------------------------------------------------------------------------- masks

def tril_mask(x, y, w):
    n, m = y.shape[0], w.shape[0]
    mask = torch.ones(n, n).tril()[:m, :m]
    return mask, mask.sum(), x[:m, :m].masked_fill(mask[:12, :12] == 0, -1.0)


def tril_mask_same_size(x, y):
    n = y.shape[0]
    mask = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()[:n, 1:]
    return mask, x[:n, :n].masked_fill(~mask[:12, :12], 0.0)


@pytest.mark.parametrize("fn, make", [(tril_mask, two_sized(12, 12)), (tril_mask_same_size, sized(12, 12))],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_masks(fn, make):
    run(fn, make)


# --------------------------------------------------------------------------- rolled loops

LOOP_N = [4, 5, 6, 7, 1, 9, 13, 2, 0, 8]  # up to the end of x (14 rows) and past it


def loop_n(i):
    return LOOP_N[i % len(LOOP_N)]


def loop_window(x, h, n):
    for t in range(n):
        h = torch.tanh(h + x[t:t + 3].sum(0))
    return h


def loop_column(x, h, n):
    for t in range(n):
        h = h * 0.5 + x[:, t]
    return h


def loop_prefix(x, h, n):
    for t in range(n):
        h = h + x[:t + 1].mean(0)  # a growing prefix: another size every iteration
    return h


def loop_stride(x, h, n):
    for t in range(n):
        h = h + x[t::2].sum(0)
    return h


def loop_tail(x, h, n):
    for t in range(n):
        h = h + x[-t - 1:].sum(0) + x[:-t].sum(0)  # t == 0: x[:-0] is empty
    return h


def loop_step_from_index(x, h, n):
    for t in range(n):
        h = h + x[::t + 1].sum(0)
    return h


def loop_write(x, h, n):
    z = x.clone()
    for t in range(n):
        z[t + 1:t + 2] = z[t:t + 1] * 0.5 + h
    return z


def loop_fill_slice(x, h, n):
    z = x.clone()
    for t in range(n):
        z[t:t + 1] = 5  # nothing carried: the loop only writes
    return z


def loop_write_carried(x, h, n):
    z = x.clone()
    for t in range(n):
        h = h * 0.5 + z[t:t + 1]
        z[t + 1:t + 2] = h
    return z, h


def loop_write_argument(x, h, n):
    for t in range(n):
        x[t:t + 1] = x[t:t + 1] * 2 + h


def loop_window_returns_slices(x, h, n):
    outs = []
    for t in range(n):
        h = h + x[t:t + 2].sum(0)
        outs.append(h)
    return h, outs


def loop_args(i, grad=False):
    return A(T(14, 3, requires_grad=grad), T(3, requires_grad=grad), loop_n(i))


LOOPS = [loop_window, loop_column, loop_prefix, loop_stride, loop_tail, loop_step_from_index,
         loop_write, loop_fill_slice,
         loop_write_carried, loop_write_argument, loop_window_returns_slices]


def _loop_make(fn, grad=False):
    if fn is loop_column:
        return lambda i: A(T(3, 14, requires_grad=grad), T(3, requires_grad=grad), loop_n(i))
    return lambda i: loop_args(i, grad)


@pytest.mark.parametrize("fn", LOOPS, ids=lambda f: getattr(f, "__name__", ""))
def test_loops(fn):
    run(fn, _loop_make(fn), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fn", [loop_window, loop_prefix, loop_tail, loop_column], ids=lambda f: f.__name__)
def test_loops_with_grad(fn):
    run(fn, _loop_make(fn, grad=True), grad=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", [loop_window, loop_prefix, loop_write,
                                loop_write_carried, loop_tail], ids=lambda f: getattr(f, "__name__", ""))
def test_loops_exact_templates(fn):
    """Under templates='exact' the results are eager's bit for bit (no tolerance)."""
    with specularch.config.patch(templates="exact"):
        run(fn, _loop_make(fn))


def test_loop_with_grad_exact_templates():
    with specularch.config.patch(templates="exact"):
        run(loop_prefix, _loop_make(loop_prefix, grad=True), grad=True)


def test_loops_torchscript():
    run(loop_window, _loop_make(loop_window), backend="torchscript", atol=1e-6, rtol=1e-6)


def loop_over_a_dynamic_length(x, h):
    for t in range(x.shape[0] - 1):
        h = h + x[t:t + 2].prod(0)
    return h


def test_a_loop_over_a_dynamic_length():
    run(loop_over_a_dynamic_length, lambda i: A(T(n_of(i) + 1, 3), T(3)), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- Python values

def list_slices(x, y):
    n = y.shape[0]
    xs = [x * i for i in range(10)]
    kept = xs[:n] + xs[-n:] + xs[n::3]
    return len(kept), sum(kept, x * 0), xs[n:n + 2]


def string_slices(x, y):
    n = y.shape[0]
    s = "abcdefghijkl"
    return x * len(s[:n]), s[n::2], s[-n:], x * len(s[n:n - 2])


def shape_slices(x, y):
    n = y.shape[0]
    return x.reshape(1, 1, 1, -1).shape[:n], x.shape[n:], tuple(range(10))[:n]


def list_slice_assignment(x, y):
    n = y.shape[0]
    xs = [x + i for i in range(6)]
    xs[:n] = [x * 5]
    del xs[n:]
    return xs, range(10)[:n], len(range(20)[n::2])


def builtin_slice_object(x, y):
    n = y.shape[0]
    s = slice(1, n)
    return x[s], x[slice(None, None, max(n, 1))], s.stop


class Box:
    def __getitem__(self, key):
        return key.start, key.stop, key.step, isinstance(key, slice)


BOX = Box()


def user_getitem(x, y):
    n = y.shape[0]
    start, stop, step, is_slice = BOX[1:n]
    return x * stop, start, step, is_slice


class Wrapper:
    def __init__(self, t):
        self.t = t

    def __getitem__(self, key):
        return self.t[key]


def user_getitem_delegating(x, y):
    n = y.shape[0]
    return Wrapper(x)[:n] * 2


def print_a_slice(x, y):
    n = y.shape[0]
    print(x[:n].shape, x[n:].numel(), "abcdefghijkl"[:n])
    return x[:n]


@pytest.mark.parametrize("fn", [list_slices, string_slices, shape_slices, list_slice_assignment,
                                builtin_slice_object, user_getitem, user_getitem_delegating, print_a_slice],
                         ids=lambda f: f.__name__)
def test_python_values_sliced_by_a_size(fn):
    run(fn, sized(20))


# --------------------------------------------------------------------------- modules

class ParamSlice(nn.Module):
    """``self.weight[:n]`` with n the input's width; backward and an optimizer step inside."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 3) * 0.3)
        self.bias = nn.Parameter(torch.zeros(16))
        self._opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)  # (not compared: its state is keyed by tensors)

    def forward(self, x, target):
        n = x.shape[1]
        self._opt.zero_grad()
        out = x @ self.weight[:n] + self.bias[-x.shape[0]:].sum()
        loss = ((out - target) ** 2).mean()
        loss.backward()
        self._opt.step()
        return loss.detach(), out.detach()


def param_args(i):
    n = [4, 5, 6, 7, 1, 16, 3, 9, 2, 8][i]
    return A(T(2, n), T(2, 3))


def test_a_parameter_sliced_by_a_size_with_an_optimizer_step():
    summary("ParamSlice", check_module(ParamSlice, param_args, calls=CALLS, atol=1e-6, rtol=1e-5))


class NoGradParamWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 3))

    def forward(self, x):
        n = x.shape[0]
        with torch.no_grad():
            self.weight[:n] *= 0.5
            self.weight[n:] += 0.25
        return x @ self.weight[:n].t()


def test_writes_into_a_parameter_through_a_slice():
    summary("NoGradParamWrite", check_module(NoGradParamWrite, lambda i: A(T(n_of(i) % 17, 3)), calls=CALLS))


class TinyLM(nn.Module):
    """Positional embedding ``self.pe[:, :x.size(1)]`` and a causal mask buffer sliced to the length."""

    def __init__(self, ctx=12, d=8, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pe = nn.Parameter(torch.randn(1, ctx, d) * 0.1)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.ones(ctx, ctx).tril())
        self.d = d

    def forward(self, tok):
        length = tok.size(1)
        h = self.emb(tok) + self.pe[:, :length]
        q, k, v = self.qkv(h).split(self.d, dim=-1)
        att = (q @ k.transpose(-2, -1)) / self.d ** 0.5
        att = att.masked_fill(self.mask[:length, :length] == 0, float("-inf"))
        h = h + att.softmax(-1) @ v
        return self.out(h)[:, -length // 2:]


LM_LENGTHS = [5, 6, 7, 8, 1, 12, 3, 9, 2, 4]


def lm_args(i):
    return A(torch.randint(0, 11, (2, LM_LENGTHS[i])))


def test_positional_embedding_slice_with_grad():
    summary("TinyLM", check_module(TinyLM, lm_args, calls=CALLS, grad=True, atol=1e-5, rtol=1e-5))


def test_positional_embedding_slice_too_long_raises():
    """A sequence longer than the context: ``pe[:, :length]`` is clamped and the add raises, as eager."""
    lengths = [5, 6, 7, 8, 13, 4, 20, 3]
    summary("TinyLM-too-long", check_module(TinyLM, lambda i: A(torch.randint(0, 11, (2, lengths[i]))),
                                            calls=len(lengths), atol=1e-5, rtol=1e-5))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))

    def forward(self, x):
        for layer in self.layers[:min(x.shape[0], 3)]:
            x = layer(x)
        return x


def test_a_module_list_sliced_by_a_size():
    summary("Stack", check_module(Stack, lambda i: A(T(n_of(i) % 6, 3)), calls=CALLS, atol=1e-6, rtol=1e-6))


# --------------------------------------------------------------------------- one graph for every size

@pytest.mark.parametrize("fn, make", [
    (neg_bounds, sized(20)), (steps, sized(20)), (several_dims, sized(12, 12)),
    (inplace_on_clone, sized(20))], ids=lambda v: getattr(v, "__name__", ""))
def test_one_graph_for_every_size(fn, make):
    one_graph(run(fn, make))


def test_one_graph_for_every_trip_count():
    """One graph for every trip count >= 1 (iteration 0 runs in the body: a trip count of 0 is
    the one recompile)."""
    report = run(loop_window, _loop_make(loop_window), atol=1e-6, rtol=1e-6)
    assert report.stats.captures == 2 and not report.fallbacks, report
    assert all(">= 1" in reason for rec in report.recompiles for reason in rec.reasons), report.recompiles
    assert report.graphs[0].loops[0].rolled, report


# --------------------------------------------------------------------------- inductor

@pytest.mark.slow
@pytest.mark.parametrize("fn, make, grad", [
    (neg_bounds, sized(20), False), (several_dims, sized(12, 12), False),
    (grad_through_slices, sized(20, grad=True), True), (inplace_on_clone, sized(20), False)],
    ids=lambda v: getattr(v, "__name__", "") if callable(v) else "")
def test_inductor(fn, make, grad):
    run(fn, make, grad=grad, backend="inductor", atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_inductor_loop():
    run(loop_window, _loop_make(loop_window), backend="inductor", atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_inductor_positional_embedding():
    summary("TinyLM-inductor", check_module(TinyLM, lm_args, calls=CALLS, grad=True, backend="inductor",
                                            atol=1e-5, rtol=1e-5))
