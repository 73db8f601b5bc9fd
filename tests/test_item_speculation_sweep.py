"""Adversarial differential sweep of tests on ``.item()`` values speculated like branches on
tensor values (``symbolic/speculation/item_args.speculated``): comparisons, truth tests,
recipes, outcomes stored, inside loops (fixed, varying, rolled, while), modules, helpers,
try/with, merged branches, recursion, RNG, compiled backends and ``exact=True``.

Every case is differential (``differential.check``): eager and optimized run on identical
inputs, and everything a user can observe must be the same. Inputs are chosen so that the
test holds on the first calls (graphs) and flips on later ones (the flip must be detected
and the call must be eager's, with nothing committed)."""
import math
import random

import pytest
import torch
from torch import nn

import specularch
from differential import A, Pair, T, check, check_module, marker_line
from speculation_helpers import carried_globals

pytestmark = pytest.mark.usefixtures("no_profiling")

EOS = 3
TOL = 0.05
calls_seen = 0
log = []
best = 1.0e9
saved = []
running = 0.0


def late(i, every=2):
    """+1 on the first 6 calls (graphs), then -1 on every ``every``-th call."""
    return -1.0 if i >= 6 and i % every == 0 else 1.0


def kinds(report):
    return [f.kind for f in report.fallbacks]


def no_internal_error(report):
    assert "internal_error" not in kinds(report), report


# ------------------------------------------------------------------ decoding loops

def greedy(table, steps):
    tok = torch.tensor(0)
    out = []
    for _ in range(steps):
        tok = table[tok].argmax()
        out.append(tok)
        if tok.item() == EOS:  # eos
            break
    return torch.stack(out)


TABLE_LOOP = torch.eye(5)[[1, 2, 0, 4, 1]]  # 0 -> 1 -> 2 -> 0: never EOS
TABLE_EOS = torch.eye(5)[[1, 2, 3, 4, 1]]   # 0 -> 1 -> 2 -> 3: EOS at step 3


def test_eos_break_over_a_fixed_number_of_steps():
    """A loop whose body ends with the ``break`` test rolls with an exit check
    (``rolled/exits.py``, even over a constant trip count): the calls that reach EOS stop
    where eager does, in the same graph (before, each failed the "no EOS" assumption)."""
    report = check(greedy, lambda i: A((TABLE_EOS if i in (6, 9) else TABLE_LOOP).clone(), 5),
                   calls=12)
    assert report.stats.graph_hits >= 8 and not report.fallbacks, report
    (loop,) = report.graphs[0].loops
    assert loop.rolled and 3 in loop.trips and 5 in loop.trips, loop


def test_eos_break_over_a_varying_number_of_steps():
    report = check(greedy, lambda i: A((TABLE_EOS if i in (7, 11) else TABLE_LOOP).clone(),
                                       2 + i % 4), calls=14)
    assert report.stats.graph_hits >= 3, report


def decode_collect(table, steps, tokens):
    """The outcome followed by appends to an argument list and an int counter."""
    tok = torch.tensor(1)
    count = 0
    for _ in range(steps):
        tok = table[tok].argmax()
        if tok.item() == EOS:
            tokens.append(-1)
            break
        tokens.append(tok.item())
        count += 1
    return count


def test_eos_break_with_appends_to_an_argument_list():
    check(decode_collect, lambda i: A((TABLE_EOS if i in (7, 10) else TABLE_LOOP).clone(),
                                      3 + i % 3, [7]), calls=12)


def comp_break(x, n):
    outs = []
    for i in range(n):
        v = x[i]
        if v.item() == 3:
            break
        outs.append(v * 2)
    return outs


def test_break_on_a_value_in_a_varying_loop_over_an_int_tensor():
    def make(i):
        x = torch.tensor([0, 1, 2, 4, 5, 6, 7, 1])
        if i >= 8:
            x[3] = 3
        return A(x, 3 + i % 4)
    check(comp_break, make, calls=14)


# ------------------------------------------------------------------ while loops on .item()

def halve_until(err, tol):
    steps = 0
    while err.item() > tol:
        err = err * 0.5
        steps += 1
    return err, steps


def test_while_loop_with_an_item_condition_iterations_vary():
    check(halve_until, lambda i: A(torch.tensor(0.07 if i < 6 else 0.04 * (1 + i % 5) ** 2), TOL),
          calls=12)


def while_compound(x, n):
    i = 0
    while i < n and x[i].item() > 0:
        i += 1
    return i


