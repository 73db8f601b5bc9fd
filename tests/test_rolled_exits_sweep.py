"""Adversarial differential sweep of rolled loops that stop early (``symbolic/rolled/exits.py``):
``for t in range(n): ...; if <test>: break``. Every case is differential (``differential.check``):
eager and optimized run on identical inputs and everything a user can observe must be the
same (values, gradients, parameters, arguments after the call, stdout, exceptions, torch's
and Python's RNG state). Inputs are chosen so that the loop stops at many iterations: the
first, the second, the last, in between and never. Where the feature applies the case also
asserts one graph whose loop is rolled with an exit check; elsewhere only that the results
match (falling back to eager is fine, a wrong answer is not)."""
import math
import random

import pytest
import torch
from torch import nn

import specularch
from differential import A, T, check, check_module, module_globals
from test_rolled_exits import TeacherForced  # (fed the reference tokens, stops past a loss)

TEMPLATES = pytest.mark.parametrize("templates", ["batched", "exact"])
N = 5
# The iteration where call i breaks (>= N: never). Call 3 captures (profile_calls=3).
BREAKS = [2, 0, 1, 4, 9, 3, 0, 2, 1, 4, 9, 3, 0, 1, 2, 4, 9, 3, 0, 1]
CALLS = 18
STEP = torch.tensor([1.0, 0.0, 0.0])

max_len = 5
counter = 0


def b(i):
    return BREAKS[i % len(BREAKS)]


def h0(i):
    """h[0] after iteration t (``h = h + STEP``) is ``t - b(i) + 0.5``: > 0 from iteration b(i)."""
    return torch.tensor([-b(i) - 0.5, 0.25, -0.75])


def args_n(i):
    return A(h0(i), STEP.clone(), N)


def args_varying_n(i):
    return A(h0(i), STEP.clone(), 4 + i % 3)


def loops(report):
    return [loop for graph in report.graphs for loop in graph.loops]


def no_internal_error(report):
    assert not [f for f in report.fallbacks if f.kind == "internal_error"], report


def one_rolled_graph(report, stops=True, captures=(1,)):
    """One graph, no fallback, its loop rolled (and stopping at its ``break`` test)."""
    no_internal_error(report)
    assert report.stats.captures in captures and not report.fallbacks, report
    rolled = [loop for loop in loops(report) if loop.rolled]
    assert len(rolled) >= 1, report
    exit_loops = [loop for loop in rolled if "stops where its `break` test says so" in str(loop)]
    assert bool(exit_loops) == stops, report
    return exit_loops[0] if stops else rolled[0]


def not_rolled(report):
    no_internal_error(report)
    assert not any(loop.rolled for loop in loops(report)), report


def stopped_in_many_places(loop):
    assert len(set(loop.trips)) >= 3 and 1 in loop.trips, loop


# ------------------------------------------------------------------ the index after the loop

