"""Adversarial differential sweep of loops over a tensor's rows (``symbolic/rolled/rows.py``,
with ``exits.py`` for bodies ending in ``if <tensor test>: break``) and of the other loop forms
a user writes for the same work: ``for row in x``, ``for x_t in x.unbind(d)`` /
``torch.unbind(x, d)`` (``d`` negative too), list comprehensions, ``enumerate`` / ``zip`` /
``reversed`` / ``list`` / ``iter`` / ``map`` over a tensor, ``x.split`` / ``x.chunk``,
generator expressions, ``while i < x.size(0)`` and ``for t in range(x.size(0))``.

Every case is differential (``differential.check`` / ``check_module``): eager and optimized
run on identical inputs and everything a user can observe must be the same (values,
gradients, parameters, arguments after the call, stdout, exceptions, RNG state). The number
of rows changes on every call, goes back and forth, and includes 0 and 1 (``SIZES``; call 4
captures). Bodies: RNN cells (``nn.GRUCell`` / ``LSTMCell`` / ``RNNCell``, hand-written),
tuple and namedtuple state, lists appended to then ``torch.stack`` / ``torch.cat``, ``row``
read after the loop (its value; writes through it into a tensor made in the call), writes
in the body (an accumulator made before the loop, in place into the row or the iterated
tensor, a list from outside, ``self.attr``, a buffer), tensor branches, ``.item()``,
nested loops (both sizes dynamic), tensors computed in the call (``x @ w``, a transpose,
``x[mask]``), gradients, training steps with an optimizer, dropout, ``break`` / ``continue``
/ ``return`` in various places, exceptions raised at some size. Each case runs with the
default templates (``rtol=1e-5``) and with ``templates="exact"`` (bit for bit).

Where a loop rolls in every capture that can roll it (not at a capture of 0 or 1 rows), the
case also asserts that explain() shows a rolled loop ("rolled loop at ..."); the other
forms only have to be right (falling back or unrolling is fine).

Wrong answers this sweep found, fixed (``FOUND``, ``HOISTED``):
* a builtin that iterates the tensor right before a ``for`` (``zip(x, y)``, ``reversed(x)``,
  ``list(x)``, ``tuple(x)``, ``[*x]``, ``iter(x)``, ``map(f, x)``, ``sorted(x)``,
  ``zip(*x)``) yielded no rows at all once the first dimension was dynamic (its ``unbind``
  was taken for the user's ``x.unbind(d)``);
* an in-place write into a row of a tensor that requires grad (eager's rows are ``unbind``
  outputs and autograd refuses the write) succeeded when the loop was rolled (rows were
  ``select`` views; they are ``unbind``'s now);
* by default, an appended ``h[0]`` / ``row[-1]`` (a tensor indexed by an int) was hoisted
  after the loop as if it acted row by row: the stacked result was ``stack(h)[0]``.
"""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from differential import A, T, assert_same, check, check_module

MODES = [("batched", 1e-5), ("exact", 0.0)]
SIZES = [3, 5, 2, 4, 0, 1, 7, 1, 6, 0, 2, 8]   # call 4 (index 3) captures at 4 rows
NZ = [3, 5, 2, 4, 1, 6, 1, 7, 2, 5, 1, 3]      # never 0 rows
CAP1 = [2, 3, 5, 1, 4, 0, 6, 1, 3, 7, 0, 2]    # captured at 1 row
CAP0 = [2, 3, 5, 0, 4, 1, 6, 0, 3, 7, 1, 2]    # captured at 0 rows
BIG = [3, 5, 2, 40, 1, 64, 0, 7, 33, 2, 100, 1]
CALLS = 10

def _n(sizes, i):
    return sizes[i % len(sizes)]


def xw(i):
    return A(T(_n(SIZES, i), 3, 4), T(4, 4), T(3, 4))


def xw_nz(i):
    return A(T(_n(NZ, i), 3, 4), T(4, 4), T(3, 4))


def xw_grad(i):
    return A(T(_n(SIZES, i), 3, 4, requires_grad=True), T(4, 4, requires_grad=True),
             T(3, 4, requires_grad=True))


def xw_cap1(i):
    return A(T(_n(CAP1, i), 3, 4), T(4, 4), T(3, 4))


def xw_cap0(i):
    return A(T(_n(CAP0, i), 3, 4), T(4, 4), T(3, 4))