def test_while_loop_with_a_counter_and_an_item_test():
    def make(i):
        x = T(8).abs() + 0.1
        if i >= 6 and i % 2 == 0:
            x[2] = -1.0
        return A(x, 3 + i % 4)
    check(while_compound, make, calls=12)


def newton(x, a):
    """Newton's iteration until the update is small, at most 8 steps."""
    for _ in range(8):
        step = (x * x - a) / (2 * x)
        x = x - step
        if step.abs().max().item() < 1e-3:
            break
    return x


def test_newton_loop_with_break_on_a_small_step():
    check(newton, lambda i: A(torch.ones(3) * (1.4 if i < 6 else 1 + i), torch.full((3,), 2.0)),
          calls=10)


# ------------------------------------------------------------------ side effects after a test

def append_if_positive(x, seen):
    if x.sum().item() > 0:
        seen.append(x.sum())
        seen.append("pos")
    return x * 2


def test_list_append_after_a_test_is_not_committed_when_it_flips():
    report = check(append_if_positive, lambda i: A(T(3).abs() * late(i), []), calls=12)
    assert report.stats.graph_hits >= 5, report


def count_global(x):
    global calls_seen
    if x.max().item() > 0.5:
        calls_seen += 1
        log.append(calls_seen)
    return x + calls_seen


def test_global_counter_after_a_test():
    report = check(count_global, lambda i: A((T(4).abs() + 1) * late(i)), calls=12,
                   state=carried_globals(__name__, calls_seen=0, log=[]))
    assert report.stats.graph_hits >= 3, report


def best_loss(x):
    global best
    loss = (x * x).mean()
    if loss.item() < best:
        best = loss.item()
        saved.append(loss.detach())
        print("new best", best)
    return loss


def test_best_loss_global_updated_after_a_test():
    report = check(best_loss, lambda i: A(torch.ones(3) / (i + 1) if i < 7 else torch.ones(3) * 5),
                   calls=12, state=carried_globals(__name__, best=1.0e9, saved=[]))
    assert report.stats.graph_hits >= 3, report


def ema(x):
    global running
    running = 0.9 * running + x.sum().item()
    if running > 5.0:
        print("above")
        return x * 0
    return x


def test_running_average_recipe_tested_against_a_limit():
    check(ema, lambda i: A(torch.ones(2) * (0.1 if i < 7 else 30)), calls=12,
          state=carried_globals(__name__, running=0.0))


def printing(x):
    m = x.mean()
    if m.item() >= 0:
        print("non-negative", m.item())
    else:
        print("negative")
    return m


def test_print_after_a_test():
    report = check(printing, lambda i: A(T(5).abs() * late(i, 3)), calls=12)
    assert report.stats.graph_hits >= 5, report


def inplace_after_test(x, y):
    if x.sum().item() > 0:
        y.add_(1)
        x.mul_(2)
    else:
        y.sub_(1)
    return y.sum()


def test_in_place_update_of_arguments_after_a_test():
    report = check(inplace_after_test, lambda i: A(T(3).abs() * late(i), T(2)), calls=12)
    assert report.stats.graph_hits >= 5, report


def inplace_before_test(x):
    x.add_(1)
    if x.sum().item() > 0:  # reads x after the add_
        return x * 2
    return x - 100


def test_in_place_update_before_the_test_is_seen_by_the_graph_s_item():
    # x.sum() is -0.5 before the add and +1.5 after it: the test must read the updated x
    report = check(inplace_before_test,
                   lambda i: A(torch.full((2,), -1.0 if i in (6, 10) else -0.25)), calls=12)
    assert report.stats.graph_hits >= 5, report


def item_then_modify(x):
    v = x[0].item()
    x.mul_(-1)  # after the read
    if v > 0:
        return x + 1
    return x - 1


def test_item_read_before_an_in_place_write_of_the_same_tensor():
    report = check(item_then_modify, lambda i: A((T(3).abs() + 0.1) * late(i)), calls=12)
    assert report.stats.graph_hits >= 5, report


def item_of_input_after_inplace(x):
    x.sub_(0.5)
    if x.item() > 0:
        x.mul_(10)
    return x


def test_item_of_an_input_after_an_in_place_write():
    report = check(item_of_input_after_inplace,
                   lambda i: A(torch.tensor(0.3 if i in (6, 9) else 0.7)), calls=12)
    assert report.stats.graph_hits >= 5, report