def index_returned(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def index_arithmetic(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h * (t + 1) - t / 4, t * 2 + 1, float(t) / 3


def index_as_size(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return torch.ones(t + 1, 2) * h[:2], h.new_zeros(t)


def index_as_index(h, x, n):
    rows = torch.arange(12.0).reshape(6, 2)
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return rows[t], rows[: t + 1].sum(), h[t % 3]


def index_in_a_further_loop(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    acc = h * 0
    for j in range(t + 1):
        acc = acc + h * j
    return acc


def index_in_python_branch(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    if t == n - 1:
        return h * 2, "ran out"
    return h, "stopped"


def index_formatted(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h, f"stopped at {t}", str(t)


def index_defined_before(h, x, n):
    t = -1
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def index_unused(h, x, n):
    for _ in range(n):
        h = h * 1.5 + x
        if h[0].item() > 0:
            break
    return h


def index_in_body(h, x, n):
    total = h * 0
    for t in range(n):
        h = h + x
        total = total + h * t
        if h[0].item() > 0:
            break
    return total, h


def index_in_test(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() + t * 0.25 > 0.5:
            break
    return h, t


def args_zero_one(i):
    return A(h0(i), STEP.clone(), [3, 0, 1, 2, 5, 1, 0, 4, 6, 2, -2, 3][i % 12])


def index_reassigned(h, x, n):
    for t in range(n):
        h = h + x
        t = t * 10 + 1
        if h[0].item() > 0:
            break
    return h, t


def index_rebound_to_tensor(h, x, n):
    for t in range(n):
        h = h + x
        t = h.sum() * 2
        if h[0].item() > 0:
            break
    return h, t


def index_in_containers(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return {"t": t, "h": h}, [t, t + 1], (t,)


def two_exit_loops(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    g = h - x * 3
    for u in range(n):
        g = g + x * 0.5
        if g[0].item() > 0:
            break
    return h * t, g * u, t + u


def _decode(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def helper_called_twice(h, x, n):
    a, ta = _decode(h, x, n)
    c, tc = _decode(h - x * 2, x, n)
    return a, c, ta, tc


def loop_in_no_grad(h, w, n):
    with torch.no_grad():
        for t in range(n):
            h = h + w * 0.5
            if h[0].item() > 0:
                break
    return h * w, t


def dtype_change_at_iteration_0(h, x, n):
    h = h.round().long()
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def shape_change_at_iteration_0(h, x, n):
    x2 = torch.stack([x, x * 0.5])
    for t in range(n):
        h = h + x2
        if h[0, 0].item() > 0:
            break
    return h, t


def rand_then_raise(h, x, n):
    rows = torch.zeros(4, 3)
    for t in range(n):
        h = h + x + torch.rand(3) * 0.01
        h = h + rows[t]  # IndexError from iteration 4 on
        if h[0].item() > 0:
            break
    return h, t


def rand_then_check(h, x, n):
    for t in range(n):
        h = h + x + torch.rand(3) * 0.01
        if h[2].item() > 2:
            raise ValueError(f"diverged at {t}")
        if h[0].item() > 0:
            break
    return h, t


def args_rand_check(i):
    h = h0(i)
    h[2] = 1.0 if i in (6, 9, 13) else -5.0
    return A(h, torch.tensor([1.0, 0.0, 0.5]), N)


def trip_count_zero_or_one(h, x, n):
    t = -7
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def trip_count_zero_unbound(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t  # UnboundLocalError where n == 0


def constant_one(h, x):
    for t in range(1):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def constant_two(h, x):
    for t in range(2):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def constant_eight(h, x):
    for t in range(8):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


# ------------------------------------------------------------------ other iterables

def range_a_b(h, x, n):
    for t in range(1, n + 1):
        h = h + x * t
        if h[0].item() > 0:
            break
    return h, t


def range_a_b_symbolic_start(h, x, n):
    for t in range(n - 3, n + 2):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def range_step_two(h, x, n):
    for t in range(0, 2 * n, 2):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def range_negative_step(h, x, n):
    for t in range(n, 0, -1):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def reversed_range(h, x, n):
    for t in reversed(range(n)):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def enumerate_rows(h, x, n):
    rows = x.expand(n, 3)
    for i, row in enumerate(rows):
        h = h + row
        if h[0].item() > 0:
            break
    return h, i


def zip_rows(h, x, n):
    rows = x.expand(n, 3)
    scales = torch.linspace(1.0, 1.0, n)
    for row, s in zip(rows, scales):
        h = h + row * s
        if h[0].item() > 0:
            break
    return h, s


def over_a_tensor(h, x, n):
    for row in x.expand(n, 3):
        h = h + row
        if h[0].item() > 0:
            break
    return h, row


# ------------------------------------------------------------------ kinds of tests

def stop_all(h, x, n):
    for t in range(n):
        h = h + x.abs()
        if (h > -1).all():
            break
    return h, t


def stop_any(h, x, n):
    for t in range(n):
        h = h + x
        if (h > 0.3).any():
            break
    return h, t


def stop_zero_d(h, x, n):
    for t in range(n):
        h = h + x
        if h[0] > 0:
            break
    return h, t


def stop_zero_d_vs_zero_d(h, x, n):
    for t in range(n):
        h = h + x
        if h[0] > h[1] - 0.25:
            break
    return h, t


def stop_bool_tensor(h, x, n):
    for t in range(n):
        h = h + x
        if (h > 0)[0]:
            break
    return h, t


def stop_negated_tensor(h, x, n):
    for t in range(n):
        h = h + x
        if not (h[0] <= 0):
            break
    return h, t


def nan_args(i):
    return A(torch.tensor([b(i) + 0.5, 1.0, 2.0]), -STEP, N)


def stop_isnan(h, x, n):
    for t in range(n):
        h = h + x
        if torch.isnan(h.sqrt()).any():
            break
    return h, t


def stop_item_nan(h, x, n):
    for t in range(n):
        h = h + x
        v = h.sqrt()[0].item()
        if v != v:
            break
    return h, t


def stop_math_isnan(h, x, n):
    for t in range(n):
        h = h + x
        if math.isnan(h.sqrt()[0].item()):
            break
    return h, t


def stop_float_equality(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() == 0.5:
            break
    return h, t


def int_args(i):
    return A(torch.tensor(10 - b(i)), N)


def stop_in_tuple(tok, n):
    for t in range(n):
        tok = tok + 1
        if tok.item() in (11, 12):
            break
    return tok, t


def stop_not_in(tok, n):
    for t in range(n):
        tok = tok + 1
        if tok.item() not in (7, 8, 9, 10):
            break
    return tok, t


def stop_is_true(h, x, n):
    for t in range(n):
        h = h + x
        if (h[0] > 0).item() is True:
            break
    return h, t


def stop_and(h, x, n):
    for t in range(n):
        h = h + x
        if h[1].item() < 10 and h[0].item() > 0:
            break
    return h, t


def stop_and_first_varies(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0 and h[1].item() < 10:
            break
    return h, t


def stop_or_first_flips(h, x, n):
    for t in range(n):
        h = h + x
        if h[2].item() > 0 or h[0].item() > 0:
            break
    return h, t


def args_or(i):
    h = h0(i)
    h[2] = 1.0 if i in (7, 11, 16) else -1.0  # the first side breaks at iteration 0
    return A(h, STEP.clone(), N)


def stop_or(h, x, n):
    for t in range(n):
        h = h + x
        if h[1].item() > 100 or h[0].item() > 0:
            break
    return h, t


def stop_fresh_value(h, x, n):
    for t in range(n):
        h = torch.tanh(h + x) * 3
        if (h * 2 - 1).sum().item() > 0:
            break
    return h, t


def stop_loop_invariant(h, x, n):
    for t in range(n):
        h = h + x
        if x.sum().item() > 1.5:
            break
    return h, t


def args_invariant(i):
    return A(h0(i), STEP * (2.0 if i % 3 == 1 else 1.0), N)


def stop_item_read_before(h, x, n):
    m = h[1].item()
    for t in range(n):
        h = h + x
        if h[0].item() > m:
            break
    return h, t


def stop_argmax_eos(h, n):
    for t in range(n):
        h = torch.roll(h, 1)
        if h.argmax().item() == 1:
            break
    return h, t


def args_argmax(i):
    return A(torch.eye(6)[[3, 1, 2, 0, 5, 4, 3, 0, 1, 2, 5][i % 11]] + T(6) * 0.1, 5)


def stop_zero_truthiness(h, x, n):
    for t in range(n):
        h = h + x
        if not h[0]:
            break
    return h, t


def args_truthiness(i):
    return A(torch.tensor([-b(i) - 1.0, 0.5, 0.0]), STEP.clone(), N)


def stop_not_item(h, x, n):
    for t in range(n):
        h = h + x
        if not h[0].item() <= 0:
            break
    return h, t


def stop_division_by_zero(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() / h[1].item() > 0:  # ZeroDivisionError where h[1] reaches 0
            break
    return h, t


def args_division(i):
    zero_at = [9, 9, 1, 9, 0, 9, 2, 9, 9, 3, 9, 1, 9, 9, 0, 9, 9, 4, 9, 9][i % 20]
    return A(torch.tensor([-b(i) - 0.5, zero_at + 1.0, 0.0]), torch.tensor([1.0, -1.0, 0.0]), N)


def stop_math_domain(h, x, n):
    for t in range(n):
        h = h + x
        if math.sqrt(h[1].item()) + h[0].item() > 2:  # ValueError where h[1] < 0
            break
    return h, t


def stop_on_previous(h, x, n):
    for t in range(n):
        prev = h
        h = h + x
        if prev[0].item() > -1:
            break
    return h, prev, t


def stop_torch_equal(h, x, n):
    target = torch.tensor([1.5, 0.25, -0.75])
    for t in range(n):
        h = h + x
        if torch.equal(h, target):
            break
    return h, t


def stop_tolist(h, x, n):
    for t in range(n):
        h = h + x
        if h.tolist()[0] > 0:
            break
    return h, t


def stop_item_bool(h, x, n):
    for t in range(n):
        h = h + x
        if (h[0] > 0).item():
            break
    return h, t


def stop_int_modulo(tok, n):
    for t in range(n):
        tok = tok + 1
        if tok.item() % 7 == 0:
            break
    return tok, t


STOP = 11


def stop_global_token(tok, n):
    for t in range(n):
        tok = tok + 1
        if tok.item() == STOP:
            break
    return tok, t


def grad_mode_toggle(h, w, n, flag):
    with torch.set_grad_enabled(flag):
        for t in range(n):
            h = h + w * 0.5
            if h[0].item() > 0:
                break
    return h, t


def long_loop(h, x, n):
    for t in range(n):
        h = torch.tanh(h * 1.01 + x * 0.001)
        if h[0].item() > 0:
            break
    return h, t


def args_long(i):
    h = h0(i) * 0.1
    return A(h, STEP * [1.0, 0.0, 5.0, 0.5][i % 4], 300)


def stop_multi_element(h, x, n):
    for t in range(n):
        h = h + x
        if h > 0:  # more than one value: raises in eager
            break
    return h, t


# ------------------------------------------------------------------ carried state

def carried_counter(h, x, n):
    k = 0
    for t in range(n):
        h = h + x
        k += 2
        if h[0].item() > 0:
            break
    return h, k, t


def carried_tuple(h, x, n):
    state = (h, h * 0)
    for t in range(n):
        a, c = state
        state = (a + x, c + a)
        if state[0][0].item() > 0:
            break
    return state


def carried_several(h, x, n):
    a, c, d = h, h * 2, x.clone()
    for t in range(n):
        a, c, d = a + x, c * 0.5 + a, d - c
        if a[0].item() > 0:
            break
    return a, c, d


def carried_item_sum(h, x, n):
    total = 0.0
    for t in range(n):
        h = h + x
        total += h[1].item() * 2
        if h[0].item() > 0:
            break
    return h, total


def carried_growing(h, x, n):
    for t in range(n):
        h = torch.cat([h[:1] + x[:1], h])
        if h[0].item() > 0:
            break
    return h, t


def carried_shape_mismatch(h, x, n):
    for t in range(n):
        h = torch.cat([h + x, h[:1]])  # raises in iteration 1 (4 + 3 elements)
        if h[0].item() > 0:
            break
    return h, t


def inplace_carried(h, x, n):
    h = h.clone()
    for t in range(n):
        h.add_(x)
        if h[0].item() > 0:
            break
    return h, t


def view_test(h, x, n):
    for t in range(n):
        h = h + x
        v = h[:2]
        if v[0] > 0:
            break
    return h, v, t


def merged_if_in_body(h, x, n):
    for t in range(n):
        h = h + x
        if h[2].item() > 0:
            h = h * 1.0 + 0.0
        else:
            h = h - 0.0
        if h[0].item() > 0:
            break
    return h, t


def body_local_after(h, x, n):
    for t in range(n):
        h = h + x
        y = h * 3
        if h[0].item() > 0:
            break
    return y


def inplace_argument(h, x, n):
    for t in range(n):
        h.add_(x)
        if h[0].item() > 0:
            break
    return t


def inplace_accumulator(h, x, n):
    acc = torch.zeros(3)
    for t in range(n):
        h = h + x
        acc.mul_(0.5).add_(h)
        if h[0].item() > 0:
            break
    return acc, h


# ------------------------------------------------------------------ structure

def inner_rolled_loop(h, x, n):
    for t in range(n):
        for j in range(n):
            h = h + x * 0.25
        h = h - x * (0.25 * n - 1)
        if h[0].item() > 0:
            break
    return h, t


def outer_loop(h, x, n):
    total = 0
    for o in range(2):
        g = h - x * o
        for t in range(n):
            g = g + x
            if g[0].item() > 0:
                break
        total += t
        h = g
    return h, total


def outer_exit_loop(h, x, n):
    for o in range(n):
        g = h
        for t in range(3):
            g = g + x
            if g[1].item() > 100:
                break
        h = h + x
        if h[0].item() > 0:
            break
    return h, g, o


def exit_loop_in_rolled_loop(h, x, n, m):
    for o in range(m):
        for t in range(n):
            h = h + x
            if h[0].item() > 0:
                break
        h = h - x * 2.5
    return h


def args_nested(i):
    return A(h0(i), STEP.clone(), N, 2 + i % 3)


def trip_count_from_shape(h, rows):
    for t in range(rows.shape[0]):
        h = h + rows[t]
        if h[0].item() > 0:
            break
    return h, t


def args_shape(i):
    return A(h0(i), STEP.expand(3 + i % 4, 3).clone())


def trip_count_from_item(h, x, n):
    for t in range(int(n.item())):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def continue_before(h, x, n):
    for t in range(n):
        h = h + x
        if h[2].item() > 0:
            continue
        if h[0].item() > 0:
            break
    return h, t


def args_continue(i):
    h = h0(i)
    h[2] = [-1.0, 0.5][i % 2 if i > 8 else 0]
    return A(h, STEP.clone(), N)


def for_else(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 0:
            break
    else:
        h = h * 100
    return h, t


def nested_if(h, x, n):
    for t in range(n):
        h = h + x
        if h[1].item() > 0:
            if h[0].item() > 0:
                break
    return h, t


def two_breaks(h, x, n):
    for t in range(n):
        h = h + x
        if h[2].item() > 0:
            break
        h = h * 1.0
        if h[0].item() > 0:
            break
    return h, t


def break_in_no_grad(h, x, n):
    for t in range(n):
        h = h + x
        with torch.no_grad():
            if h[0].item() > 0:
                break
    return h, t, torch.is_grad_enabled()


def prints(h, x, n):
    for t in range(n):
        h = h + x
        print("step", h[0].item())
        if h[0].item() > 0:
            break
    return h


def raises(h, x, n):
    for t in range(n):
        h = h + x
        if h[0].item() > 2:
            raise ValueError("diverged")
        if h[0].item() > 0:
            break
    return h, t


def args_raises(i):
    h = h0(i)
    if i in (5, 10, 15):
        h[0] = 1.75  # h[0] > 2 at iteration 0... rather 2.75 after iteration 0: raises
    return A(h, STEP.clone(), N)


def index_out_of_range(h, x, n):
    rows = torch.ones(4, 3) * 0.0
    for t in range(n):
        h = h + x + rows[t]
        if h[0].item() > 0:
            break
    return h, t


def global_max_len(h, x):
    for t in range(max_len):
        h = h + x
        if h[0].item() > 0:
            break
    return h, t


def global_write(h, x, n):
    global counter
    for t in range(n):
        h = h + x
        counter += 1
        if h[0].item() > 0:
            break
    return h


def python_random(h, x, n):
    for t in range(n):
        h = h + x * (1.0 + random.random() * 0.01)
        if h[0].item() > 0:
            break
    return h, t


def torch_rand(h, x, n):
    for t in range(n):
        h = h + x + torch.rand(3) * 0.01
        if h[0].item() > 0:
            break
    return h, t


def dropout(h, x, n):
    for t in range(n):
        h = h + nn.functional.dropout(x + 0.1, 0.3, training=True) * 0.5
        if h[0].item() > 0:
            break
    return h, t


def grad_through(h, x, n):
    w = x * 1.0
    for t in range(n):
        h = h + w * torch.sigmoid(h)
        if h[0].item() > 0:
            break
    return h, t


def grad_from_iteration_0(h, w, n):
    for t in range(n):
        h = h + w * 0.5
        if h[0].item() > 0:
            break
    return h, t


def grad_args_later(i):
    return A(h0(i), (STEP * 2.0).requires_grad_(), N)


def grad_args(i):
    return A(h0(i).requires_grad_(), (STEP * 2.5).requires_grad_(), N)


# ------------------------------------------------------------------ the table

def args_capture_breaks_at_once(i):
    return A(torch.tensor([[-2.5, -0.5, -1.5, 0.5, -4.5, -3.5, -0.5, -1.5][i % 8] - 0.0, 0.25, -0.75]),
             STEP.clone(), N)


def args_capture_never_breaks(i):
    return A(torch.tensor([[-2.5, -0.5, -1.5, -9.5, 0.5, -3.5, -0.5, -4.5][i % 8], 0.25, -0.75]),
             STEP.clone(), N)


def args_n_int(i):
    return A(h0(i), STEP.clone(), torch.tensor(4 + i % 3))


# Rolled with an exit check: one graph, no fallback, stops in many places.
ROLLED = [
    (index_returned, args_n), (index_returned, args_varying_n),
    (index_returned, args_capture_breaks_at_once), (index_returned, args_capture_never_breaks),
    (index_arithmetic, args_n), (index_formatted, args_n), (index_defined_before, args_n),
    (index_unused, args_n), (index_in_body, args_varying_n),
    (stop_zero_d, args_n), (stop_zero_d_vs_zero_d, args_n), (stop_bool_tensor, args_n),
    (stop_negated_tensor, args_n), (stop_not_item, args_n), (stop_any, args_n), (stop_all, args_n),
    (stop_is_true, args_n), (stop_float_equality, args_n), (stop_and, args_n), (stop_or, args_n),
    (stop_zero_truthiness, args_truthiness), (stop_isnan, nan_args), (stop_math_isnan, nan_args),
    (stop_in_tuple, int_args), (stop_not_in, int_args), (stop_argmax_eos, args_argmax),
    (stop_item_read_before, args_n), (stop_on_previous, args_n),
    (stop_item_bool, args_n), (stop_int_modulo, int_args),
    (index_rebound_to_tensor, args_n), (index_in_containers, args_n), (two_exit_loops, args_n),
    (helper_called_twice, args_n),
    (dtype_change_at_iteration_0, args_n), (shape_change_at_iteration_0, args_n),
    (carried_tuple, args_n), (carried_several, args_n), (body_local_after, args_n),
    (inplace_accumulator, args_n), (inner_rolled_loop, args_n), (nested_if, args_n),
    (two_breaks, args_n), (merged_if_in_body, args_n),
    (torch_rand, args_n), (dropout, args_n), (trip_count_from_shape, args_shape),
]

# Anything else: the results must match eager (a fallback is fine).
SAME = [
    (index_as_size, args_n), (index_as_index, args_n), (index_in_a_further_loop, args_n),
    (index_in_python_branch, args_n), (index_in_test, args_n),
    (range_a_b, args_n), (range_a_b_symbolic_start, args_varying_n), (range_step_two, args_n),
    (range_negative_step, args_n), (reversed_range, args_n), (enumerate_rows, args_n),
    (zip_rows, args_n), (over_a_tensor, args_n),
    (stop_and_first_varies, args_n), (stop_or_first_flips, args_or), (stop_item_nan, nan_args),
    (stop_multi_element, args_n), (stop_division_by_zero, args_division),
    (stop_math_domain, args_division), (stop_fresh_value, args_n),
    (carried_counter, args_n), (carried_item_sum, args_n), (carried_growing, args_n),
    (carried_shape_mismatch, args_n), (inplace_argument, args_n), (inplace_carried, args_n),
    (view_test, args_n), (stop_torch_equal, args_n), (stop_tolist, args_n),
    (index_reassigned, args_n), (loop_in_no_grad, grad_args_later), (rand_then_raise, args_varying_n), (rand_then_check, args_rand_check),
    (outer_loop, args_n), (outer_exit_loop, args_n), (exit_loop_in_rolled_loop, args_nested),
    (for_else, args_n), (continue_before, args_continue), (break_in_no_grad, args_n), (prints, args_n),
    (raises, args_raises), (index_out_of_range, args_varying_n), (python_random, args_n),
    (trip_count_zero_or_one, args_zero_one), (trip_count_zero_unbound, args_zero_one),
    (constant_one, lambda i: A(h0(i), STEP.clone())), (constant_two, lambda i: A(h0(i), STEP.clone())),
    (constant_eight, lambda i: A(h0(i), STEP.clone())), (trip_count_from_item, args_n_int),
]


def _id(case):
    fn, make = case
    return fn.__name__ if make in (args_n,) else f"{fn.__name__}-{getattr(make, '__name__', 'args')}"


@TEMPLATES
@pytest.mark.parametrize("case", ROLLED, ids=_id)
def test_rolled(case, templates):
    fn, make = case
    with specularch.config.patch(templates=templates):
        report = check(fn, make, calls=CALLS)
    stopped_in_many_places(one_rolled_graph(report))


@TEMPLATES
@pytest.mark.parametrize("case", SAME, ids=_id)
def test_same_as_eager(case, templates):
    fn, make = case
    with specularch.config.patch(templates=templates):
        report = check(fn, make, calls=CALLS)
    no_internal_error(report)


@TEMPLATES
def test_a_loop_invariant_test(templates):
    with specularch.config.patch(templates=templates):
        report = check(stop_loop_invariant, args_invariant, calls=CALLS)
    assert set(one_rolled_graph(report).trips) == {1, N}, report


def test_a_global_stop_token():
    stops = [11, 11, 11, 11, 12, 13, 11, 10, 11, 14, 11, 11, 12, 11, 11, 11, 99, 11]

    def make(i):
        global STOP
        STOP = stops[i % len(stops)]
        return int_args(i)
    report = check(stop_global_token, make, calls=CALLS)
    no_internal_error(report)


@TEMPLATES
def test_grad_mode_toggled_around_the_loop(templates):
    def make(i):
        return A(h0(i), (STEP * 2.0).requires_grad_(), N, i % 4 != 1)
    with specularch.config.patch(templates=templates):
        report = check(grad_mode_toggle, make, calls=CALLS)
    no_internal_error(report)


@TEMPLATES
def test_a_long_loop(templates):
    with specularch.config.patch(templates=templates):
        report = check(long_loop, args_long, calls=12)
    assert len(set(one_rolled_graph(report).trips)) >= 3, report


def test_capture_on_the_first_call(no_profiling):
    report = check(index_returned, args_n, calls=CALLS)
    stopped_in_many_places(one_rolled_graph(report))


def test_global_max_len():
    lens = [5, 5, 5, 5, 3, 5, 1, 6, 5, 2, 5, 4, 5, 5, 7, 5, 5, 5]

    def make(i):
        global max_len
        max_len = lens[i % len(lens)]
        return A(h0(i), STEP.clone())
    report = check(global_max_len, make, calls=CALLS)
    stopped_in_many_places(one_rolled_graph(report, captures=(2,)))  # max_len made an input


def test_global_write():
    report = check(global_write, args_n, calls=CALLS, state=module_globals(__name__, counter=0))
    not_rolled(report)  # a global write in the body


def test_python_random_state():
    report = check(python_random, args_n, calls=CALLS)
    not_rolled(report)  # draws from Python's random module in the body


@TEMPLATES
@pytest.mark.parametrize("case", [(grad_through, grad_args), (grad_from_iteration_0, grad_args_later)],
                         ids=lambda c: c[0].__name__)
def test_grad_through_the_loop(case, templates):
    fn, make = case
    with specularch.config.patch(templates=templates):
        report = check(fn, make, calls=CALLS, grad=True)
    stopped_in_many_places(one_rolled_graph(report))


# ------------------------------------------------------------------ modules

class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.max_len = 5
        self.steps = 0

    def forward(self, h, x):
        for t in range(self.max_len):
            h = h + x
            self.steps += 1
            if h[0].item() > 0:
                break
        return h, t


class MaxLenAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.max_len = 5

    def forward(self, h, x):
        for t in range(self.max_len):
            h = h + x * self.scale
            if h[0].item() > 0:
                break
        return h, t


class Trainer(nn.Module):
    """A loss accumulated over the steps the loop ran, then an optimizer step."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(3) * 0.5)
            self.lin.bias.copy_(torch.tensor([1.0, 0.0, 0.0]))
        self.opt = torch.optim.SGD(self.parameters(), lr=0.002)

    def forward(self, h, n):
        self.opt.zero_grad()
        loss = 0.0
        for t in range(n):
            h = self.lin(h) + h * 0.5
            loss = loss + (h ** 2).mean()
            if h[0].item() > 0:
                break
        loss.backward()
        self.opt.step()
        return loss.detach(), t


class InplaceBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(3))

    def forward(self, h, x, n):
        for t in range(n):
            h = h + x
            self.acc.add_(h)
            if h[0].item() > 0:
                break
        return h


def test_attribute_write_in_body():
    report = check_module(Counting, lambda i: A(h0(i), STEP.clone()), calls=CALLS)
    not_rolled(report)


@TEMPLATES
def test_max_len_from_a_module_attribute(templates):
    lens = [5, 5, 5, 5, 3, 5, 1, 6, 5, 2, 5, 4, 5, 5, 7, 5, 5, 5]

    def between(m, i):
        m.max_len = lens[i % len(lens)]
    with specularch.config.patch(templates=templates):
        report = check_module(MaxLenAttr, lambda i: A(h0(i), STEP.clone()), calls=CALLS,
                              between=between, grad=True)
    stopped_in_many_places(one_rolled_graph(report, captures=(1, 2)))


@TEMPLATES
def test_optimizer_step_after_the_loop(templates):
    def make(i):
        return A(torch.tensor([-b(i) * 1.0 - 0.5, 0.2, -0.3]), N)
    with specularch.config.patch(templates=templates):
        report = check_module(Trainer, make, calls=CALLS)
    assert len(set(one_rolled_graph(report).trips)) >= 3, report


def test_inplace_buffer():
    report = check_module(InplaceBuffer, args_n, calls=CALLS)
    not_rolled(report)  # an in-place write to a buffer in the body


class Greedy(nn.Module):
    """A GRU decoder fed its own predictions, with dropout in training mode."""

    def __init__(self):
        super().__init__()
        self.embed, self.cell, self.out = nn.Embedding(4, 6), nn.GRUCell(6, 6), nn.Linear(6, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, h, target, n):
        tok, loss = torch.zeros(1, dtype=torch.long), 0.0
        for t in range(n):
            h = self.cell(self.drop(self.embed(tok)), h)
            logits = self.out(h)
            loss = loss + nn.functional.cross_entropy(logits, target[t])
            tok = logits.argmax(1).detach()
            if tok.item() == 1:
                break
        return loss, t


class EosAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.eos = 11

    def forward(self, tok, n):
        for t in range(n):
            tok = tok + 1
            if tok.item() == self.eos:
                break
        return tok, t


def _tokens(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 4, (4 + i % 5, 1), generator=g)


@TEMPLATES
def test_teacher_forced_lstm(templates):
    with specularch.config.patch(templates=templates):
        # batched: the embeddings of every iteration are looked up before the loop (fast.py's
        # prelude), their gradient summed in another order: eager's up to rounding.
        tol = {} if templates == "exact" else {"rtol": 1e-5, "atol": 1e-7}
        report = check_module(TeacherForced, lambda i: A(_tokens(i), 5, [0.5, 2.5, 4.0, 6.0, 99.0][i % 5]),
                              calls=CALLS, grad=True, **tol)
    no_internal_error(report)


@TEMPLATES
def test_greedy_gru_with_dropout(templates):
    def make(i):
        g = torch.Generator().manual_seed(i)
        return A(torch.randn(1, 6, generator=g), torch.randint(0, 4, (4 + i % 4, 1), generator=g), 6)
    with specularch.config.patch(templates=templates):
        report = check_module(Greedy, make, calls=CALLS, grad=True)
    no_internal_error(report)


def test_stop_token_from_a_module_attribute():
    eos = [11, 11, 11, 11, 12, 13, 11, 10, 11, 14, 11, 11, 12, 11, 11, 11, 99, 11]

    def between(m, i):
        m.eos = eos[i % len(eos)]
    report = check_module(EosAttr, int_args, calls=CALLS, between=between)
    stopped_in_many_places(one_rolled_graph(report, captures=(1, 2)))
