"""Adversarial differential sweep of random.random() / random.uniform() capture
(guards/draws.py, symbolic/library/python_random.py): every case runs eager and optimized
from the same seeds and compares results, exceptions, the heap, stdout, torch's RNG and
Python's generator state after each call (``differential.check``)."""
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch

from differential import A, T, check, check_module, module_globals

torch.manual_seed(0)
LIN = nn.Linear(3, 3)
N = 24


# ----------------------------------------------------------------- helpers, closures, methods

def _helper(x):
    if random.random() < 0.5:
        return x * 2
    return x + random.random()


def nested_helper(x):
    return _helper(x) - _helper(x + 1)


def test_draws_in_inlined_helpers():
    check(nested_helper, lambda: A(T(3)), calls=N, expect="graph")


def _make_closure(scale):
    def inner(x):
        return x * scale * random.random()
    return inner


CLOSURE = _make_closure(3.0)


def calls_closure(x):
    bump = random.random()
    f = lambda y: y + bump * random.random()  # noqa: E731
    return CLOSURE(x) + f(x)


def test_draws_in_closures_and_lambdas():
    check(calls_closure, lambda: A(T(3)), calls=N, expect="graph")


class Noise:
    def __init__(self, p):
        self.p = p
        self.fired = 0

    def maybe(self, x):
        if random.random() < self.p:
            self.fired += 1
            return x * 0
        return x


def method_draw(x, noise):
    return noise.maybe(x) + noise.maybe(x + 1)


def test_draws_in_a_user_class_method_writing_self():
    check(method_draw, lambda: A(T(3), Noise(0.4)), calls=N, expect="graph")


# ----------------------------------------------------------------- comprehensions, sorting, loops

def comprehension(x):
    ws = [random.random() for _ in range(3)]
    return x * ws[0] + x * ws[1] - ws[2], sum(w > 0.5 for w in ws)


def test_list_comprehension_and_generator_expression_of_draws():
    check(comprehension, lambda: A(T(3)), calls=N, expect="graph")


def shuffle_by_key(x):
    order = sorted(range(3), key=lambda _: random.random())
    return x[order], order


def test_sorted_with_a_drawing_key():
    check(shuffle_by_key, lambda: A(T(3)), calls=N)


def max_by_key(xs):
    return max(xs, key=lambda _: random.random())


def test_max_with_a_drawing_key():
    check(max_by_key, lambda: A([T(2), T(2), T(2)]), calls=N)


def while_break(x):
    n = 0
    while n < 4:
        if random.random() < 0.4:
            break
        x = x * 1.5
        n += 1
    return x, n


def test_while_loop_that_breaks_on_a_draw():
    check(while_break, lambda: A(T(2)), calls=40, expect="graph")


def drawn_trip_count(x):
    for _ in range(int(random.random() * 4)):
        x = x + 1
    return x


def test_loop_whose_trip_count_is_drawn():
    check(drawn_trip_count, lambda: A(T(2)), calls=N)


def test_loop_whose_trip_count_is_drawn_gets_one_graph_per_trip_count():
    report = check(drawn_trip_count, lambda: A(T(2)), calls=N, expect="graph")
    assert report.stats.graph_hits > 0


# ----------------------------------------------------------------- draws into tensor ops

def drawn_size(x):
    r = random.random()
    return torch.zeros(int(r * 3) + 1) + x.sum()


def test_a_draw_as_a_size():
    check(drawn_size, lambda: A(T(2)), calls=N)


def full_of_draw(x):
    return torch.full((2,), random.random()) * x, torch.where(x > 0, x, random.random())


def test_a_draw_in_torch_full_and_where():
    check(full_of_draw, lambda: A(T(2)), calls=N, expect="graph")


def dropout_p(x):
    return F.dropout(x, p=random.random() * 0.9, training=True)


def test_dropout_with_a_drawn_p_keeps_both_generators():
    check(dropout_p, lambda: A(T(8)), calls=N)


def mixed_generators(x):
    a = torch.rand(2)
    if random.random() < 0.5:
        a = a + torch.rand(2)
    return x * a * random.random() + torch.randn(2)


def test_torch_and_python_generators_together():
    check(mixed_generators, lambda: A(T(2)), calls=N, expect="graph")