def manual_sgd(w, x):
    loss = (w * x).sum()
    loss.backward()
    with torch.no_grad():
        w -= 0.5 * w.grad
    if w.sum().item() > 0:  # reads w after the update
        w.grad.zero_()
        return loss.detach() + 1
    return loss.detach()


def test_manual_sgd_update_then_a_test_on_the_parameter():
    report = check(manual_sgd, lambda i: A(torch.ones(2, requires_grad=True),
                                           torch.ones(2) * (3.0 if i in (6, 9) else 1.0)), calls=12)
    assert report.stats.graph_hits >= 5, report


def optimizer_step_conditional(model, opt, x, limit):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    if loss.item() < limit:
        opt.step()
    return loss.detach()


def test_optimizer_step_after_a_test_is_not_committed_when_it_flips():
    def make_pair():
        torch.manual_seed(0)
        m = nn.Linear(3, 1)
        return m, torch.optim.Adam(m.parameters(), lr=0.1)

    me, oe = make_pair()
    mo, oo = make_pair()
    opt = specularch.optimize(lambda x, limit: optimizer_step_conditional(mo, oo, x, limit))
    pair = Pair("optimizer_step_conditional", lambda x, limit: optimizer_step_conditional(
        me, oe, x, limit), opt, opt, eager_roots={"m": me}, opt_roots={"m": mo})
    for i in range(12):
        pair.step(lambda i=i: A(T(4, 3) * (10.0 if i in (6, 10) else 0.1), 1.0))
        se, so = oe.state_dict()["state"], oo.state_dict()["state"]
        assert se.keys() == so.keys()
        for k in se:
            for name, v in se[k].items():
                assert torch.equal(v, so[k][name]), (i, k, name)
        for pe, po in zip(me.parameters(), mo.parameters()):
            assert torch.equal(pe.grad, po.grad), i
    report = pair.explain()
    no_internal_error(report)
    assert report.stats.graph_hits >= 3, report


def grad_write_after_test(w, x):
    loss = (w * x).sum()
    loss.backward()
    if loss.item() > 0:
        w.grad.mul_(0.5)
    else:
        w.grad = None
    return loss.detach()


def test_grad_write_after_a_test():
    report = check(grad_write_after_test,
                   lambda i: A(torch.ones(3, requires_grad=True), T(3).abs() * late(i)), calls=12)
    assert report.stats.graph_hits >= 5, report


def param_read_after_step(model, opt, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if model.weight.sum().item() > 0:  # the parameter as updated by the step
        return model.weight.sum() * 2
    return model.weight.sum() * 0


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1),
                                      lambda p: torch.optim.Adam(p, lr=0.02)],
                         ids=["sgd", "adam"])
def test_test_on_a_parameter_after_optimizer_step_reads_the_updated_value(make_opt):
    # the weight's sum goes 0.15, 0.13, ..., 0.01 then -0.01 *after* the 8th step: a graph
    # reading the weight before the step would miss the flip
    def make_pair():
        m = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            m.weight.copy_(torch.tensor([[0.15, 0.0]]))
        return m, make_opt(m.parameters())

    me, oe = make_pair()
    mo, oo = make_pair()
    opt = specularch.optimize(lambda x: param_read_after_step(mo, oo, x))
    pair = Pair("param_read_after_step", lambda x: param_read_after_step(me, oe, x), opt, opt,
                eager_roots={"m": me}, opt_roots={"m": mo})
    for _ in range(11):
        pair.step(lambda: A(torch.tensor([[0.2, 0.0]])))
    report = pair.explain()
    no_internal_error(report)
    assert report.stats.graph_hits >= 4 and "assumption_failed" in kinds(report), report


# ------------------------------------------------------------------ NaN / inf

def nan_guard(x):
    loss = x.log().sum()
    if loss.item() != loss.item():
        return torch.zeros(())
    return loss


def test_nan_self_comparison():
    report = check(nan_guard, lambda i: A(T(3) if i in (6, 10) else T(3).abs() + 0.1), calls=12)
    assert report.stats.graph_hits >= 5, report


def isnan_guard(x):
    loss = x.log().sum()
    if math.isnan(loss.item()) or not math.isfinite(loss.item()):
        return torch.zeros(())
    return loss


