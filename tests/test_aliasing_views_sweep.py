"""Adversarial differential sweep of aliasing, views and in-place ops (docs/semantics.md
"Shadow heap: deferred writes", ``Tracer._functionalize``, ``symbolic/speculation/
view_writes.py``, ``leaf_writes.py``, ``saved_versions.py``, ``symbolic/library/training.py``).

Swept: in-place ops on views of arguments, parameters and buffers (``x[1:].add_``,
``x.view(-1).mul_``, ``x.t().zero_()``, ``x.diagonal().fill_()``, ``as_strided``, ``unfold``,
``expand`` + in-place, which must raise as eager does); in-place ops on whole arguments
(``x[mask] = v``, ``x[idx] += v`` with repeated indices, ``index_add_``, ``scatter_``,
``masked_fill_``, ``clamp_``, ``copy_`` from a broadcast source, random ``normal_``);
``out=`` (into an argument, a view, a tuple, one that must be resized, an empty one); the same
tensor passed twice (``f(x, x)``, ``f(x, x[0])``, ``f(x, x.t())``, lists whose items alias);
a function writing an argument and returning (or storing) a view of it; views taken before a
write and read after it; ``.data`` writes and ``x.data = y``, ``set_``, ``resize_``,
``untyped_storage()``; writes inside rolled loops whose trip count changes per call and under
branches on tensor values; ``requires_grad`` leaves written under ``no_grad``; autograd's
"modified by an inplace operation" error (the exception must be eager's, the heap unchanged);
views of module buffers updated; ``.grad`` written by an in-graph backward.

Every case is differential over ~10 calls (``differential.Pair``: values, gradients with
``grad=True``, arguments / modules after the call, exceptions) and, on top, compares the
*aliasing* both sides leave (``_alias_signature``): for every tensor reachable from the
result, the arguments and the module (and their ``.grad``), which others it shares memory
with, its ``_base``, strides, storage offset and version counter; then it writes into every
returned (or stored) tensor on both sides and compares the arguments again, so a returned view
that eager shares with an argument must be one in the optimized call too. Falling back to eager
is fine; a wrong answer, a different aliasing, an ``internal_error`` or ``backend_error`` record
is a bug, marked ``xfail(strict=True)`` with what goes wrong."""
import sys
import warnings

import pytest
import torch
from torch import nn

from differential import A, T, Mismatch, Pair

CALLS = 10
RTOL, ATOL = 1e-5, 1e-6
NS = [3, 2, 4, 3, 5, 1, 0, 6, 2, 4, 5, 3]  # rolled-loop trip counts, one per call


def sh(i):
    """Rows of call ``i``'s tensors: they change, so sizes become dynamic."""
    return 4 + (i % 3)


def vec(i, grad=False):
    """A (rows, 3) tensor whose sign pattern changes from call to call (branches both ways)."""
    t = T(sh(i), 3) + (0.8 if i % 3 == 0 else -0.8 if i % 3 == 1 else 0.0)
    return t.requires_grad_(grad)


def sq(i):
    return T(sh(i), sh(i))


def n_of(i):
    return NS[i % len(NS)]


# ------------------------------------------------------------------ the aliasing comparison

class Box:
    """A plain object holding tensors (its attributes are compared and written through)."""

    def __init__(self, t):
        self.t = t


def _storage(t):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _collect(value, out, seen):
    if id(value) in seen:
        return
    if isinstance(value, torch.Tensor):
        seen.add(id(value))
        out.append(value)
        if value.is_leaf and value.requires_grad and value.grad is not None:
            _collect(value.grad, out, seen)
    elif isinstance(value, nn.Module):
        seen.add(id(value))
        for t in list(value.parameters()) + list(value.buffers()):
            _collect(t, out, seen)
        for m in value.modules():
            for k, v in vars(m).items():
                if not k.startswith("_"):
                    _collect(v, out, seen)
    elif isinstance(value, (list, tuple)):
        seen.add(id(value))
        for v in value:
            _collect(v, out, seen)
    elif isinstance(value, dict):
        seen.add(id(value))
        for v in value.values():
            _collect(v, out, seen)
    elif isinstance(value, Box):
        seen.add(id(value))
        _collect(vars(value), out, seen)


def _tensors(*roots):
    out, seen = [], set()
    for r in roots:
        _collect(r, out, seen)
    return out