def xw_big(i):
    return A(T(_n(BIG, i), 3, 4) * 0.3, T(4, 4) * 0.3, T(3, 4))


def xw_bf(i):
    return A(T(3, _n(SIZES, i), 4), T(4, 4), T(3, 4))


def x_1d(i):
    return A(T(_n(SIZES, i)), T(4, 4), T(3, 4))


def x_pairs(i):
    return A(T(_n(SIZES, i), 2, 4), T(4, 4), T(4))


def x_both(i):
    a = [3, 5, 2, 4, 1, 6, 2, 3, 5, 1, 4, 2][i % 12]
    b = [2, 4, 3, 5, 3, 1, 6, 2, 2, 4, 0, 3][i % 12]
    return A(T(a, b, 4), T(4, 4), T(4))


def x_last(i):
    return A(T(3, 4, _n(SIZES, i)), T(4, 4), T(3, 4))


def x_list(i):
    return A(T(_n(SIZES, i), 3, 4), [], T(3, 4))


# ---------------------------------------------------------------- recurrences over the rows

def rnn(x, w, h):
    for row in x:
        h = torch.tanh(row @ w + h)
    return h


def rnn_stack(x, w, h):
    outs = [h]
    for row in x:
        h = torch.tanh(row @ w + h)
        outs.append(h)
    return torch.stack(outs)


def rnn_stack_if_any(x, w, h):
    outs = []
    for row in x:
        h = torch.tanh(row @ w + h)
        outs.append(h)
    return torch.stack(outs) if outs else h   # the truth of a rolled list: unrolled


def tuple_state(x, w, h):
    state = (h, h * 0)
    for row in x:
        hh, cc = state
        cc = cc + torch.sigmoid(row @ w)
        hh = torch.tanh(cc) * hh + row
        state = (hh, cc)
    return state


State = collections.namedtuple("State", "h c")


def namedtuple_state(x, w, h):
    s = State(h, h * 0)
    for row in x:
        c = s.c + torch.sigmoid(row @ w)
        s = State(torch.tanh(c), c)
    return s


def _step(h, row, w):
    return torch.tanh(row @ w + h)


def calls_helper(x, w, h):
    for row in x:
        h = _step(h, row, w)
    return h


def try_in_body(x, w, h):
    for row in x:
        try:
            h = h + row
        except RuntimeError:
            h = h * 0
    return h


def where_in_body(x, w, h):
    for row in x:
        h = torch.where(row > 0, h + row, h - row)
    return h


def item_into_op(x, w, h):
    for row in x:
        h = h * row.abs().max().item()
    return h


def item_accumulated(x, w, h):
    tot = 0.0
    for row in x:
        tot = tot + row.sum().item()
    return tot


def python_counter(x, w, h):
    k = 0
    for row in x:
        h = h + row * 2
        k += 1
    return h, k


def size_in_body(x, w, h):
    for row in x:
        h = h + row * x.size(0) + row / len(x)
    return h


def x_read_in_body(x, w, h):
    for row in x:
        h = h + x[0] * row + x.sum(0) * 0.1
    return h


def x_rebound_in_body(x, w, h):
    for row in x:
        x = x * 2
        h = h + row + x[0]
    return h, x


def dropout_body(x, w, h):
    for row in x:
        h = torch.tanh(F.dropout(row, 0.5, training=True) @ w + h)
    return h


def int_rows(x, w, h):
    xi = (x * 3).long()
    acc = torch.zeros(3, 4, dtype=torch.long)
    for row in xi:
        acc = acc + row
    return acc


def unpack_row(x, w, h):
    for a, b in x:  # rows of shape (2, 4)
        h = h + a * b
    return h


def one_d(x, w, h):
    s = torch.zeros(())
    for v in x:
        s = s * 0.5 + v
    return s


def one_d_branch(x, w, h):
    s = torch.zeros(())
    for v in x:
        if v > 0:
            s = s + v
    return s


def branch_in_body(x, w, h):
    for row in x:
        if row.sum() > 0:
            h = h + row
        else:
            h = h - row
    return h


def print_in_body(x, w, h):
    for row in x:
        h = h + row
        print("row", row.shape)
    return h


# ---------------------------------------------------------------- `row` after the loop

def row_after(x, w, h):
    for row in x:
        h = h + row
    return h, row  # 0 rows: UnboundLocalError, as in eager