def test_math_isnan_and_isfinite():
    def make(i):
        if i in (6, 9):
            return A(torch.tensor([0.0, 1.0, 2.0]))  # -inf
        if i == 10:
            return A(torch.tensor([-1.0, 1.0, 2.0]))  # nan
        return A(T(3).abs() + 0.1)
    report = check(isnan_guard, make, calls=12)
    assert report.stats.graph_hits >= 5, report


def truth_of_nan(x):
    v = x.sum()
    if v.item():  # NaN and inf are truthy, 0.0 and -0.0 are not
        return v + 1
    return v - 1


def test_truth_of_nan_zero_and_negative_zero():
    vals = [1.0, float("nan"), 2.0, float("inf"), float("nan"), 5.0, -0.0, 3.0, 0.0, 1.0]
    report = check(truth_of_nan, lambda i: A(torch.tensor([vals[i]])), calls=10)
    assert report.stats.graph_hits >= 5, report


def inf_compare(x):
    if x.max().item() == float("inf"):
        return x.clamp(max=1e4)
    return x


def test_comparison_with_inf():
    report = check(inf_compare, lambda i: A(torch.tensor([1.0, float("inf") if i in (6, 9) else 2.0])),
                   calls=12)
    assert report.stats.graph_hits >= 5, report


# ------------------------------------------------------------------ int / bool / float / None / str

def int_vs_float(n, x):
    k = n.sum().item()  # an int
    if k == 2.0:
        x = x + 1
    if k > 1.5:
        x = x * 2
    return x, k


def test_int_item_compared_with_floats():
    report = check(int_vs_float, lambda i: A(torch.tensor([1, 0 if i in (6, 9) else 1]), T(2)),
                   calls=12)
    assert report.stats.graph_hits >= 5, report


def bool_item(flags, x):
    f = flags.any().item()
    if f == True:  # noqa: E712
        x = x + 1
    if not flags.all().item():
        x = x - 1
    return x, f


def test_bool_items_compared_with_true_and_not():
    report = check(bool_item, lambda i: A(torch.tensor([True, i not in (6, 9)]), T(2)), calls=12)
    assert report.stats.graph_hits >= 5, report


def bool_is(flags, x):
    if flags.any().item() is True:
        x = x * 3
    return x


def test_bool_item_is_true():
    check(bool_is, lambda i: A(torch.tensor([True, False]), T(2)), calls=3)


def ints_identical(a, b):
    return a.item() is b.item()


def test_small_int_items_identical():
    check(ints_identical, lambda: A(torch.tensor(1), torch.tensor(1)), calls=3)


def low_precision(h, b, d):
    out = 0
    if h.item() > 0.1:  # float16: the item is the float16 value, not 0.1
        out += 1
    if b.item() == 0.1:
        out += 10
    if d.item() < 0.1:
        out += 100
    return h.float() + out


def test_float16_bfloat16_float64_items():
    def make(i):
        v = 0.1 + (0.001 if i < 6 else -0.001 if i % 2 else 0.0)
        return A(torch.tensor(v, dtype=torch.float16), torch.tensor(v, dtype=torch.bfloat16),
                 torch.tensor(v, dtype=torch.float64))
    report = check(low_precision, make, calls=10)
    assert report.stats.graph_hits >= 5, report


def none_and_str(x):
    v = x.sum().item()
    a = v is None
    b = v is not None
    c = v == None  # noqa: E711
    d = v != "zero"
    return x + a + b, c, d


def test_item_compared_with_none_and_a_string():
    check(none_and_str, lambda: A(T(3)), calls=4)


BIG = 2 ** 53


def big_ints(n):
    v = n.item()
    out = []
    if v == BIG + 1.0:  # the float is 2**53: int == float compares exactly
        out.append("float-equal")
    if v > BIG:
        out.append("greater")
    if v == BIG + 1:
        out.append("int-equal")
    return out


def test_big_int_items_beyond_2_53():
    report = check(big_ints, lambda i: A(torch.tensor(BIG + (1 if i < 6 else i % 3), dtype=torch.int64)),
                   calls=10)
    assert report.stats.graph_hits >= 5, report


def varying_eos(table, steps, eos):
    tok = torch.tensor(0)
    n = 0
    for _ in range(steps):
        tok = table[tok].argmax()
        n += 1
        if tok.item() == eos:
            break
    return tok, n


def test_eos_an_argument_that_changes():
    # eos 3 and 4 are never reached (the test holds, eos a graph input once it changed);
    # then eos 2 is reached at step 2
    report = check(varying_eos, lambda i: A(TABLE_LOOP.clone(), 5, 2 if i in (8, 11) else 3 + i % 2),
                   calls=12)
    assert report.stats.graph_hits >= 4, report