def _alias_signature(tensors):
    """Aliasing facts of ``tensors`` (same order on both sides): who shares memory with whom
    (and at which element offset), ``_base`` (as an index), strides, storage offsets and
    autograd version counters."""
    index = {id(t): i for i, t in enumerate(tensors)}
    rows = []
    for i, t in enumerate(tensors):
        shares = []
        for j, u in enumerate(tensors[:i]):
            if t.numel() and u.numel() and _storage(t) is not None and _storage(t) == _storage(u):
                shares.append((j, (t.data_ptr() - u.data_ptr()) // max(t.element_size(), 1)))
        base = None if t._base is None else index.get(id(t._base), "other")
        version = None if t.is_inference() else t._version
        rows.append((i, tuple(t.stride()), t.storage_offset(), base, version, tuple(shares)))
    return rows


class AliasPair(Pair):
    """``Pair`` that also compares the aliasing both sides leave, then writes into every
    returned or stored tensor on both sides (the arguments and modules are compared after)."""

    write_through = True

    def _make(self, make_args, index, seed):
        made = super()._make(make_args, index, seed)
        self._made = getattr(self, "_made", [])[-1:] + [made]
        return made

    def _compare(self, eager, opt, ids_e, ids_o):
        super()._compare(eager, opt, ids_e, ids_o)
        (args_e, kw_e), (args_o, kw_o) = self._made[-2], self._made[-1]
        roots_e = [self.eager_roots[k] for k in sorted(self.eager_roots)]
        roots_o = [self.opt_roots[k] for k in sorted(self.opt_roots)]
        te = _tensors(eager.value, args_e, kw_e, *roots_e)
        to = _tensors(opt.value, args_o, kw_o, *roots_o)
        se, so = _alias_signature(te), _alias_signature(to)
        if len(se) != len(so):
            raise Mismatch(f"reachable tensors differ: eager {len(se)}, optimized {len(so)}")
        for a, b in zip(se, so):
            if a != b:
                raise Mismatch(f"aliasing differs at tensor #{a[0]} (index, strides, offset, _base, "
                               f"_version, shares-memory-with): eager {a}, optimized {b}")
        if eager.error is not None or not self.write_through or self.grad:
            return
        stored_e = [vars(b) for b in _boxes(args_e)] + [_public(m) for r in roots_e for m in r.modules()]
        stored_o = [vars(b) for b in _boxes(args_o)] + [_public(m) for r in roots_o for m in r.modules()]
        written_e = _tensors(eager.value, *stored_e)
        written_o = _tensors(opt.value, *stored_o)
        for k, (a, b) in enumerate(zip(written_e, written_o)):
            if a.dtype == torch.bool or a.is_inference() or isinstance(a, nn.Parameter) \
                    or a.is_complex():
                continue
            errors = []
            for t in (a, b):
                try:
                    with torch.no_grad():
                        t.detach().add_(100 + k)
                    errors.append(None)
                except RuntimeError as e:
                    errors.append(str(e))
            if errors[0] != errors[1]:
                raise Mismatch(f"writing into returned/stored tensor #{k}: eager {errors[0]!r}, "
                               f"optimized {errors[1]!r}")


def _boxes(args):
    return [a for a in args if isinstance(a, Box)]


def _public(module):
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def _judge(report, name):
    bad = [str(f) for f in report.fallbacks if f.kind in ("internal_error", "backend_error")]
    assert not bad, f"{name}: specularch recorded a bug:\n" + "\n".join(bad) + f"\n{report}"
    kinds = sorted({f.kind for f in report.fallbacks})
    print(f"[sweep] {name}: graphs={len(report.graphs)} hits={report.stats.graph_hits} "
          f"fallback_calls={report.stats.fallback_calls} kinds={kinds}", file=sys.stderr)


def run(fn, make_args, *, grad=False, calls=CALLS, write_through=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # out= resize deprecation warnings, both sides
        pair = AliasPair.of_function(fn, atol=ATOL, rtol=RTOL, grad=grad)
        pair.write_through = write_through
        for _ in range(calls):
            pair.step(make_args)
    _judge(pair.explain(), fn.__name__)


def run_module(make_module, make_args, *, grad=False, calls=CALLS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pair = AliasPair.of_module(make_module, atol=ATOL, rtol=RTOL, grad=grad)
        for _ in range(calls):
            pair.step(make_args)
    _judge(pair.explain(), make_module.__name__)


# ------------------------------------------------------------------ in-place ops through views of arguments

def slice_add_(x):
    x[1:].add_(1)
    return x * 2


def view_mul_(x):
    x.view(-1).mul_(2)
    return x.sum()


def t_zero_(x):
    x.t().zero_()
    return x


def diagonal_fill_(x, v):
    x.diagonal().fill_(v)
    return x + 0


def unsqueeze_then_squeeze_(x):
    y = x.unsqueeze(0)
    y.squeeze_(0)
    return y


def narrow_copy_(x, r):
    x.narrow(0, 1, 2).copy_(r.expand(2, 3))
    return x


def select_fill_(x):
    x.select(1, 0).fill_(-1.0)
    return x.sum(0)


def as_strided_write(x):
    x.as_strided((2, 2), (1, 3)).mul_(0)
    return x


def expand_then_add_(x):
    x[0:1].expand(3, 3).add_(1)  # eager raises: overlapping memory
    return x


def expand_of_new_then_add_(x):
    y = x.clone()[0:1].expand(3, 3)
    y.add_(1)  # eager raises as well
    return y


def unfold_write(x):
    x.view(-1).unfold(0, 2, 1).add_(1)  # overlapping windows: eager raises
    return x


def detach_write(x):
    x.detach().add_(1)
    return x


def rows_copy_broadcast(x, r):
    x[0].copy_(r[0])
    x[1:3].copy_(r.expand(2, -1) * 2)
    return x


def write_through_view_then_return_it(x):
    v = x[0]
    v.zero_()
    return v


def column_iadd(x):
    x[:, 1] += 1  # BINARY_SUBSCR, iadd on the view, STORE_SUBSCR
    return x


def ellipsis_imul(x):
    x[..., -1] *= 2
    return x.sum()


def normal_into_view(x):
    x[1:].normal_()
    return x


def real_view_write(x):
    torch.view_as_real(x).mul_(2)
    return x


VIEW_WRITES = {
    "slice_add_": (slice_add_, lambda i: A(vec(i))),
    "view_mul_": (view_mul_, lambda i: A(vec(i))),
    "t_zero_": (t_zero_, lambda i: A(vec(i))),
    "diagonal_fill_": (diagonal_fill_, lambda i: A(sq(i), float(i) - 3.5)),
    "unsqueeze_then_squeeze_": (unsqueeze_then_squeeze_, lambda i: A(vec(i))),
    "narrow_copy_": (narrow_copy_, lambda i: A(vec(i), T(1, 3))),
    "select_fill_": (select_fill_, lambda i: A(vec(i))),
    "as_strided_write": (as_strided_write, lambda i: A(vec(i))),
    "expand_then_add_": (expand_then_add_, lambda i: A(vec(i))),
    "expand_of_new_then_add_": (expand_of_new_then_add_, lambda i: A(vec(i))),
    "unfold_write": (unfold_write, lambda i: A(vec(i))),
    "detach_write": (detach_write, lambda i: A(vec(i))),
    "rows_copy_broadcast": (rows_copy_broadcast, lambda i: A(vec(i), T(1, 3))),
    "write_through_view_then_return_it": (write_through_view_then_return_it, lambda i: A(vec(i))),
    "column_iadd": (column_iadd, lambda i: A(vec(i))),
    "ellipsis_imul": (ellipsis_imul, lambda i: A(vec(i))),
    "normal_into_view": (normal_into_view, lambda i: A(vec(i))),
    "real_view_write": (real_view_write, lambda i: A(T(sh(i), 2, dtype=torch.complex64))),
}


@pytest.mark.parametrize("name", sorted(VIEW_WRITES))
def test_in_place_through_a_view_of_an_argument(name):
    run(*VIEW_WRITES[name])


# ------------------------------------------------------------------ in-place ops on whole arguments

def mask_assign(x, m, v):
    x[m] = v
    return x.sum(0)


def index_iadd_repeated(x, idx):
    x[idx] += 1  # repeated indices: eager adds once per distinct index
    return x


def index_put_accumulate(x, idx, v):
    x.index_put_((idx,), v, accumulate=True)
    return x


def index_add_(x, idx, s):
    x.index_add_(0, idx, s)
    return x.clone()


def scatter_(x, idx, s):
    x.scatter_(0, idx, s)
    return x


def scatter_add_(x, idx, s):
    x.scatter_add_(0, idx, s)
    return x.sum()


def masked_fill_(x, m):
    x.masked_fill_(m, -1.0)
    return x.mean()


def clamp_(x, lo):
    x.clamp_(min=lo)
    return x


def copy_broadcast(x, r):
    x.copy_(r)
    return x


def copy_transposed(x, y):
    x.copy_(y.t())
    return x.sum(1)


def iadd_whole(x, y):
    x += y
    return x


def sub_own_mean(x):
    x.sub_(x.mean(0))
    return x


def addcmul_(x, y):
    x.addcmul_(y, y, value=0.5)
    return x


def lerp_(x, y, w):
    x.lerp_(y, w)
    return x


def tril_(x):
    x.tril_()
    return x.sum()


def slice_assign(x, v):
    x[1:] = v
    return x


def normal_whole(x):
    x.normal_()
    return x + 1


def chained_inplace_then_return_argument(x):
    x.mul_(2).add_(1).clamp_(max=3.0)
    return x


def noncontiguous_argument_written(x):
    x.add_(1)
    return x


def expanded_argument_written(x):
    x.add_(1)  # eager raises: overlapping memory
    return x


def copy_from_own_flip(x):
    x.copy_(x.flip(0))
    return x


def index_assign_swapping_rows(x):
    x[[0, 1]] = x[[1, 0]]
    return x


def int_ifloordiv(x):
    x //= 2
    return x


def bool_iand(x, m):
    x &= m
    return x


def zero_dim_counter(step, x):
    step += 1
    return x * step, step


def unbound_method_add_(x):
    torch.Tensor.add_(x, 1)
    return x


def operator_iadd(x):
    import operator
    operator.iadd(x, 2)
    return x


def fill_from_0d_tensor(x, v):
    x.fill_(v)
    return x


def zero_return_twice(x):
    x.zero_()
    return x, x


def write_in_inference_mode(x):
    with torch.inference_mode():
        x.add_(1)
    return x


def write_then_item(x):
    x.add_(1)
    return x.sum().item()


WHOLE_WRITES = {
    "mask_assign": (mask_assign, lambda i: (lambda x: A(x, x > 0, float(i)))(vec(i))),
    "index_iadd_repeated": (index_iadd_repeated, lambda i: A(vec(i), torch.tensor([0, 1, 1, 0, i % 3]))),
    "index_put_accumulate": (index_put_accumulate,
                             lambda i: A(vec(i), torch.tensor([0, 2, 2, 1, 2]), T(5, 3))),
    "index_add_": (index_add_, lambda i: A(vec(i), torch.tensor([0, 2, 2, i % sh(i)]), T(4, 3))),
    "scatter_": (scatter_, lambda i: A(vec(i), torch.stack([torch.randperm(sh(i))[:3] for _ in range(2)]),
                                       T(2, 3))),
    "scatter_add_": (scatter_add_, lambda i: A(vec(i), torch.randint(0, sh(i), (3, 3)), T(3, 3))),
    "masked_fill_": (masked_fill_, lambda i: A(vec(i), vec(i) > 0.3)),
    "clamp_": (clamp_, lambda i: A(vec(i), float(i % 3) - 1)),
    "copy_broadcast": (copy_broadcast, lambda i: A(vec(i), T(1, 3))),
    "copy_transposed": (copy_transposed, lambda i: A(sq(i), sq(i))),
    "iadd_whole": (iadd_whole, lambda i: A(vec(i), T(3))),
    "sub_own_mean": (sub_own_mean, lambda i: A(vec(i))),
    "addcmul_": (addcmul_, lambda i: A(vec(i), vec(i))),
    "lerp_": (lerp_, lambda i: A(vec(i), vec(i), 0.1 * i)),
    "tril_": (tril_, lambda i: A(sq(i))),
    "slice_assign": (slice_assign, lambda i: A(vec(i), float(i))),
    "normal_whole": (normal_whole, lambda i: A(vec(i))),
    "chained_inplace_then_return_argument": (chained_inplace_then_return_argument, lambda i: A(vec(i))),
    "noncontiguous_argument_written": (noncontiguous_argument_written, lambda i: A(T(3, sh(i)).t())),
    "expanded_argument_written": (expanded_argument_written, lambda i: A(T(3).expand(sh(i), 3))),
    "copy_from_own_flip": (copy_from_own_flip, lambda i: A(vec(i))),
    "index_assign_swapping_rows": (index_assign_swapping_rows, lambda i: A(vec(i))),
    "int_ifloordiv": (int_ifloordiv, lambda i: A(T(sh(i), dtype=torch.long, low=-9, high=9))),
    "bool_iand": (bool_iand, lambda i: A(T(sh(i), dtype=torch.bool), T(sh(i), dtype=torch.bool))),
    "zero_dim_counter": (zero_dim_counter, lambda i: A(torch.tensor(i), vec(i))),
    "unbound_method_add_": (unbound_method_add_, lambda i: A(vec(i))),
    "operator_iadd": (operator_iadd, lambda i: A(vec(i))),
    "fill_from_0d_tensor": (fill_from_0d_tensor, lambda i: A(vec(i), torch.tensor(float(i)))),
    "zero_return_twice": (zero_return_twice, lambda i: A(vec(i))),
    "write_in_inference_mode": (write_in_inference_mode, lambda i: A(vec(i))),
    "write_then_item": (write_then_item, lambda i: A(vec(i))),
}


@pytest.mark.parametrize("name", sorted(WHOLE_WRITES))
def test_in_place_on_a_whole_argument(name):
    run(*WHOLE_WRITES[name])


# ------------------------------------------------------------------ out=

def out_into_argument(a, b, c):
    torch.add(a, b, out=c)
    return c


def out_result_is_out(a, b, c):
    r = torch.add(a, b, out=c)
    return r, r is c


def out_into_view_of_argument(a, b, c):
    torch.mul(a, b, out=c[0])
    return c


def out_into_new_empty(a, b):
    c = torch.empty(0)
    torch.add(a, b, out=c)
    return c


def out_into_view_of_new(a):
    c = torch.zeros(2, a.shape[0], 3)
    torch.sigmoid(a, out=c[1])
    return c


def out_mm(a, b, c):
    torch.mm(a, b.t(), out=c)
    return c.sum()


def out_is_an_input(a, b):
    torch.add(a, b, out=a)
    return a


def out_sum_dim(a, c):
    torch.sum(a, 0, out=c)
    return c


def out_tuple(a, v, i):
    torch.max(a, 1, out=(v, i))
    return v, i


def out_wrong_dtype(a, c):
    torch.add(a, a, out=c)  # float into long: eager raises
    return c


def out_resizes_argument(a, b, c):
    torch.add(a, b, out=c)  # c is (2, 3): resized (deprecated, still eager's behaviour)
    return c * 2


def out_into_empty_argument(a, c):
    torch.add(a, 1, out=c)
    return c


def out_into_empty_argument_read_before(a, c):
    m = c.numel()  # 0: c is empty when the call starts
    torch.mul(a, 2, out=c)
    return c + m


def out_cat_into_empty_argument(a, c):
    torch.cat([a, a], out=c)
    return c.sum()


def out_into_empty_argument_then_branch(a, c):
    torch.add(a, 1, out=c)
    if c.shape[0] > 4:
        return c * 2
    return c


def out_into_empty_view_of_argument(a, d):
    torch.add(a, 1, out=d[:0])  # resizes the view over d's memory
    return d


def out_into_empty_view_reading_the_written_row(d):
    torch.mul(d[0], 2, out=d[:0])  # d[0] = 2 * d[0], through a view resized over d's memory
    return d[0].clone()


OUT = {
    "out_into_argument": (out_into_argument, lambda i: A(vec(i), vec(i), torch.full((sh(i), 3), 7.0))),
    "out_result_is_out": (out_result_is_out, lambda i: A(vec(i), vec(i), torch.full((sh(i), 3), 7.0))),
    "out_into_view_of_argument": (out_into_view_of_argument, lambda i: A(T(3), T(3), torch.zeros(2, 3))),
    "out_into_new_empty": (out_into_new_empty, lambda i: A(vec(i), vec(i))),
    "out_into_view_of_new": (out_into_view_of_new, lambda i: A(vec(i))),
    "out_mm": (out_mm, lambda i: A(T(sh(i), 3), T(5, 3), torch.full((sh(i), 5), 7.0))),
    "out_is_an_input": (out_is_an_input, lambda i: A(vec(i), vec(i))),
    "out_sum_dim": (out_sum_dim, lambda i: A(vec(i), torch.full((3,), 7.0))),
    "out_tuple": (out_tuple, lambda i: A(vec(i), torch.zeros(sh(i)), torch.zeros(sh(i), dtype=torch.long))),
    "out_wrong_dtype": (out_wrong_dtype, lambda i: A(vec(i), torch.zeros(sh(i), 3, dtype=torch.long))),
    "out_resizes_argument": (out_resizes_argument, lambda i: A(vec(i), vec(i), torch.zeros(2, 3))),
    "out_into_empty_argument": (out_into_empty_argument, lambda i: A(vec(i), torch.zeros(0))),
    "out_into_empty_argument_static": (out_into_empty_argument, lambda i: A(T(4, 3), torch.zeros(0))),
    "out_into_empty_argument_read_before": (out_into_empty_argument_read_before,
                                            lambda i: A(vec(i), torch.zeros(0))),
    "out_cat_into_empty_argument": (out_cat_into_empty_argument, lambda i: A(vec(i), torch.zeros(0))),
    "out_into_empty_argument_then_branch": (out_into_empty_argument_then_branch,
                                            lambda i: A(vec(i), torch.zeros(0))),
    "out_into_empty_view_of_argument": (out_into_empty_view_of_argument, lambda i: A(T(3), torch.zeros(4, 3))),
    "out_into_empty_view_reading_the_written_row": (out_into_empty_view_reading_the_written_row,
                                                    lambda i: A(T(4, 3))),
}

OUT_XFAIL: dict = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=OUT_XFAIL[n])]
                                               if n in OUT_XFAIL else []) for n in sorted(OUT)])