def row_defined_before(x, w, h):
    row = h
    for row in x:
        h = h + row
    return h, row


def row_rebound(x, w, h):
    for row in x:
        row = row * 2
        h = h + row
    return h, row * 1


def fresh_row_write_after(x, w, h):
    y = x * 1
    for row in y:
        h = h + row
    row.mul_(10)  # writes y's last row, as eager's view does
    return h, y


# ---------------------------------------------------------------- writes in the body

def acc_add_(x, w, h):
    acc = torch.zeros(3, 4)
    for row in x:
        acc.add_(row @ w)
    return acc


def acc_setitem(x, w, h):
    acc = torch.zeros(3, 4)
    for row in x:
        acc[0] += row[0]
        acc[:, 1] = acc[:, 1] * 0.5 + row[:, 1]
    return acc


def fresh_row_mul_(x, w, h):
    y = x * 1
    for row in y:
        row.mul_(2)
        h = h + row
    return h, y


def fresh_row_copy_(x, w, h):
    y = x.clone()
    for row in y:
        row.copy_(torch.tanh(row @ w + h))
        h = row
    return h, y


def fresh_row_setitem(x, w, h):
    y = x.clone()
    for row in y:
        row[0] = h[0]
        h = h + row
    return h, y


def fresh_whole_add_(x, w, h):
    y = x.clone()
    for row in y:
        y.add_(1)  # the rows still to come change
        h = h + row
    return h, y


def fresh_later_rows(x, w, h):
    y = x.clone()
    for row in y:
        h = torch.tanh(h + row)
        y[1:].add_(h[0, 0])
    return h, y


def input_row_mul_(x, w, h):
    for row in x:
        row.mul_(2)  # the caller's tensor: eager
        h = h + row
    return h


def outside_list(x, out, h):
    for row in x:
        h = h + row
        out.append(h)
    return h


def returns_appended_list(x, w, h):
    out = []
    for row in x:
        out.append(row + h)
    return out


# ---------------------------------------------------------------- nested loops

def nested_rows(x, w, h):
    total = h * 0
    for row in x:
        for v in row:
            total = torch.tanh(total + v @ w)
    return total


def nested_outs(x, w, h):
    outs = []
    for row in x:
        acc = h
        for v in row:
            acc = acc + v
        outs.append(acc)
    return torch.stack(outs)


def nested_comprehension(x, w, h):
    return torch.stack([torch.stack([v * 2 for v in row]) for row in x])


def inner_unbind1(x, w, h):
    for row in x:
        for v in row.unbind(1):
            h = h + v.sum()
    return h


# ---------------------------------------------------------------- tensors made in the call

def over_matmul(x, w, h):
    for r in x @ w:
        h = h + r
    return h


def over_transpose(x, w, h):
    for r in x.transpose(0, 1):
        h = h + r.sum(0)
    return h


def over_mask(x, w, h):
    flat = x.reshape(-1, 4)
    acc = torch.zeros(4)
    for r in flat[flat[:, 0] > 0]:  # a data-dependent number of rows
        acc = acc + r
    return acc


def over_slice(x, w, h):
    for row in x[1:]:
        h = torch.tanh(h @ w + row)
    return h


def over_step_slice(x, w, h):
    for row in x[::2]:
        h = h + row
    return h


# ---------------------------------------------------------------- unbind and comprehensions

def unbind_neg(x, w, h):
    acc = torch.zeros(3)
    for t in x.unbind(-3):
        acc = acc + t.sum(-1)
    return acc


def torch_unbind(x, w, h):
    acc = torch.zeros(3, 4)
    for t in torch.unbind(x):
        acc = acc + t
    return acc


def unbind1_rnn(x, w, h):
    outs = [h]
    for x_t in x.unbind(1):
        h = torch.tanh(x_t @ w + h)
        outs.append(h)
    return torch.stack(outs, 1)


def unbind_neg_dyn(x, w, h):
    total = h * 0
    for v in x.unbind(-2):  # dim 1 of a 3-d tensor, whose size varies
        total = total + v.sum(0) @ w
    return total


def unbind_last(x, w, h):
    for v in x.unbind(-1):  # the last dimension varies
        h = torch.tanh(v @ w + h)
    return h


def comprehension_stack(x, w, h):
    if x.size(0) == 0:
        return h
    return torch.stack([torch.sigmoid(r @ w) for r in x], dim=-1)