def varying_limit(x, limit):
    if x.sum().item() > limit:
        return x * 0
    return x


def test_float_limit_an_argument_that_changes():
    report = check(varying_limit, lambda i: A(torch.ones(2), 2.5 if i in (7, 9) else 1.5 + i / 100),
                   calls=10)
    assert report.stats.graph_hits >= 3, report


def complex_order(c):
    return c.item() < 1


def test_ordering_a_complex_item_raises_like_eager_without_internal_error():
    check(complex_order, lambda: A(torch.tensor(1 + 1j)), calls=3)


def complex_truth(c, x):
    if c.item():
        return x + 1
    return x


def test_truth_of_a_complex_item():
    check(complex_truth, lambda i: A(torch.tensor(0j if i in (6, 9) else 1j), T(2)), calls=10)


# ------------------------------------------------------------------ forms of the test

def chained(x):
    v = x.mean().item()
    if 0 < v < 1:
        return x * 2
    return x


def test_chained_comparison():
    vals = [0.5, 0.6, 0.7, 0.8, 0.9, 0.4, 1.5, 0.5, -0.5]
    report = check(chained, lambda i: A(torch.full((2,), vals[i])), calls=9)
    assert report.stats.graph_hits >= 5, report


def contains(t):
    if t.item() in (1, 2):
        return t + 10
    return t


def test_in_tuple_falls_back():
    check(contains, lambda i: A(torch.tensor(i % 4)), calls=6)


def builtin_recipes(x):
    v = x.sum().item()
    out = []
    if abs(v) > 1:
        out.append("abs")
    if round(v) == 3:
        out.append("round")
    if int(v) == 2:
        out.append("int")
    if v // 1 == 2 and v % 1 > 0.5:
        out.append("floordiv-mod")
    if v ** 2 > 6:
        out.append("pow")
    if math.floor(v) == 2:
        out.append("floor")
    if 0.9 * v + x.max().item() > 4:
        out.append("recipe")
    if (v > 0) + (v > 2) == 2:
        out.append("bools added")
    return out


def test_tests_on_builtin_recipes():
    vals = [2.7, 2.6, 2.9, 2.55, 2.8, 2.75, 0.5, -3.2, 1.5, 2.5, 3.5]
    report = check(builtin_recipes, lambda i: A(torch.tensor([vals[i], 0.0], dtype=torch.float64)),
                   calls=11)
    assert report.stats.graph_hits >= 4, report


def min_recipe(x):
    if min(x.sum().item(), 3) > 2:  # float or int: not a stable type
        return x + 1
    return x


def test_min_of_an_item_and_an_int_falls_back():
    check(min_recipe, lambda i: A(torch.tensor([2.5 + i])), calls=4)


def stored_outcomes(x, flags):
    v = x.sum().item()
    flags.append(v > 0)
    pos = v > 0
    label = ["neg", "pos"][v > 0]
    scaled = (v > 0) * 2
    other = "big" if v > 1 else "small"
    return pos, label, scaled, other, {v > 0: "key"}


def test_outcomes_stored_returned_indexed_and_used_in_arithmetic():
    vals = [1.5, 2.0, 1.2, 3.0, 1.1, 1.7, 0.5, -0.5, 2.0]
    report = check(stored_outcomes, lambda i: A(torch.tensor([vals[i]]), []), calls=9)
    assert report.stats.graph_hits >= 5, report


def conversions(t, x):
    if bool(t.item()):
        x = x + 1
    k = int(t.item() > 0) + float(t.item() < 0)
    if float(t.sum()) > 0.5:
        x = x * 2
    return x, k


def test_bool_int_float_of_items_and_outcomes():
    report = check(conversions, lambda i: A(torch.tensor(0.0 if i in (6, 9) else 1.0), T(2)), calls=10)
    assert report.stats.graph_hits >= 5, report


# compiled outside pytest's assertion rewriting (which puts object addresses in the message)
exec(compile("def asserting(x):\n    assert x.min().item() > 0, 'x must be positive'\n"
             "    return x.log()\n", __file__ + ":asserting", "exec"), globals())


def test_assert_that_passes_and_one_that_fails():
    report = check(asserting, lambda i: A((T(3).abs() + 0.1) * late(i, 3)), calls=12)  # noqa: F821
    assert report.stats.graph_hits >= 5, report