def two_draws_compared(x):
    a, b = random.random(), random.random()
    if a < b:
        return x * a
    return x * b


def test_a_draw_compared_to_another_draw():
    check(two_draws_compared, lambda: A(T(2)), calls=N, expect="graph")


def vs_argument(x, ratio):
    if random.random() < ratio:
        return x * 2
    return x - 1


def test_a_draw_compared_to_a_varying_number_argument():
    check(vs_argument, lambda i: A(T(2), (i % 7) / 7), calls=32, expect="graph")


def uniform_tensor_bounds(x, lo):
    return random.uniform(lo, x), random.uniform(lo.sum().item(), 2.0)


def test_uniform_with_tensor_and_item_bounds():
    check(uniform_tensor_bounds, lambda: A(T(3), T(3)), calls=N)


def item_arith(x):
    r = random.random()
    s = x.sum().item() * r
    if r > 0.5:
        return x * s
    return x - s


def test_a_draw_with_item_arithmetic():
    check(item_arith, lambda: A(T(3)), calls=N)


def number_math(x):
    r = random.random()
    return x * math.sqrt(r) + r ** 0.5, round(r, 3), r * 3 - 1, math.exp(r), int(r * 10)


def test_python_number_arithmetic_on_a_draw_is_exact():
    check(number_math, lambda: A(T(2)), calls=N)


# ----------------------------------------------------------------- the heap, outputs, printing

def returns_draw(x):
    return random.random(), x + 1, random.uniform(2, 5)


def test_returning_a_draw():
    check(returns_draw, lambda: A(T(2)), calls=N, expect="graph")


class Holder:
    def __init__(self):
        self.last = None
        self.sum = 0.0


def stores_draw(x, h, acc):
    r = random.random()
    h.last = r
    h.sum += r
    acc.append(r)
    return x * r


def test_storing_a_draw_on_an_object_and_a_list():
    check(stores_draw, lambda: A(T(2), Holder(), [1.0]), calls=N, expect="graph")


LAST = 0.0


def global_draw(x):
    global LAST
    LAST = random.random()
    return x + LAST


def test_storing_a_draw_in_a_global():
    check(global_draw, lambda: A(T(2)), calls=N, expect="graph",
          state=module_globals(__name__, LAST=0.0))


def prints_draw(x):
    r = random.random()
    print(r, f"{r:.3f}", f"{r * 2}")
    if r < 0.5:
        print("low")
    return x * r


def test_printing_a_draw():
    check(prints_draw, lambda: A(T(2)), calls=N)


# ----------------------------------------------------------------- exceptions

def caught(x):
    a = random.random()
    try:
        if a < 0.5:
            raise ValueError("low")
        x = x * 2
    except ValueError:
        x = x - random.random()
    return x * random.random()


def test_draws_around_a_caught_exception():
    check(caught, lambda: A(T(2)), calls=N)


def raises_after(x):
    r = random.random()
    y = x * r
    if random.random() < 0.4:
        raise RuntimeError(f"unlucky {r > 0.5}")
    return y


def test_raising_after_draws():
    check(raises_after, lambda: A(T(2)), calls=N)


def index_error(x):
    xs = [1, 2]
    return x * xs[int(random.random() * 3)]


def test_an_index_error_from_a_drawn_index():
    check(index_error, lambda: A(T(2)), calls=N)


# ----------------------------------------------------------------- modules, training, nesting

class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(3, 3)

    def forward(self, x, target, ratio=0.5):
        out = []
        h = x
        for t in range(3):
            h = torch.tanh(self.cell(h))
            out.append(h)
            h = target[t] if random.random() < ratio else h
        return torch.stack(out)


def test_teacher_forcing_in_a_training_loop():
    def make():
        return Decoder()
    check_module(make, lambda: A(T(3), T(3, 3)), calls=N, grad=True)