def test_out_argument(name):
    run(*OUT[name])


# ------------------------------------------------------------------ the same tensor passed twice

def write_first(x, y):
    x.add_(y)
    return x


def iadd_first(x, y):
    x += y
    return x


def mul_first(x, r):
    x.mul_(r)
    return x


def write_second_return_first(x, y):
    y.mul_(2)
    return x + 1


def copy_second_into_first(x, y):
    x.copy_(y * 2)
    return y.sum()


def out_first(x, y):
    torch.add(x, y, out=x)
    return x


def write_both(x, y):
    x.add_(1)
    y.mul_(2)
    return x - y


def _same(i):
    x = vec(i)
    return A(x, x)


def _maybe_same(i):
    x = vec(i)
    return A(x, x if i % 2 else x.clone())


def _row(i):
    x = vec(i)
    return A(x, x[0])


def _maybe_row(i):
    x = vec(i)
    return A(x, x[1:] if i % 2 else x.clone()[1:])


def _transposed(i):
    x = sq(i)
    return A(x, x.t())


def _flat(i):
    x = vec(i)
    return A(x.view(-1), x)


def write_through_list_item(x, lst):
    lst[0].mul_(2)
    return x + 0


def write_argument_read_attribute(x, box):
    x.add_(1)
    return box.t.sum()