def raising(x):
    if x.max().item() > 3:
        raise ValueError(f"too big: {x.max().item():.3f}")
    return x + 1


def test_raise_when_a_test_holds():
    report = check(raising, lambda i: A(T(3).clamp(max=2.5) + (4 if i in (6, 9) else 0)), calls=12)
    assert report.stats.graph_hits >= 5, report


def div_guard(t, x):
    v = t.item()
    if v != 0 and 1.0 / v > 0.5:  # the graph computes 1.0 / v even when v == 0
        return x * 2
    return x


def test_a_recipe_short_circuited_by_a_flipped_test_is_a_failed_assumption():
    report = check(div_guard, lambda i: A(torch.tensor(0.0 if i >= 6 else 1.0), T(2)), calls=10)
    assert "backend_error" not in kinds(report), report
    assert "assumption_failed" in kinds(report), report


def _helper(v, x):
    if v.item() > 0:
        return x + 1
    return x - 1


def helper_caller(a, b, x):
    return _helper(a.sum(), x), _helper(b.sum(), x)


def test_test_inside_an_inlined_helper_called_twice():
    report = check(helper_caller, lambda i: A(T(2).abs() + 0.1, (T(2).abs() + 0.1) * late(i, 3), T(2)),
                   calls=12)
    assert report.stats.graph_hits >= 5, report


def closure(x):
    def positive():
        return x.sum().item() > 0
    if positive():
        return x + 1
    return x - 1


def test_test_inside_a_closure():
    report = check(closure, lambda i: A(T(3).abs() * late(i)), calls=12)
    assert report.stats.graph_hits >= 5, report


@specularch.optimize
def _inner_optimized(x):
    if x.sum().item() > 0:
        return x + 1
    return x - 1


def outer(x):
    return _inner_optimized(x) * 2


def test_test_inside_an_optimized_function_called_by_another():
    report = check(outer, lambda i: A(T(3).abs() * late(i)), calls=12)
    assert report.stats.graph_hits >= 5, report


def in_try(x):
    try:
        if x.sum().item() > 0:
            raise KeyError("positive")
        y = x * 2
    except KeyError:
        y = x - 1
        print("caught")
    return y


def test_test_inside_try_except():
    check(in_try, lambda i: A(T(3).abs() * late(i)), calls=12)


def try_finally(x):
    try:
        if x.sum().item() > 0:
            return x * 2
        return x
    finally:
        print("finally")


def test_return_inside_try_finally():
    report = check(try_finally, lambda i: A(T(3).abs() * late(i)), calls=12)
    assert report.stats.graph_hits >= 5, report


def in_no_grad(w, x):
    y = w * x
    with torch.no_grad():
        if y.sum().item() > 0:
            w.mul_(0.5)
            return (w * x).sum()
    return (w * x).sum()


def test_test_and_early_return_inside_no_grad():
    report = check(in_no_grad, lambda i: A(torch.ones(3, requires_grad=True), T(3).abs() * late(i)),
                   calls=12)
    assert report.stats.graph_hits >= 5, report


def grad_mode_switch(x):
    torch.set_grad_enabled(False)
    if x.sum().item() > 0:
        torch.set_grad_enabled(True)
        return x * 2
    return x * 3


def test_grad_mode_switched_after_a_test():
    report = check(grad_mode_switch, lambda i: A(T(3).abs() * late(i)), calls=12)
    assert report.stats.graph_hits >= 5, report


# ------------------------------------------------------------------ modules