def comprehension_unbind1(x, w, h):
    return torch.stack([v.sum(0) for v in x.unbind(1)], 0)


def generator_sum(x, w, h):
    return sum((r * 2 for r in x), h)


def builtin_sum(x, w, h):
    return sum(x, h)


# ---------------------------------------------------------------- other iteration forms

def enumerate_rows(x, w, h):
    for i, row in enumerate(x, 1):
        h = h + row / i
    return h


def split_rows(x, w, h):
    for p in x.split(1):
        h = h + p[0]
    return h


def flip_rows(x, w, h):
    for row in x.flip(0):
        h = torch.tanh(h @ w + row)
    return h


def zip_rows(x, w, h):
    for a, b in zip(x, x.flip(0)):
        h = h + a * b
    return h


def zip_range(x, w, h):
    for a, k in zip(x, range(100)):
        h = h + a * k
    return h


def reversed_rows(x, w, h):
    for a in reversed(x):
        h = torch.tanh(h @ w + a)
    return h


def list_rows(x, w, h):
    for a in list(x):
        h = h + a
    return h


def tuple_rows(x, w, h):
    for a in tuple(x):
        h = h + a
    return h


def starred_rows(x, w, h):
    for a in [*x]:
        h = h + a
    return h


def iter_rows(x, w, h):
    for a in iter(x):
        h = h + a
    return h


def map_rows(x, w, h):
    for a in map(torch.tanh, x):
        h = h + a
    return h


def sorted_rows(x, w, h):
    for a in sorted(x, key=lambda r: 0):
        h = h + a
    return h


def zip_star(x, w, h):
    acc = torch.zeros(())
    for cols in zip(*x):
        acc = acc + sum(c.sum() for c in cols)
    return acc


def while_rows(x, w, h):
    i = 0
    while i < x.size(0):
        h = torch.tanh(x[i] @ w + h)
        i += 1
    return h


def range_rows(x, w, h):
    for t in range(x.size(0)):
        h = torch.tanh(x[t] @ w + h)
    return h


def range_len_stack(x, w, h):
    outs = [h]
    for t in range(len(x)):
        h = torch.tanh(x[t] @ w + h)
        outs.append(h)
    return torch.stack(outs)


# ---------------------------------------------------------------- break / continue / return

def brk(x, w, h):
    for row in x:
        h = torch.tanh(row @ w + h)
        if h.sum() > 1.0:
            break
    return h


def brk_row_after(x, w, h):
    for row in x:
        h = h + row @ w
        if h.sum() > 3.0:
            break
    return h, row * 1


def brk_row_rebound(x, w, h):
    for row in x:
        row = row * 2
        h = h + row
        if h.sum() > 2:
            break
    return h, row


def brk_search(x, w, h):
    for row in x:
        if row.sum() > 2:
            break
    return row * 1


def brk_outs_len(x, w, h):
    outs = [h]
    for row in x:
        h = torch.tanh(row @ w + h)
        outs.append(h)
        if h[0, 0] > 0.5:
            break
    return torch.stack(outs), len(outs)


def brk_item(x, w, h):
    for row in x:
        h = torch.tanh(row @ w + h)
        if h.sum().item() > 1.0:
            break
    return h


def brk_acc_add_(x, w, h):
    acc = torch.zeros(3, 4)
    for row in x:
        acc.add_(row)
        if acc.sum() > 2:
            break
    return acc


def brk_append_row(x, w, h):
    rows = [h]
    for row in x:
        rows.append(row)
        if row.sum() > 1:
            break
    return torch.stack(rows)


def brk_nested(x, w, h):
    for row in x:
        for v in row:
            h = h + v
        if h.sum() > 1:
            break
    return h


def brk_two_loops(x, w, h):
    for row in x:
        h = h + row
        if h.sum() > 2:
            break
    first = row
    for row in x:
        h = h - row * 0.5
    return h, first * 1, row * 1


def brk_fresh_write_after(x, w, h):
    y = x * 1
    for row in y:
        h = h + row
        if h.sum() > 1:
            break
    row.mul_(100)
    return h, y


def brk_x_rebound(x, w, h):
    for row in x:
        x = x * 2
        h = h + row
        if h.sum() > 2:
            break
    return h, row * 1, x


def brk_unbind1(x, w, h):
    for x_t in x.unbind(1):
        h = torch.tanh(h @ w + x_t)
        if h.sum() > 1:
            break
    return h, x_t * 1