def write_attribute_return_argument(x, box):
    box.t.mul_(2)
    return x + 0


def write_attribute_store_view(x, box):
    box.t.mul_(2)
    box.v = box.t[0]
    return x + 0


def _box_alias(i):
    x = T(4, 3)
    return A(x, Box(x if i % 2 else (x[0] if i % 3 else x.clone())))


TWICE = {
    "write_first_same": (write_first, _same),
    "write_first_maybe_same": (write_first, _maybe_same),
    "write_first_transposed": (write_first, _transposed),
    "iadd_first_same": (iadd_first, _same),
    "mul_first_row": (mul_first, _row),
    "write_second_same": (write_second_return_first, _same),
    "write_second_row": (write_second_return_first, _row),
    "write_second_maybe_row": (write_second_return_first, _maybe_row),
    "copy_second_into_first_same": (copy_second_into_first, _same),
    "copy_second_into_first_transposed": (copy_second_into_first, _transposed),
    "out_first_transposed": (out_first, _transposed),
    "write_both_same": (write_both, _same),
    "write_both_flat_view": (write_both, _flat),
    "write_both_maybe_same": (write_both, _maybe_same),
    "write_through_list_item_same": (write_through_list_item, lambda i: (lambda x: A(x, [x]))(vec(i))),
    "write_through_list_item_row": (write_through_list_item, lambda i: (lambda x: A(x, [x[0]]))(vec(i))),
    "write_argument_read_attribute": (write_argument_read_attribute, _box_alias),
    "write_attribute_return_argument": (write_attribute_return_argument, _box_alias),
    "write_attribute_store_view": (write_attribute_store_view, lambda i: A(T(3), Box(T(4, 3)))),
}
TWICE_XFAIL: dict = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=TWICE_XFAIL[n])]
                                               if n in TWICE_XFAIL else []) for n in sorted(TWICE)])