def test_teacher_forcing_with_optimizer_step_outside():
    torch.manual_seed(0)
    eager_m = Decoder()
    torch.manual_seed(0)
    opt_m = Decoder()
    specularch.optimize(opt_m)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_m, opt_m)]
    for i in range(16):
        torch.manual_seed(i)
        x, tgt = torch.randn(3), torch.randn(3, 3)
        losses, states = [], []
        for m, o in zip((eager_m, opt_m), opts):
            random.seed(i)
            o.zero_grad()
            loss = ((m(x, tgt) - 1) ** 2).mean()
            loss.backward()
            o.step()
            losses.append(loss.detach())
            states.append(random.getstate())
        assert torch.equal(losses[0], losses[1]) and states[0] == states[1], i
    for a, b in zip(eager_m.parameters(), opt_m.parameters()):
        assert torch.equal(a, b)
    assert not [f for f in specularch.explain(opt_m).fallbacks if f.kind == "internal_error"]


SHARED = specularch.optimize(lambda x: x * random.random() if random.random() < 0.5 else x)


def outer_a(x):
    return SHARED(x) + random.random()


def outer_b(x):
    return SHARED(SHARED(x))


def test_one_optimized_function_called_from_two_optimized_functions():
    check(outer_a, lambda: A(T(2)), calls=N, expect="graph")
    check(outer_b, lambda: A(T(2)), calls=N, expect="graph")
    check(lambda x: SHARED(x), lambda: A(T(2)), calls=N, expect="graph")


def countdown(x, n):
    if n == 0:
        return x
    if random.random() < 0.5:
        x = x * 2
    return countdown(x + 1, n - 1)


def test_recursive_countdown_that_draws():
    check(countdown, lambda: A(T(2), 3), calls=N)


def tree_sum(node):
    if isinstance(node, torch.Tensor):
        return node * random.random()
    return tree_sum(node[0]) + tree_sum(node[1])


def test_recursion_over_a_tree_that_draws():
    check(tree_sum, lambda: A([[T(2), T(2)], [T(2), [T(2), T(2)]]]), calls=N)


def under_no_grad(x):
    with torch.no_grad():
        y = x * random.random()
    if random.random() < 0.5:
        y = y + x
    return y


def test_draws_under_no_grad():
    check(under_no_grad, lambda: A(T(2, requires_grad=True)), calls=N, expect="graph")


# ----------------------------------------------------------------- other random functions

def seeds_inside(x):
    a = random.random()
    random.seed(7)
    return x * a + random.random()


def state_roundtrip(x):
    s = random.getstate()
    a = random.random()
    random.setstate(s)
    return x * (a - random.random())


def choice_shuffle_gauss(x, xs):
    a = random.random()
    random.shuffle(xs)
    return x * a + random.choice([1, 2, 3]) + random.gauss(0, 1), xs


def own_instance(x):
    rng = random.Random(5)
    return x * rng.random() + random.random()


def randint_after_draw(x):
    if random.random() < 0.5:
        return x * random.randint(1, 6)
    return x


@pytest.mark.parametrize("fn, make", [
    (seeds_inside, lambda: A(T(2))),
    (state_roundtrip, lambda: A(T(2))),
    (choice_shuffle_gauss, lambda: A(T(2), [1, 2, 3, 4])),
    (own_instance, lambda: A(T(2))),
    (randint_after_draw, lambda: A(T(2))),
], ids=["seed", "getstate-setstate", "choice-shuffle-gauss", "Random-instance", "randint-after-draw"])
def test_other_random_functions_run_eagerly(fn, make):
    check(fn, make, calls=N, expect="fallback", fallback_kind="unsupported_call")


# ----------------------------------------------------------------- more shapes of draws

def tensors_from_draw(x):
    r = random.random()
    return (torch.tensor(r), torch.tensor([r, 2 * r]), x.new_tensor(r),
            torch.tensor(r, dtype=torch.float64), x.double() * r + r / 3,
            torch.tensor([random.random() for _ in range(2)]))


def test_tensors_made_from_draws_keep_float64_precision():
    check(tensors_from_draw, lambda: A(T(2)), calls=N, expect="graph")


def ops_with_draw(x):
    r = random.random()
    y = x.clone()
    y.fill_(r) if r < 0.3 else y.mul_(r)
    z = x.clamp(max=r) + torch.linspace(0, r, 2) + (x > r).float()
    w = torch.bernoulli(torch.full_like(x, r)) + torch.normal(r, 1.0, (2,))
    return y, z, w, torch.empty(2).uniform_(0, r), torch.rand(2) < r