def brk_first(x, w, h):
    for row in x:
        if row.sum() > 0:
            break
        h = h + row
    return h


def brk_for_else(x, w, h):
    for row in x:
        h = h + row
        if h.sum() > 2:
            break
    else:
        h = h * 100
    return h


def brk_while(x, w, h):
    i = 0
    while i < x.size(0):
        h = torch.tanh(h @ w + x[i])
        i += 1
        if h.sum() > 1:
            break
    return h, i


def brk_range(x, w, h):
    t = -1
    for t in range(x.size(0)):
        h = torch.tanh(h @ w + x[t])
        if h.sum() > 1:
            break
    return h, t


def cont(x, w, h):
    for row in x:
        if row.sum() > 0:
            continue
        h = h + row
    return h


def ret_in_loop(x, w, h):
    for row in x:
        h = h + row
        if h.sum() > 2:
            return h * 2
    return h


# ---------------------------------------------------------------- exceptions at some size

def raises_after_at_some_sizes(x, w, h):
    for row in x:
        h = h + row
    return h.view(x.size(0), -1)  # only where the size divides 12


def raises_in_body_at_some_sizes(x, w, h):
    for row in x:
        h = h + row[:, : x.size(0) % 5]  # a shape mismatch unless n % 5 is 1 or 4
    return h


def raises_at_some_row(x, w, h):
    for row in x:
        k = int(row.sum().item() > 3)
        h = h + row[:, k:k + 4]  # 3 columns where a row's sum is > 3: mismatch
    return h


def raise_in_body(x, w, h):
    for row in x:
        if not row.abs().max() < 2.5:  # (not `assert`: pytest rewrites its message)
            raise ValueError("big row")
        h = h + row
    return h


# ---------------------------------------------------------------- hoisted appends (default mode)

def append_h_index(x, w, h):
    outs = []
    for row in x:
        h = torch.tanh(row @ w + h)
        outs.append(h[0])
    return torch.stack(outs)


def append_row_last(x, w, h):
    outs = []
    for row in x:
        outs.append(row[-1] * 2)
    return torch.stack(outs)


def append_range_index(x, w, h):
    outs = []
    for t in range(x.size(0)):
        h = torch.tanh(x[t] @ w + h)
        outs.append(h[-1])
    return torch.stack(outs)


def append_row_ops(x, w, h):
    outs = []
    for row in x:
        h = torch.tanh(row @ w + h)
        outs.append(torch.cat([torch.softmax(row, 0), row.cumsum(0), row.t().flip(0).t(),
                               row.max(0).values[None], row[:, 1:3].sum(1, keepdim=True).expand(3, 4)], 0))
    return torch.stack(outs), h


# ---------------------------------------------------------------- in-place writes into rows that require grad

def grad_row_mul_(x, w, h):
    y = x * 1
    for r in y:
        r.mul_(2)
        h = h + r
    return h


def grad_row_mul_after(x, w, h):
    y = x * 1
    for r in y:
        h = h + r
    r.mul_(2)
    return h, y


def grad_unbind1_mul_(x, w, h):
    y = x * 1
    for c in y.unbind(1):
        c.mul_(2)
    return y


def grad_brk_row_mul_after(x, w, h):
    y = x * 1
    for r in y:
        h = h + r
        if h.sum() > 1:
            break
    r.add_(1)
    return h, y


def x_nz_grad(i):
    return A(T(_n(NZ, i), 3, 4, requires_grad=True), T(4, 4), T(3, 4))


def x_bf_grad(i):
    return A(T(3, _n(NZ, i), 4, requires_grad=True), T(4, 4), T(3, 4))


# ---------------------------------------------------------------- the table

R, U = True, False  # the case's loop rolls / only has to be right
G = {"grad": True}