def test_same_tensor_passed_twice(name):
    run(*TWICE[name])


# ------------------------------------------------------------------ returned views and views across writes

def write_return_slice(x):
    x.mul_(2)
    return x[1:]


def write_return_t(x):
    x.add_(1)
    return x.t()


def write_return_flat_and_reshape(x):
    x.sub_(1)
    return x.view(-1), x.reshape(x.shape[0], 3)


def return_view_of_add_(x):
    return x.add_(1)[0]


def setitem_return_row(x):
    x[0] = 5.0
    return x[0]


def write_return_rows_in_list(x):
    x.mul_(3)
    return [x[0], x[1]]


def write_return_view_in_dict(x):
    x.clamp_(-1, 1)
    return {"v": x.view(-1)}


def two_args_written_views_returned(x, y):
    x.add_(1)
    y.mul_(2)
    return x[0], y[1:]


def write_then_store_view(x, log):
    x.mul_(2)
    log.append(x[0])
    return x.sum()


def return_add_(x):
    return x.add_(1)


def return_chained_inplace(x):
    return x.mul_(2).add_(1).clamp_(max=3.0)


def return_chained_two(x):
    return x.mul_(2).add_(1)


def offset_argument_written_return_flat(x):
    x.mul_(2)
    return x.reshape(-1)


def return_arg_and_views(x):
    return x, x[0], x.view(-1)


def return_views_no_write(x):
    return x[1:], x.t(), x.diagonal(), x.unsqueeze(0), x.expand(2, -1, -1)


def return_narrow_select_unbind_chunk(x):
    return x.narrow(0, 1, 2), x.select(1, 0), x.unbind(0)[0], x.chunk(2)[1]


def return_split(x):
    return x.split(2)


def return_dtype_views(x):
    return torch.view_as_complex(x[:, :2].contiguous()), x.view(torch.int32)


def return_as_strided(x):
    return x.as_strided((2, 2), (1, 3))


def view_of_new_then_write_base(x):
    y = x * 2
    v = y[1:]
    y.add_(1)
    return v, y


def write_view_of_new_return_base(x):
    y = x * 2
    v = y[1:]
    v.mul_(10)
    return y


def write_then_write_a_view(x):
    x.mul_(2)
    x[0].add_(1)
    return x.sum()


def write_then_write_and_return_a_view(x):
    x.mul_(2)
    v = x[1:]
    v.add_(1)
    return v.sum(), x


def view_before_write_returned(x):
    v = x[0]
    x.mul_(2)
    return v


def view_before_write_read(x):
    v = x[0]
    x.mul_(2)
    return v * 1


def transposed_view_before_write(x):
    v = x.t()
    x.add_(3)
    return v.sum(0), v


def flat_view_before_write_summed(x):
    v = x.view(-1)
    x.add_(1)
    return v.sum()


def view_before_write_dead(x):
    s = x[0].sum()  # read before the write only
    x.mul_(2)
    return s, x


RETURNED = {
    "write_return_slice": (write_return_slice, lambda i: A(vec(i))),
    "write_return_t": (write_return_t, lambda i: A(vec(i))),
    "write_return_flat_and_reshape": (write_return_flat_and_reshape, lambda i: A(vec(i))),
    "return_view_of_add_": (return_view_of_add_, lambda i: A(vec(i))),
    "setitem_return_row": (setitem_return_row, lambda i: A(vec(i))),
    "write_return_rows_in_list": (write_return_rows_in_list, lambda i: A(vec(i))),
    "write_return_view_in_dict": (write_return_view_in_dict, lambda i: A(vec(i))),
    "two_args_written_views_returned": (two_args_written_views_returned, lambda i: A(vec(i), vec(i))),
    "write_then_store_view": (write_then_store_view, lambda i: A(vec(i), [])),
    "offset_argument_written_return_flat": (offset_argument_written_return_flat,
                                            lambda i: A(T(sh(i) + 1, 3)[1:])),
    "return_add_": (return_add_, lambda i: A(vec(i))),
    "return_chained_inplace": (return_chained_inplace, lambda i: A(vec(i))),
    "return_chained_two": (return_chained_two, lambda i: A(vec(i))),
    "return_arg_and_views": (return_arg_and_views, lambda i: A(vec(i))),
    "return_views_no_write": (return_views_no_write, lambda i: A(vec(i))),
    "return_narrow_select_unbind_chunk": (return_narrow_select_unbind_chunk, lambda i: A(vec(i))),
    "return_split": (return_split, lambda i: A(vec(i))),
    "return_dtype_views": (return_dtype_views, lambda i: A(vec(i))),
    "return_as_strided": (return_as_strided, lambda i: A(vec(i))),
    "view_of_new_then_write_base": (view_of_new_then_write_base, lambda i: A(vec(i))),
    "write_view_of_new_return_base": (write_view_of_new_return_base, lambda i: A(vec(i))),
    "write_then_write_a_view": (write_then_write_a_view, lambda i: A(vec(i))),
    "write_then_write_and_return_a_view": (write_then_write_and_return_a_view, lambda i: A(vec(i))),
    "view_before_write_returned": (view_before_write_returned, lambda i: A(vec(i))),
    "view_before_write_read": (view_before_write_read, lambda i: A(vec(i))),
    "transposed_view_before_write": (transposed_view_before_write, lambda i: A(vec(i))),
    "flat_view_before_write_summed": (flat_view_before_write_summed, lambda i: A(vec(i))),
    "view_before_write_dead": (view_before_write_dead, lambda i: A(vec(i))),
}