def test_draws_as_scalars_of_torch_random_and_inplace_ops():
    check(ops_with_draw, lambda: A(T(2)), calls=N, expect="graph")


def number_outputs(x):
    r, s = random.random(), random.uniform(-1, 1)
    return x + 1, r * 3 - 1, r / 7, r ** 2, r * s, s - r, -r


def test_python_number_outputs_of_draws_are_bit_exact():
    check(number_outputs, lambda: A(T(2)), calls=16, expect="graph")


def uniform_grad(x, lo):
    return random.uniform(lo, x) * (random.random() + 1)


def test_uniform_between_tensors_that_require_grad():
    check(uniform_grad, lambda: A(T(2, requires_grad=True), T(2, requires_grad=True)),
          calls=16, expect="graph", grad=True)


def strings_of_draws(x, log):
    r = random.random()
    log.append(f"r={r:.3f}")
    return x * r, str(r), repr(r), "%.3f" % r, "{:.2f}".format(r), f"{r * 3:.5e}"


def test_strings_of_draws():
    check(strings_of_draws, lambda: A(T(2), []), calls=16, expect="graph")


def item_vs_draw(x):
    if x.sum().item() > random.random():
        return x * 2
    return x - 1


def test_an_item_compared_with_a_draw():
    check(item_vs_draw, lambda: A(T(2)), calls=N)


def multinomial_may_raise(x):
    r = random.random()
    return torch.multinomial(torch.full((2,), r - 0.5), 1) + x * torch.rand(2)


def test_a_graph_that_raises_at_run_time_on_a_draw_put_both_generators_back():
    check(multinomial_may_raise, lambda: A(T(2)), calls=N)


INNER = specularch.optimize(lambda y: y * random.random() if random.random() < 0.5 else y - 1)


def outer_falls_back(x):
    r = random.random()
    y = INNER(x * r)
    n = len(y.tolist()) if r < 0.5 else 0  # not captured: this path runs eagerly
    return INNER(y) + random.random(), n


def test_an_optimized_function_called_from_an_eager_fallback_draws_in_order():
    check(outer_falls_back, lambda: A(T(2)), calls=30)


def draws_on_a_size(x):
    if random.random() * x.shape[0] < 2:
        return x * 2
    return x.sum()


def test_a_draw_compared_with_a_dynamic_size():
    check(draws_on_a_size, lambda i: A(T(i % 4 + 1)), calls=32, expect="graph")


class PreHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_forward_pre_hook(lambda m, a: (a[0] * random.random(),))

    def forward(self, x):
        if random.random() < 0.5:
            return self.lin(x)
        return x


def test_a_module_whose_pre_hook_draws():
    check_module(PreHook, lambda: A(T(3)), calls=N, expect="graph")


def test_capture_on_the_first_call_and_a_cache_limit_of_one():
    with specularch.config.patch(profile_calls=0):
        check(vs_argument, lambda: A(T(2), 0.5), calls=N, expect="graph")
    specularch.reset()
    with specularch.config.patch(cache_limit=1):
        check(vs_argument, lambda: A(T(2), 0.5), calls=N, expect="fallback", fallback_kind="cache_limit")


# ----------------------------------------------------------------- random.gauss: gauss_next

def gauss(x):
    return x * random.gauss(0, 1)


def _gauss_sequence(fn):
    """Three calls per seed, without re-seeding between them: gauss() alternates between
    drawing two numbers (keeping one in Random.gauss_next) and returning the kept one."""
    out = []
    for seed in (3, 4, 3, 4):
        random.seed(seed)
        out += [fn(torch.ones(1)).item() for _ in range(3)]
        out.append(random.getstate())
    return out


def test_gauss_keeps_eager_s_gauss_next_across_calls():
    expected = _gauss_sequence(gauss)
    assert _gauss_sequence(specularch.optimize(gauss)) == expected


def test_gauss_is_eager_s_when_every_call_reseeds():
    check(gauss, lambda: A(T(2)), calls=16)


def test_gauss_runs_eagerly_with_an_unsupported_call_record():
    check(gauss, lambda: A(T(2)), calls=16, expect="fallback", fallback_kind="unsupported_call")