CASES = [
    (rnn, xw, R, {}), (rnn, xw_grad, R, G), (rnn, xw_cap1, R, {}), (rnn, xw_cap0, R, {}),
    (rnn_stack, xw_grad, R, G), (rnn_stack, xw_big, R, {}),
    (rnn_stack_if_any, xw, U, {}),
    (tuple_state, xw_grad, R, G), (namedtuple_state, xw, R, {}), 
    (calls_helper, xw, R, {}), (try_in_body, xw, R, {}),
    (where_in_body, xw, R, {}), (item_into_op, xw, R, {}), (item_accumulated, xw, U, {}),
    (python_counter, xw, U, {}), (size_in_body, xw, R, {}), 
    (x_read_in_body, xw, R, {}), (x_rebound_in_body, xw, R, {}), (dropout_body, xw, R, {}),
    (int_rows, xw_nz, R, {}),
    (unpack_row, x_pairs, R, {}), (one_d, x_1d, R, {}), (one_d_branch, x_1d, U, {}),
    (branch_in_body, xw, U, {}), (print_in_body, xw, U, {}),
    (row_after, xw, R, {}), (row_after, xw_grad, R, G), (row_defined_before, xw, R, {}),
    (row_rebound, xw, R, {}), (fresh_row_write_after, xw_nz, R, {}),
    
    (acc_add_, xw, R, {}), (acc_setitem, xw, R, {}), 
    (fresh_row_mul_, xw_nz, R, {}), (fresh_row_copy_, xw, U, {}), (fresh_row_setitem, xw_nz, R, {}),
    (fresh_whole_add_, xw_nz, R, {}), (fresh_later_rows, xw_nz, R, {}), (input_row_mul_, xw, U, {}),
    (outside_list, x_list, U, {}), (returns_appended_list, xw, U, {}),
    (nested_rows, xw, R, {}), (nested_rows, x_both, R, {}), (nested_outs, x_both, R, {}),
    (nested_comprehension, x_both, R, {}), (inner_unbind1, xw, R, {}),
    (over_matmul, xw, U, {}), (over_matmul, xw_nz, R, {}), (over_transpose, xw, U, {}),
    (over_mask, xw, U, {}), (over_slice, xw, U, {}), (over_step_slice, xw, U, {}),
    (unbind_neg, xw, R, {}), (torch_unbind, xw, R, {}), 
    (unbind1_rnn, xw_bf, U, {}), (unbind_neg_dyn, x_both, R, {}), (unbind_last, x_last, R, {}),
    (comprehension_stack, xw, R, {}), (comprehension_unbind1, x_both, U, {}),
    (generator_sum, xw, U, {}), (builtin_sum, xw, U, {}),
    (enumerate_rows, xw, U, {}), (split_rows, xw, U, {}), (flip_rows, xw, U, {}),
    (while_rows, xw, R, {}), (range_rows, xw, R, {}),
    (range_len_stack, xw_grad, R, G),
    (brk, xw_grad, R, G), (brk_row_after, xw_nz, R, {}),
    (brk_row_rebound, xw_nz, R, {}), (brk_search, xw_nz, R, {}), (brk_outs_len, xw_grad, R, G),
    (brk_item, xw_grad, R, G), (brk_acc_add_, xw, R, {}), (brk_append_row, xw_grad, R, G),
    (brk_nested, xw, R, {}), (brk_two_loops, xw_nz, R, {}),
    (brk_fresh_write_after, xw_nz, R, {}), (brk_x_rebound, xw_nz, R, {}),
    (brk_unbind1, xw_bf, R, {}), (brk_first, xw, U, {}), (brk_for_else, xw, U, {}),
    (brk_while, xw, U, {}), (brk_range, xw, R, {}), (cont, xw, U, {}), (ret_in_loop, xw, U, {}),
    (raises_after_at_some_sizes, xw, R, {}), (raises_in_body_at_some_sizes, xw, R, {}),
    (raises_at_some_row, xw, U, {}), (raise_in_body, xw, U, {}),
    (append_row_ops, xw_nz, R, {}),
]

# Were wrong in both modes.
FOUND = [
    (zip_rows, xw), (zip_range, xw), (reversed_rows, xw), (list_rows, xw), (tuple_rows, xw),
    (starred_rows, xw), (iter_rows, xw), (map_rows, xw), (sorted_rows, xw), (zip_star, xw),
    (grad_row_mul_, x_nz_grad), (grad_row_mul_after, x_nz_grad), (grad_unbind1_mul_, x_bf_grad),
    (grad_brk_row_mul_after, x_nz_grad),
]

# Were wrong by default (hoisting), right with templates="exact".
HOISTED = [(append_h_index, xw_nz), (append_row_last, xw_nz), (append_range_index, xw_nz)]


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _run(fn, make_args, templates, rtol, grad=False):
    with specularch.config.patch(templates=templates):
        return check(fn, make_args, calls=CALLS, grad=grad, rtol=rtol, atol=rtol * 0.1)