RETURNED_XFAIL: dict = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=RETURNED_XFAIL[n])]
                                               if n in RETURNED_XFAIL else []) for n in sorted(RETURNED)])
def test_views_returned_and_views_across_writes(name):
    run(*RETURNED[name])


# ------------------------------------------------------------------ .data, set_, resize_, storage

def data_mul_(x):
    x.data.mul_(2)
    return x + 1


def data_write_return_data(x):
    x.data.add_(1)
    return x.data


def data_assign(x, y):
    x.data = y
    return x * 1


def data_assign_view(x):
    x.data = x.data[1:]
    return x


def set_on_argument(x, y):
    x.set_(y)
    return x


def set_on_empty_argument(c, y):
    c.set_(y)
    return c + 1


def resize_argument(x):
    x.resize_(2, 3)
    return x


def unsqueeze_on_empty_argument(c):
    c.unsqueeze_(0)
    return c.shape


def storage_shared_tensor_written(x):
    y = torch.empty(0).set_(x.untyped_storage(), 0, x.shape, x.stride())
    y.add_(1)
    return x


def return_views_of_leaf(x):
    return x[1:], x.t()


def t_on_new_tensor(x):
    y = x * 2
    y.t_()
    return y, y.is_contiguous()


def detach_on_new_tensor(x):
    y = x * 2
    y.detach_()
    return y


def data_write_leaf_then_use(x):
    x.data.mul_(0.5)
    return (x * x).sum()


DATA = {
    "data_mul_": (data_mul_, lambda i: A(vec(i)), False),
    "data_write_return_data": (data_write_return_data, lambda i: A(vec(i)), False),
    "return_views_of_leaf": (return_views_of_leaf, lambda i: A(vec(i, grad=True)), True),
    "data_assign": (data_assign, lambda i: A(vec(i), T(sh(i) + 1, 3)), False),
    "data_assign_view": (data_assign_view, lambda i: A(vec(i)), False),
    "set_on_argument": (set_on_argument, lambda i: A(vec(i), T(sh(i) + 1, 2)), False),
    "set_on_empty_argument": (set_on_empty_argument, lambda i: A(torch.zeros(0), vec(i)), False),
    "resize_argument": (resize_argument, lambda i: A(vec(i)), False),
    "unsqueeze_on_empty_argument": (unsqueeze_on_empty_argument, lambda i: A(torch.zeros(0)), False),
    "storage_shared_tensor_written": (storage_shared_tensor_written, lambda i: A(vec(i)), False),
    "t_on_new_tensor": (t_on_new_tensor, lambda i: A(vec(i)), False),
    "detach_on_new_tensor": (detach_on_new_tensor, lambda i: A(vec(i, grad=True)), False),
    "data_write_leaf_then_use": (data_write_leaf_then_use, lambda i: A(vec(i, grad=True)), True),
}


_DATA_AFTER_WRITE = ("`x.data` read after a deferred write through `x.data` is `.data` of the "
                     "graph's copy: the returned tensor does not share x's memory (eager's does)")
DATA_XFAIL = {"data_write_return_data": _DATA_AFTER_WRITE}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=DATA_XFAIL[n])]
                                               if n in DATA_XFAIL else []) for n in sorted(DATA)])
def test_data_set_resize_storage(name):
    fn, make, grad = DATA[name]
    run(fn, make, grad=grad)


# ------------------------------------------------------------------ autograd: leaves, saved tensors, .grad

def leaf_add_(x):
    x.add_(1)  # eager raises: a leaf that requires grad used in an in-place op
    return x


def leaf_add_no_grad(x):
    with torch.no_grad():
        x.add_(1)
    return x * 2


def leaf_view_zero_no_grad(x):
    with torch.no_grad():
        x[0].zero_()
    return x * 2


def leaf_setitem_no_grad(x, v):
    with torch.no_grad():
        x[1:] = v
    return (x * x).sum()


def view_of_leaf_write(x):
    y = x[0]
    y.mul_(2)  # eager raises
    return y


def nonleaf_view_writes(x):
    h = x * 2
    h[0].mul_(3)
    h[:, 1] += 1
    return h


def nonleaf_transposed_view_write(x):
    h = x + 0
    h.t()[0].sub_(1)
    return h.sum(0)


def nonleaf_write_returned_view(x):
    h = x * 2
    h.add_(1)
    return h[1:], h


def saved_output_written_backward(x, y):
    w = (x * 1).exp()
    w.mul_(2)  # exp saved its output: the backward raises, naming versions
    (w * y).sum().backward()
    return x.grad


def saved_argument_written_backward(x, w):
    y = w * x
    with torch.no_grad():
        x.add_(1)
    y.sum().backward()
    return w.grad


def saved_argument_written_twice_backward(x, w):
    y = (w * x).sum()
    with torch.no_grad():
        x.add_(1)
        x.mul_(2)
    y.backward()
    return w.grad


def saved_view_written_backward(x, w):
    y = (w * x[0]).sum()
    x.mul_(2)
    y.backward()
    return w.grad


def written_under_flag_backward(x, w, flag):
    y = (w * x).sum()
    if flag:
        with torch.no_grad():
            x.add_(1)
    y.backward()
    return w.grad


def written_under_tensor_branch_backward(x, w):
    y = (w * x).sum()
    if x.sum() > 0:
        with torch.no_grad():
            x.add_(1)
    y.backward()
    return w.grad