class Clip(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.clipped = 0
        self.history = []

    def forward(self, x):
        y = self.fc(x)
        if y.abs().max().item() > 2.0:
            self.clipped += 1
            y = y.clamp(-2, 2)
        self.history.append(y.sum().item())
        self.last_big = y.abs().max().item() > 1.0
        return y


def test_module_forward_with_grad():
    report = check_module(Clip, lambda i: A(T(4, 3) * (5 if i in (6, 10) else 0.3)), calls=12, grad=True)
    assert report.stats.graph_hits >= 3, report


class TrainStep(nn.Module):
    """A module whose forward does the whole step, skipping it on a huge loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 1)
        self._opt = torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)
        self.skipped = 0

    def forward(self, x, y):
        self._opt.zero_grad()
        loss = nn.functional.mse_loss(self.net(x), y)
        if loss.item() > 10.0:
            self.skipped += 1
            return loss.detach()
        loss.backward()
        self._opt.step()
        return loss.detach()


def test_module_skipping_an_optimizer_step_on_a_huge_loss():
    report = check_module(TrainStep, lambda i: A(T(4, 3), T(4, 1) * (30 if i in (7, 12) else 1)),
                          calls=15)
    assert report.stats.graph_hits >= 3, report


class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.n = 0

    def forward(self, x):
        y = self.fc(x)
        if y.mean().item() > -0.5:
            self.n += 1
            return torch.relu(y)
        return y


class Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Sub(), Sub()

    def forward(self, x):
        return self.b(self.a(x))


def test_tests_in_two_submodules_sharing_one_site():
    report = check_module(Top, lambda i: A(T(2, 3) * (20 if i in (7, 10) else 0.1)), calls=12, grad=True)
    assert report.stats.graph_hits >= 3, report


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self._gen = torch.Generator().manual_seed(0)
        self.kept = []

    def forward(self, x):
        r = torch.rand((), generator=self._gen)
        if r.item() < 0.6:
            self.kept.append(r.item())
            return x * r
        return x


def test_test_on_a_draw_from_a_generator_falls_back():
    check_module(Drop, lambda: A(T(2)), calls=8, expect="fallback", fallback_kind="data_dependent_branch")


# ------------------------------------------------------------------ merged branches, recursion, loops

def merged(x, y):
    if x.sum() > 0:
        if y.sum().item() > 0:
            out = x + y
        else:
            out = x - y
    else:
        out = x * 2
    return out


def test_item_test_inside_a_tensor_branch_that_merges():
    check(merged, lambda i: A(T(3).abs() * late(i, 2), T(3).abs() * late(i, 3)), calls=14)


def after_merge(x):
    if x.sum() > 0:
        y = x + 1
    else:
        y = x - 1
    if y.max().item() > -50:
        return y * 2
    return y


def test_item_test_after_a_merged_tensor_branch():
    report = check(after_merge, lambda i: A(T(3).abs() * (1 if i % 2 else -0.1)
                                            - (1000 if i in (9, 12) else 0)), calls=14)
    assert report.stats.graph_hits >= 3, report


class Node:
    def __init__(self, value, left=None, right=None):
        self.value, self.left, self.right = value, left, right


def tree_sum(node):
    if node is None:
        return torch.zeros(())
    s = tree_sum(node.left) + tree_sum(node.right)
    if node.value.item() > 0:
        return s + node.value
    return s - node.value


def make_tree(depth, negative):
    if depth == 0:
        return None
    value = T(()).abs() + 0.1
    return Node(-value if negative and depth == 1 else value,
                make_tree(depth - 1, negative), make_tree(depth - 1, False))


def test_recursion_over_a_tree_with_a_test_at_each_node():
    report = check(tree_sum, lambda i: A(make_tree(2 + i % 2, i >= 6 and i % 3 == 0)), calls=12)
    assert report.stats.graph_hits >= 3, report


def per_element(x, n):
    acc = torch.zeros(())
    for i in range(n):
        if x[i].item() > 0:
            acc = acc + x[i]
        else:
            acc = acc - x[i]
    return acc


def test_per_iteration_test_in_a_rolled_loop():
    # positive for the first calls (the loop rolls, the test checked in every iteration),
    # then a negative element at an iteration past the first
    def make(i):
        x = T(6).abs() + 0.1
        if i >= 6 and i % 2 == 0:
            x[3] = -1.0
        return A(x, 3 + i % 3)
    report = check(per_element, make, calls=14)
    assert report.stats.graph_hits >= 3, report


def flags_in_loop(x, n):
    flags = []
    k = 0
    for i in range(n):
        flags.append(x[i].item() > 0)
        k += x[i].item() > 0
    return flags, k


def test_outcomes_stored_in_a_varying_loop():
    signs = [[1, -1, 1, 1, -1, 1, 1, 1], [1, 1, 1, -1, 1, 1, -1, 1]]
    check(flags_in_loop, lambda i: A(torch.ones(8) if i < 8 else torch.tensor(signs[i % 2], dtype=torch.float32),
                                     2 + i % 5), calls=14)


def list_filters(xs):
    kept = [t * 2 for t in xs if t.item() > 0]
    return kept, any(t.item() < 0 for t in xs), all(t.item() > 0 for t in xs), sum(1 for t in xs if t.item() > 0)


def test_comprehension_filters_and_any_all_sum():
    def make(i):
        xs = [T(()).abs() + 0.1 for _ in range(3 + i % 3)]
        if i >= 6 and i % 2 == 0:
            xs[1] = -xs[1]
        return A(xs)
    check(list_filters, make, calls=12)


def zipped(xs, ys):
    out = []
    for a, b in zip(xs, ys):
        out.append(a if a.item() < b.item() else b)
    return out


def test_two_item_values_per_iteration_of_a_zip_loop():
    def make(i):
        n = 2 + i % 4
        xs = [torch.tensor(float(k)) for k in range(n)]
        ys = [torch.tensor(float(k) + (-1 if i >= 8 and k == 1 else 1)) for k in range(n)]
        return A(xs, ys)
    check(zipped, make, calls=14)


def accumulate_and_stop(xs, n, limit):
    total = 0.0
    k = 0
    for i in range(n):
        total += xs[i].item()
        k += 1
        if total > limit:
            break
    return total, k


def test_break_on_an_accumulated_item_recipe():
    check(accumulate_and_stop,
          lambda i: A(torch.ones(8) * 0.5, 4 + i % 3, 1.2 if i in (7, 10) else 10.0), calls=12)


def reuse_after_loop(x, n):
    v = x.sum().item()
    w = v * 0.5
    acc = torch.zeros(())
    for i in range(n):
        if v > 0:
            acc = acc + x[i]
        if w < 100:
            acc = acc + 1
    if v > 1:
        acc = acc * 2
    return acc + torch.full((), v) + w


def test_one_item_value_tested_in_a_loop_and_after_it():
    check(reuse_after_loop,
          lambda i: A(torch.ones(6) * (1.0 if i < 7 else -0.1 if i % 2 else 0.1), 2 + i % 4), calls=14)


# ------------------------------------------------------------------ RNG

def random_then_test(x):
    r = torch.rand(())
    if r.item() < 0.5:
        return x + torch.randn(2)
    return x - r


def test_test_on_a_random_draw_restores_the_rng_on_a_flip():
    check(random_then_test, lambda: A(T(2)), calls=12)


def dropout_then_test(x):
    y = torch.nn.functional.dropout(x, 0.5, training=True)
    if y.sum().item() > 0:
        return y + torch.rand(2)
    return y


def test_dropout_then_a_test():
    check(dropout_then_test, lambda: A(T(2).abs() + 0.1), calls=12)


def python_random_and_test(x):
    u = random.random()
    if x.sum().item() > u:
        return x + random.random()
    return x


def test_test_against_a_python_random_draw():
    check(python_random_and_test, lambda i: A(torch.full((1,), 0.1 if i in (6, 9) else 1.1)), calls=12)


# ------------------------------------------------------------------ records, backends, exact

def rarely(x):
    m = x.abs().max()
    if m.item() > 3.5:  # site
        return m
    return x.sum()


def test_fallback_records_point_at_the_test_and_hits_are_counted():
    report = check(rarely, lambda i: A(T(3) * (10 if i in (8, 12) else 0.1)), calls=16)
    assert report.stats.graph_hits >= 7, report
    line = marker_line(rarely, "site")
    failed = [f for f in report.fallbacks if f.kind == "assumption_failed"]
    assert failed and all(f.lineno == line for f in failed), report
    assert "is False, but it was True" in failed[0].explanation
    # the flip's next capture merges the two returns (torch.where): no more fallbacks
    assert not [f for f in report.fallbacks if f.kind != "assumption_failed"], report
    assert "torch.where(" in report.graphs[-1].code, report


@pytest.mark.parametrize("backend", ["torchscript", "inductor"])
def test_compiled_backends(backend):
    report = check(greedy, lambda i: A((TABLE_EOS if i in (5, 7) else TABLE_LOOP).clone(), 4),
                   calls=8, backend=backend)
    no_internal_error(report)
    assert report.stats.graph_hits >= 3, report


def test_exact_mode():
    opt = specularch.optimize(per_element, exact=True)
    pair = Pair("per_element exact", per_element, opt, opt)

    def make(i):
        x = T(6).abs() + 0.1
        if i >= 7 and i % 2 == 0:
            x[2] = -1.0
        return A(x, 3 + i % 3)
    for _ in range(12):
        pair.step(make)
    report = pair.explain()
    no_internal_error(report)
    assert report.stats.graph_hits >= 3, report