def _id(case):
    fn, make_args = case[0], case[1]
    return f"{fn.__name__}-{make_args.__name__}"


@pytest.mark.parametrize("templates, rtol", MODES, ids=["batched", "exact"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_loop_over_rows_is_eagers(case, templates, rtol):
    fn, make_args, rolls, kw = case
    report = _run(fn, make_args, templates, rtol, **kw)
    if rolls:
        assert any(loop.rolled for loop in _loops(report)), report
        assert "rolled loop at" in str(report), report


@pytest.mark.parametrize("templates, rtol", MODES, ids=["batched", "exact"])
@pytest.mark.parametrize("fn, make_args", FOUND, ids=lambda v: v.__name__)
def test_forms_that_were_wrong(fn, make_args, templates, rtol):
    _run(fn, make_args, templates, rtol)


@pytest.mark.parametrize("templates, rtol", MODES, ids=["batched", "exact"])
@pytest.mark.parametrize("fn, make_args", HOISTED, ids=lambda v: v.__name__)
def test_appended_item_of_a_tensor(fn, make_args, templates, rtol):
    report = _run(fn, make_args, templates, rtol)
    assert any(loop.rolled for loop in _loops(report)), report


# ---------------------------------------------------------------- modules and training steps

class Reader(nn.Module):
    def __init__(self, kind="gru", unbind=False):
        super().__init__()
        self.kind, self.unbind = kind, unbind
        self.cell = {"gru": nn.GRUCell, "lstm": nn.LSTMCell, "rnn": nn.RNNCell}[kind](3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.zeros(x.shape[0] if self.unbind else x.shape[1], 4)
        c = torch.zeros_like(h)
        for x_t in (x.unbind(1) if self.unbind else x):  # the unbind: not rolled (a jump before GET_ITER)
            if self.kind == "lstm":
                h, c = self.cell(x_t, (h, c))
            else:
                h = self.cell(x_t, h)
        return self.out(h)


class ReaderUnbind(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(3, 4, nonlinearity="relu")
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 4)
        for x_t in torch.unbind(x, -2):
            h = self.cell(x_t, h)
        return self.out(h)


class AttrWriter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.last = None
        self.count = 0

    def forward(self, x):
        h = torch.zeros(x.shape[1], 3)
        for x_t in x:
            h = torch.tanh(self.lin(x_t) + h)
            self.last = h
            self.count += 1
        return h


class BufferAcc(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        h = torch.zeros(x.shape[1], 3)
        for x_t in x:
            h = torch.tanh(self.lin(x_t) + h)
            self.total.add_(x_t.sum(0))
        return h


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)
        self.proj = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 4)
        c = torch.zeros(x.shape[1], 4)
        outs = []
        for x_t in x:
            h, c = self.cell(x_t, (h, c))
            outs.append(self.proj(h))
        return torch.stack(outs)


class Stopper(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 4)
        for x_t in x:
            h = self.cell(x_t, h)
            if h.sum() > 0.5:
                break
        return h


class Trainer(nn.Module):
    """A module whose forward is a whole training step (the optimizer kept private, so the
    harness compares the parameters and not the optimizer object)."""

    def __init__(self, inner, adam=False):
        super().__init__()
        self.inner = inner
        self._opt = (torch.optim.Adam(inner.parameters(), lr=0.01) if adam
                     else torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9))

    def forward(self, x, y):
        self._opt.zero_grad()
        loss = ((self.inner(x) - y) ** 2).mean()
        loss.backward()
        self._opt.step()
        return loss


def _seq(sizes, out=None, batch_first=False):
    def make(i):
        x = T(2, _n(sizes, i), 3) if batch_first else T(_n(sizes, i), 2, 3)
        return A(x) if out is None else A(x, T(2, out))
    make.__name__ = f"seq_{'bf_' if batch_first else ''}{'nz' if sizes is NZ else 'sizes'}"
    return make


MODULES = [
    ("reader_gru", lambda: Reader("gru"), _seq(SIZES), R, G),
    ("reader_lstm", lambda: Reader("lstm"), _seq(SIZES), R, G),
    ("reader_rnn_unbind_ifexp", lambda: Reader("rnn", unbind=True), _seq(SIZES, batch_first=True), U, G),
    ("reader_unbind_neg", ReaderUnbind, _seq(NZ, batch_first=True), R, G),
    ("attr_writer", AttrWriter, _seq(NZ), U, {}),
    ("buffer_acc", BufferAcc, _seq(SIZES), U, {}),
    ("decoder", Decoder, _seq(NZ), R, G),
    ("stopper", Stopper, _seq(NZ), R, G),
    ("train_gru_sgd", lambda: Trainer(Reader("gru")), _seq(SIZES, 2), R, {}),
    ("train_lstm_adam", lambda: Trainer(Reader("lstm"), adam=True), _seq(NZ, 2), R, {}),
    ("train_unbind_sgd", lambda: Trainer(ReaderUnbind()), _seq(NZ, 2, True), R, {}),
    ("train_stopper", lambda: Trainer(Stopper()), _seq(NZ, 4), R, {}),
]


@pytest.mark.parametrize("templates, rtol", MODES, ids=["batched", "exact"])
@pytest.mark.parametrize("name, make_module, make_args, rolls, kw", MODULES,
                         ids=[m[0] for m in MODULES])
def test_module_over_rows_is_eagers(name, make_module, make_args, rolls, kw, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check_module(make_module, make_args, calls=CALLS, rtol=rtol, atol=rtol * 0.1, **kw)
    if rolls:
        assert any(loop.rolled for loop in _loops(report)), report


class LM(nn.Module):
    """Two stacked LSTM cells over the rows of the embedded tokens (time first, or
    ``unbind(1)`` for batch first) and a decoder over every step."""

    def __init__(self, batch_first=False, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.cells = nn.ModuleList([nn.LSTMCell(6, 6) for _ in range(2)])
        self.dec = nn.Linear(6, 11)
        self.batch_first, self.p = batch_first, dropout

    def forward(self, tokens):
        e = self.emb(tokens)
        b = e.shape[0] if self.batch_first else e.shape[1]
        hs = [torch.zeros(b, 6) for _ in self.cells]
        cs = [torch.zeros(b, 6) for _ in self.cells]
        outs = []
        if self.batch_first:
            for x_t in e.unbind(1):
                inp = x_t
                for i, cell in enumerate(self.cells):
                    hs[i], cs[i] = cell(inp, (hs[i], cs[i]))
                    inp = F.dropout(hs[i], self.p, self.training)
                outs.append(self.dec(inp))
            return torch.stack(outs, 1)
        for x_t in e:
            inp = x_t
            for i, cell in enumerate(self.cells):
                hs[i], cs[i] = cell(inp, (hs[i], cs[i]))
                inp = F.dropout(hs[i], self.p, self.training)
            outs.append(self.dec(inp))
        return torch.stack(outs)


BATCH = [2, 3, 2, 4, 1, 3, 2, 5, 4, 2, 3, 1]


@pytest.mark.parametrize("templates, rtol", MODES, ids=["batched", "exact"])
@pytest.mark.parametrize("batch_first, dropout", [(False, 0.0), (True, 0.0), (False, 0.3)],
                         ids=["time_first", "batch_first", "dropout"])
def test_lm_training_step_over_rows_with_varying_length_and_batch(batch_first, dropout,
                                                                  templates, rtol):
    torch.manual_seed(0)
    eager_model = LM(batch_first, dropout)
    opt_model = copy.deepcopy(eager_model)

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

        def step(tokens, targets):
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens).reshape(-1, 11), targets.reshape(-1))
            loss.backward()
            opt.step()
            return loss
        return step

    eager_step, opt_step = train(eager_model), specularch.optimize(train(opt_model))
    close = {"rtol": rtol, "atol": rtol * 0.1}
    with specularch.config.patch(templates=templates):
        for i in range(CALLS):
            t, b = _n(NZ, i), BATCH[i % 12]
            shape = (b, t) if batch_first else (t, b)
            gen = torch.Generator().manual_seed(i)
            tokens = torch.randint(0, 11, shape, generator=gen)
            targets = torch.randint(0, 11, shape, generator=gen)
            torch.manual_seed(i)
            want = eager_step(tokens, targets)
            torch.manual_seed(i)
            got = opt_step(tokens, targets)
            assert_same(want, got, f"loss of call {i}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after call {i}", rtol=rtol * 10, atol=rtol)
    report = specularch.explain(opt_step)
    assert not report.fallbacks, report
    assert any(loop.rolled for loop in _loops(report)), report