def unsaved_argument_written_backward(x, w):
    y = (w * 3 + x).sum()  # add saves nothing of x
    with torch.no_grad():
        x.add_(1)
    y.backward()
    return w.grad, x


def grad_of_a_plain_sum(x, w):
    (w + x).sum().backward()  # autograd's gradient of w: an expanded tensor of ones
    return w.grad


def grads_of_a_sum_of_two_leaves(a, b):
    ((a + b) ** 2).sum().backward()  # AddBackward hands the same tensor to a and b
    return a.grad, b.grad, a.grad is b.grad


def clip_grads_of_a_sum_of_two_leaves(a, b):
    ((a + b) ** 2).sum().backward()
    torch.nn.utils.clip_grad_norm_([a, b], 1.0)  # scales each .grad in place
    return a.grad.sum().item(), b.grad.sum().item()


def grad_of_a_transposed_product(a, b):
    (a.t() * b).sum().backward()  # the gradient of a is b.t(): not contiguous
    return a.grad


AUTOGRAD = {
    "leaf_add_": (leaf_add_, lambda i: A(vec(i, grad=True)), False),
    "leaf_add_no_grad": (leaf_add_no_grad, lambda i: A(vec(i, grad=True)), True),
    "leaf_view_zero_no_grad": (leaf_view_zero_no_grad, lambda i: A(vec(i, grad=True)), True),
    "leaf_setitem_no_grad": (leaf_setitem_no_grad, lambda i: A(vec(i, grad=True), float(i)), True),
    "view_of_leaf_write": (view_of_leaf_write, lambda i: A(vec(i, grad=True)), False),
    "nonleaf_view_writes": (nonleaf_view_writes, lambda i: A(vec(i, grad=True)), True),
    "nonleaf_transposed_view_write": (nonleaf_transposed_view_write, lambda i: A(vec(i, grad=True)), True),
    "nonleaf_write_returned_view": (nonleaf_write_returned_view, lambda i: A(vec(i, grad=True)), True),
    "saved_output_written_backward": (saved_output_written_backward,
                                      lambda i: A(vec(i, grad=True), vec(i)), False),
    "saved_argument_written_backward": (saved_argument_written_backward,
                                        lambda i: A(vec(i), vec(i, grad=True)), False),
    "saved_argument_written_twice_backward": (saved_argument_written_twice_backward,
                                              lambda i: A(vec(i), vec(i, grad=True)), False),
    "saved_view_written_backward": (saved_view_written_backward,
                                    lambda i: A(vec(i), T(3, requires_grad=True)), False),
    "written_under_flag_backward": (written_under_flag_backward,
                                    lambda i: A(vec(i), vec(i, grad=True), i % 3 == 0), False),
    "written_under_tensor_branch_backward": (written_under_tensor_branch_backward,
                                             lambda i: A(vec(i), vec(i, grad=True)), False),
    "unsaved_argument_written_backward": (unsaved_argument_written_backward,
                                          lambda i: A(vec(i), vec(i, grad=True)), False),
    "grad_of_a_plain_sum": (grad_of_a_plain_sum, lambda i: A(vec(i), vec(i, grad=True)), False),
    "grad_of_a_transposed_product": (grad_of_a_transposed_product,
                                     lambda i: A(vec(i, grad=True), T(3, sh(i))), False),
    "grads_of_a_sum_of_two_leaves": (grads_of_a_sum_of_two_leaves,
                                     lambda i: A(vec(i, grad=True), vec(i, grad=True)), False),
    "clip_grads_of_a_sum_of_two_leaves": (clip_grads_of_a_sum_of_two_leaves,
                                          lambda i: A(vec(i, grad=True), vec(i, grad=True)), False),
}

AUTOGRAD_XFAIL: dict = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=AUTOGRAD_XFAIL[n])]
                                               if n in AUTOGRAD_XFAIL else []) for n in sorted(AUTOGRAD)])
def test_autograd_and_in_place(name):
    fn, make, grad = AUTOGRAD[name]
    run(fn, make, grad=grad)


# ------------------------------------------------------------------ rolled loops, tensor branches, aliasing lists

def loop_writes_rows(x, n):
    for t in range(n):
        x[t] = x[t] * 2 + t
    return x.sum()


def loop_iadd_rows_return_view(x, n):
    for t in range(n):
        x[t] += 1
    return x[:n]


def loop_whole_writes_then_view(x, n):
    for t in range(n):
        x.mul_(1.5)
    return x[0], x


def loop_writes_collecting_views(x, n):
    out = []
    for t in range(n):
        x.add_(1)
        out.append(x[t % 2])
    return out


def loop_views_of_new_before_writes(x, n):
    z = x.clone()
    vs = []
    for t in range(n):
        v = z[t]
        z.add_(1)
        vs.append(v)
    return vs, z


def loop_index_add_(x, idx, n):
    for t in range(n):
        x.index_add_(0, idx, x[:2] * 0.5)
    return x


def branch_writes_argument(x):
    if x.sum() > 0:
        x.mul_(2)
    else:
        x.add_(1)
    return x


def branch_write_return_view(x):
    if x.mean() > 0:
        x.neg_()
    return x[0]


def branch_after_new_view(x):
    y = x * 1
    v = y[1:]
    if x.sum() > 0:
        y.add_(1)
    return v


def branch_selects_write_target(x, y):
    t = x if x.sum() > y.sum() else y
    t.mul_(2)
    return x + y


def list_write_first_read_second(ts):
    ts[0].add_(1)
    return ts[1] * 2


def list_write_each(ts):
    for t in ts:
        t.mul_(2)
    return ts


def list_write_first_return_second(ts):
    ts[0].add_(1)
    return ts[1]


def _list_maybe_same(i):
    x = vec(i)
    return A([x, x] if i % 2 else [x, x.clone()])


def _list_maybe_row(i):
    x = vec(i)
    return A([x, x[0]] if i % 2 == 0 else [x, x.clone()[0]])


def dict_items_alias(d):
    d["a"].sub_(1)
    return d["b"] + 0


LOOPS = {
    "loop_writes_rows": (loop_writes_rows, lambda i: A(T(8, 3), n_of(i))),
    "loop_iadd_rows_return_view": (loop_iadd_rows_return_view, lambda i: A(T(8, 3), n_of(i))),
    "loop_whole_writes_then_view": (loop_whole_writes_then_view, lambda i: A(T(8, 3), n_of(i))),
    "loop_writes_collecting_views": (loop_writes_collecting_views, lambda i: A(T(8, 3), n_of(i))),
    "loop_views_of_new_before_writes": (loop_views_of_new_before_writes, lambda i: A(T(8, 3), n_of(i))),
    "loop_index_add_": (loop_index_add_, lambda i: A(T(8, 3), torch.tensor([1, 1]), n_of(i))),
    "branch_writes_argument": (branch_writes_argument, lambda i: A(vec(i))),
    "branch_write_return_view": (branch_write_return_view, lambda i: A(vec(i))),
    "branch_after_new_view": (branch_after_new_view, lambda i: A(vec(i))),
    "branch_selects_write_target": (branch_selects_write_target, lambda i: A(vec(i), vec(i + 1))),
    "list_write_first_read_second_same": (list_write_first_read_second, _list_maybe_same),
    "list_write_each_same": (list_write_each, _list_maybe_same),
    "list_write_first_return_second_same": (list_write_first_return_second, _list_maybe_same),
    "list_write_first_read_second_row": (list_write_first_read_second, _list_maybe_row),
    "list_write_first_return_second_row": (list_write_first_return_second, _list_maybe_row),
    "dict_items_alias": (dict_items_alias, lambda i: (lambda x: A({"a": x, "b": x if i % 2 else x[1:]}))(vec(i))),
}

LOOPS_XFAIL = {
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=LOOPS_XFAIL[n])]
                                               if n in LOOPS_XFAIL else []) for n in sorted(LOOPS)])
def test_loops_branches_and_aliasing_containers(name):
    run(*LOOPS[name])


# ------------------------------------------------------------------ an op raising after writes (eager's partial writes)

def write_then_gather(x, idx):
    x.mul_(2)
    return x[idx]  # out of range in calls 6 and 9: the graph raises, eager has written x once


def write_then_index_select(x, idx):
    x.add_(1)
    return torch.index_select(x, 0, idx)


def write_two_then_raise(x, y, idx):
    x.add_(1)
    y.mul_(3)
    return y[idx] + x[0]


def write_then_tensor_branch(x):
    x.mul_(2)
    if x.sum() > 0:
        return x + 1
    return x - 1


def write_then_item_branch(x, y):
    y.add_(1)
    if x.sum().item() > 0:
        y.mul_(2)
    return y


def _bad_index(i):
    return torch.tensor([0, 9 if i in (5, 8) else 1])


RAISING = {
    "write_then_gather": (write_then_gather, lambda i: A(vec(i), _bad_index(i))),
    "write_then_index_select": (write_then_index_select, lambda i: A(vec(i), _bad_index(i))),
    "write_two_then_raise": (write_two_then_raise, lambda i: A(vec(i), vec(i), _bad_index(i))),
    "write_then_tensor_branch": (write_then_tensor_branch, lambda i: A(vec(i))),
    "write_then_item_branch": (write_then_item_branch, lambda i: A(vec(i), vec(i))),
}


@pytest.mark.parametrize("name", sorted(RAISING))
def test_writes_then_a_raise_or_a_failed_assumption(name):
    run(*RAISING[name])


# ------------------------------------------------------------------ modules: views of buffers and parameters

class BufferColumnCopy(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(3, 4))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        self.buf[:, 0].copy_(x.detach().mean(0))
        return self.lin(x) + self.buf[:, 0]


class BufferEma(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(3))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        self.buf.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return self.lin(x) + self.buf


class BufferStoredView(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 3))
        self.last = None

    def forward(self, x):
        self.buf.add_(x[:1].detach())
        self.last = self.buf[0]
        return x * self.last


class BufferRingWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(3))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.buf.copy_(torch.roll(self.buf, 1))
        self.buf[0] = x.detach().sum()
        self.ptr += 1
        return x + self.buf.sum()


class ParamScaledNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)
        return x * self.w


class ParamRowFillNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        with torch.no_grad():
            self.w[0].fill_(2.0)
        return x @ self.w


class ParamDataRowWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        self.w.data[1].mul_(1.5)
        return x @ self.w


class ParamDataWholeReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        self.w.data.mul_(0.9)
        return x @ self.w, self.w.data


class BufferDiagonalAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("m", torch.zeros(3, 3))

    def forward(self, x):
        self.m.diagonal().add_(x.sum(0))
        return x @ self.m


class BufferReturnedTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("m", torch.zeros(3, 3))

    def forward(self, x):
        self.m.add_(x.detach().sum(0))
        return self.m.t()


class BatchNormRunningMeanView(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(x), self.bn.running_mean[0:2]


class BufferReadViewThenUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.ones(4, 3))

    def forward(self, x):
        head = self.buf[:2]
        y = x @ head.t()
        self.buf.mul_(0.5)
        return y


MODULES = {
    "BufferColumnCopy": (BufferColumnCopy, False),
    "BufferEma": (BufferEma, True),
    "BufferStoredView": (BufferStoredView, False),
    "BufferRingWrite": (BufferRingWrite, False),
    "ParamScaledNoGrad": (ParamScaledNoGrad, True),
    "ParamRowFillNoGrad": (ParamRowFillNoGrad, False),
    "ParamDataRowWrite": (ParamDataRowWrite, False),
    "ParamDataWholeReturned": (ParamDataWholeReturned, False),
    "BufferDiagonalAdd": (BufferDiagonalAdd, False),
    "BufferReturnedTransposed": (BufferReturnedTransposed, False),
    "BatchNormRunningMeanView": (BatchNormRunningMeanView, False),
    "BufferReadViewThenUpdate": (BufferReadViewThenUpdate, False),
}
MODULES_XFAIL = {
    "ParamDataWholeReturned": _DATA_AFTER_WRITE,
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=MODULES_XFAIL[n])]
                                               if n in MODULES_XFAIL else []) for n in sorted(MODULES)])
def test_module_buffers_and_parameters(name):
    make, grad = MODULES[name]
    run_module(make, lambda i: A(vec(i, grad=grad)), grad=grad)
