"""Differential programs, calls family: positional / keyword / `*args` / `**kwargs` calls,
defaults and keyword-only parameters, inlined helper functions and decorated helpers, methods,
properties, `super().forward`, staticmethod / classmethod, `functools.partial`, bounded
recursion, builtins, `math`, `torch.nn.functional`, tensor methods, tensor creation, objects
created inside the function, and the `optimize` entry points (decorator form, backend name)."""
import collections
import functools
import itertools
import math
import operator
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from differential import (A, Pair, T, assert_same, assert_uses_opcode, check, check_module,
                          expect_graph)

pytestmark = pytest.mark.usefixtures("no_profiling")

Point = namedtuple("Point", ["x", "y"])


# ------------------------------------------------------------------ calling conventions

def _scale_shift(x, scale, shift=0.0, *, clamp=None):
    y = x * scale + shift
    if clamp is not None:
        y = y.clamp(max=clamp)
    return y


def _sum_all(*ts):
    total = ts[0]
    for t in ts[1:]:
        total = total + t
    return total


def _with_options(x, **opts):
    for name, value in sorted(opts.items()):
        x = x + value if name.startswith("add") else x * value
    return x


def call_positional_and_keyword(x):
    return _scale_shift(x, 2.0), _scale_shift(x, 3.0, shift=1.0), _scale_shift(x, scale=0.5, shift=-1.0, clamp=1.0)


def call_with_star_args(x, parts):
    args = (x, 2.0)
    kwargs = {"shift": 1.0}
    return _sum_all(*parts), _scale_shift(*args, **kwargs), _with_options(x, add_a=1.0, mul_b=2.0)


def optimized_varargs(*xs, **opts):
    out = _sum_all(*xs)
    for k in opts:
        out = out * opts[k]
    return out, len(xs), sorted(opts)


def default_arguments(x, k=3, names=("a",), bias=None):
    y = x * k
    if bias is not None:
        y = y + bias
    return y, names


def keyword_only(x, *, scale, shift=1.0):
    return x * scale + shift


def _inner_helper(t, k):
    return t * k + 1


def _middle_helper(t):
    return _inner_helper(t, 2) - _inner_helper(t, 3)


def nested_helper_calls(x):
    return _middle_helper(x) + _middle_helper(x * 2)


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) * 1.0

    return wrapper


@_logged
def _decorated_helper(x, k=2):
    return x * k


def call_decorated_helper(x):
    return _decorated_helper(x, k=3) + _decorated_helper(x)


def _tree_sum(items):
    if not items:
        return 0
    head, *tail = items
    return head + _tree_sum(tail)


def bounded_recursion(xs):
    return _tree_sum(xs), _tree_sum([len(xs), 2, 3])


# ------------------------------------------------------------------ user classes

class Polynomial:
    def __init__(self, coeffs):
        self.coeffs = coeffs

    def __call__(self, x):
        return self.evaluate(x)

    def evaluate(self, x):
        out = torch.zeros_like(x)
        for c in reversed(self.coeffs):
            out = out * x + c
        return out

    @property
    def degree(self):
        return len(self.coeffs) - 1


def user_class_methods(x, poly):
    return poly.evaluate(x), poly(x) * poly.degree


class Ops:
    factor = 3.0

    @staticmethod
    def double(t):
        return t * 2

    @classmethod
    def scaled(cls, t):
        return cls.factor * t


class MoreOps(Ops):
    factor = 5.0


def static_and_class_methods(x):
    return Ops.double(x), Ops.scaled(x), MoreOps.scaled(x)


def partial_calls(x, given):
    p = functools.partial(_scale_shift, scale=2.0)
    return p(x), p(x, shift=1.0), given(x), functools.partial(_sum_all, x)(x, x)


def objects_created_inside(x, y):
    pt = Point(x * 2, y)
    poly = Polynomial([0.5, 1.0])
    return pt, pt.x + pt.y, poly, poly.degree, poly(x), Ops().double(y), MoreOps().scaled(y)


def callables_in_containers(x, key):
    table = {"relu": torch.relu, "tanh": torch.tanh, "neg": lambda t: -t}
    methods = [x.sin, x.cos]
    return table[key](x), [m() for m in methods], getattr(x, "exp")(), getattr(torch, "sigmoid")(x)


# ------------------------------------------------------------------ builtins and math

def builtins_sequences(xs, d):
    n = len(xs)
    idx = list(range(n))
    pairs = list(zip(idx, xs))
    doubled = list(map(lambda t: t * 2, xs))
    order = sorted(d, key=lambda k: -d[k])
    return (tuple(idx), pairs[-1][1] + doubled[0], [i for i, _ in enumerate(xs)], order,
            sorted(d.items()), dict(zip(order, idx)), dict(a=1, b=n), list(reversed(idx)))


def builtins_numbers(x, a, b):
    lo, hi = min(a, b), max(a, b, 1)
    return (x * abs(a - b) + sum([lo, hi], 10), int(2.9), int(b), float(a), bool(b), bool(0),
            round(2.567, 2), round(b / 3), divmod(17, a), pow(a, 3), min([4, 2, 8]), max(x.shape))


def builtins_introspection(x, poly):
    scale = getattr(poly, "scale", 2.0)
    out = x * scale
    if hasattr(poly, "coeffs") and isinstance(poly.coeffs, list):
        out = out + len(poly.coeffs)
    if isinstance(x, torch.Tensor) and type(x) is torch.Tensor and callable(poly):
        out = out * 2
    return out, isinstance(scale, float), issubclass(type(poly), Polynomial)


def builtins_predicates(x, flags):
    out = x
    if any(flags):
        out = out + 1
    if all(flags):
        out = out * 3
    if not any([]) and all(f is not None for f in flags):
        out = out - 2
    return out, any(flags), all(flags)


def math_functions(x, n):
    k = math.sqrt(n) + math.log(n) + math.exp(1) + math.pi
    j = math.floor(2.7) + math.ceil(2.1) + math.prod([2, 3]) + math.gcd(12, 18)
    return x * k + j, math.isfinite(k), math.cos(0.0), math.inf > n


# ------------------------------------------------------------------ torch.nn.functional

def functional_activations(x):
    return (F.relu(x), F.gelu(x), F.softmax(x, dim=-1), F.layer_norm(x, (x.shape[-1],)),
            F.dropout(x * 2, p=0.5, training=False), F.silu(x), F.log_softmax(x, -1))


def functional_losses(logits, target, pred, goal):
    return F.cross_entropy(logits, target), F.mse_loss(pred, goal), F.cross_entropy(logits, target, reduction="none")


def functional_conv_pool(x, w, b):
    y = F.conv2d(x, w, b, padding=1)
    return F.max_pool2d(y, 2), F.avg_pool2d(y, kernel_size=2, stride=1)


def functional_embedding_linear(idx, table, w, b):
    e = F.embedding(idx, table)
    return F.linear(e, w, b), F.linear(e, w)


# ------------------------------------------------------------------ tensor methods and creation

def tensor_views(x):
    b, t, c = x.shape
    return (x.view(b, t * c), x.reshape(-1, c), x.permute(2, 0, 1), x.transpose(0, 1).contiguous(),
            x.flatten(1), x.unsqueeze(1).squeeze(1), x[:, :1].expand(b, 3, c), x.mT)


def tensor_split_and_join(x):
    a, b = x.chunk(2, dim=0)
    parts = x.split([1, 3], dim=1)
    rows = x.unbind(0)
    return torch.cat([a, b], dim=1), torch.stack(rows, dim=-1), parts, len(rows), torch.cat(parts, 1)


def tensor_reductions(x):
    values, indices = x.max(dim=1)
    return (x.sum(dim=0), x.sum(dim=(0, 1)), x.mean(), x.mean(-1, keepdim=True), values, indices,
            x.max(dim=0), x.argmax(), x.min(), x.std(0), x.amax(1))


def tensor_masking_matmul(x, y, m):
    filled = x.masked_fill(m, -1.0)
    return filled.matmul(y), x @ y, torch.bmm(x.unsqueeze(0), y.unsqueeze(0)), x.masked_fill(~m, 0.0).sum(1)


def tensor_sizes(x):
    b, t, c = x.shape
    n = x.size(1) * x.dim() + x.numel() + len(x)
    return x.reshape(b * t, c) * n, x.size(), x.size(-1), x.dim(), x.numel(), x.shape[-2:]


def tensor_creation(x):
    return (torch.zeros(x.shape[0], 4), torch.arange(x.shape[1]), torch.arange(1, 7, 2, dtype=torch.float32),
            torch.ones_like(x), x.new_zeros(2, 3), x.new_full((2,), 7.0), torch.full((2, 2), 3, dtype=torch.int64),
            torch.eye(3), torch.tensor([1.0, 2.0, 3.0]), torch.linspace(0, 1, 5), torch.zeros_like(x, dtype=torch.bool),
            x + torch.arange(x.shape[1]))


def einsum_and_outer(x, y):
    return torch.einsum("ij,kj->ik", x, y), torch.outer(x[0], y[0]), torch.einsum("ii->i", x[:, :3][:3])


@torch.no_grad()
def _frozen_projection(x, w):
    return (x @ w).relu()


@torch.enable_grad()
def _tracked_projection(x, w):
    return (x @ w) * 2


def grad_mode_decorated_helpers(x, w):
    a = _frozen_projection(x, w)
    return a + _tracked_projection(x, w), a.requires_grad


def keyed_min_max_and_sorted_items(x):
    xs = [x, 2 * x[:1], x + 1]
    longest = max(xs, key=lambda t: t.shape[0])
    shortest = min(xs, key=lambda t: t.shape[0])
    table = {"b": x * 2, "a": x - 1, "c": x}
    ordered = sorted(table.items())  # by the distinct string keys, as Python compares tuples
    return longest, shortest, [k for k, _ in ordered], ordered[0][1], max([3, 1, 2], key=lambda v: -v)


PROGRAMS = [
    (grad_mode_decorated_helpers, lambda: A(T(2, 3), T(3, 3, requires_grad=True)), ["CALL"]),
    (keyed_min_max_and_sorted_items, lambda: A(T(3)), ["CALL"]),
    (call_positional_and_keyword, lambda: A(T(3)), ["KW_NAMES"]),
    (call_with_star_args, lambda: A(T(3), [T(3), T(3), T(3)]), ["CALL_FUNCTION_EX"]),
    (optimized_varargs, lambda: A(T(2), T(2), T(2), scale=2.0, shift=0.5), ["CALL_FUNCTION_EX"]),
    (default_arguments, lambda i: ((T(3),) + ((), (4,), (2, ("b",), T(3)))[i], {}), ["POP_JUMP_FORWARD_IF_NONE"]),
    (keyword_only, lambda i: A(T(3), scale=2.0, **({"shift": -1.0} if i else {})), ["BINARY_OP"]),
    (nested_helper_calls, lambda: A(T(3)), ["CALL"]),
    (call_decorated_helper, lambda: A(T(3)), ["KW_NAMES"]),
    (bounded_recursion, lambda: A([T(2), T(2), T(2), T(2)]), ["CALL"]),
    (user_class_methods, lambda: A(T(3), Polynomial([1.0, -2.0, 0.5])), ["LOAD_METHOD"]),
    (static_and_class_methods, lambda: A(T(3)), ["LOAD_METHOD"]),
    (partial_calls, lambda: A(T(3), functools.partial(_scale_shift, scale=0.5, shift=1.0)), ["CALL"]),
    (objects_created_inside, lambda: A(T(2), T(2)), ["CALL"]),
    (callables_in_containers, lambda i: A(T(3), ["relu", "tanh", "neg"][i]), ["BUILD_CONST_KEY_MAP"]),
    (builtins_sequences, lambda: A([T(2), T(2), T(2)], {"p": 3, "q": 1, "r": 2}), ["CALL"]),
    (builtins_numbers, lambda i: A(T(3), 3, 4 + i), ["CALL"]),
    (builtins_introspection, lambda: A(T(3), Polynomial([1.0, 2.0])), ["CALL"]),
    (builtins_predicates, lambda i: A(T(3), [[True, True], [True, False], [False, False]][i]), ["CALL"]),
    (math_functions, lambda i: A(T(3), 2 + i), ["LOAD_ATTR"]),
    (functional_activations, lambda: A(T(3, 4)), ["LOAD_ATTR"]),
    (functional_losses, lambda: A(T(4, 5), T(4, dtype=torch.int64, low=0, high=5), T(3), T(3)), ["CALL"]),
    (functional_conv_pool, lambda: A(T(1, 2, 6, 6), T(3, 2, 3, 3), T(3)), ["CALL"]),
    (functional_embedding_linear, lambda: A(T(2, 3, dtype=torch.int64, low=0, high=10), T(10, 4), T(5, 4), T(5)),
     ["CALL"]),
    (tensor_views, lambda: A(T(2, 3, 4)), ["UNPACK_SEQUENCE"]),
    (tensor_split_and_join, lambda: A(T(4, 4)), ["UNPACK_SEQUENCE"]),
    (tensor_reductions, lambda: A(T(3, 4)), ["UNPACK_SEQUENCE"]),
    (tensor_masking_matmul, lambda: A(T(3, 3), T(3, 3), T(3, 3, dtype=torch.bool)), ["BINARY_OP"]),
    (tensor_sizes, lambda: A(T(2, 3, 4)), ["UNPACK_SEQUENCE"]),
    (tensor_creation, lambda: A(T(3, 2)), ["LOAD_GLOBAL"]),
    (einsum_and_outer, lambda: A(T(4, 4), T(3, 4)), ["CALL"]),
]


@pytest.mark.parametrize("fn, make_args, opcodes", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_call_program_runs_as_graph(fn, make_args, opcodes):
    for opcode in opcodes:
        assert_uses_opcode(fn, opcode)
    check(fn, make_args, expect="graph")


@pytest.mark.parametrize("fn, make_args", [
    (functional_activations, lambda: A(T(3, 4, requires_grad=True))),
    (functional_conv_pool, lambda: A(T(1, 2, 6, 6, requires_grad=True), T(3, 2, 3, 3, requires_grad=True),
                                     T(3, requires_grad=True))),
    (tensor_views, lambda: A(T(2, 3, 4, requires_grad=True))),
    (tensor_masking_matmul, lambda: A(T(3, 3, requires_grad=True), T(3, 3, requires_grad=True),
                                      T(3, 3, dtype=torch.bool))),
], ids=["functional_activations", "functional_conv_pool", "tensor_views", "tensor_masking_matmul"])
def test_call_program_gradients_match(fn, make_args):
    check(fn, make_args, grad=True, expect="graph")


class BaseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class ChildBlock(BaseBlock):
    def __init__(self):
        super().__init__()
        self.scale = 2.0

    def forward(self, x):
        return super().forward(x) * self.scale + x


def test_super_forward():
    assert_uses_opcode(ChildBlock.forward, "COPY_FREE_VARS")  # zero-argument super() reads the __class__ cell
    check_module(ChildBlock, lambda: A(T(2, 4)), grad=True, expect="graph")


def test_decorator_form_and_wraps():
    @specularch.optimize
    def decorated(x, y):
        """Docstring kept."""
        return x * y + 1

    assert decorated.__name__ == "decorated" and decorated.__doc__ == "Docstring kept."
    pair = Pair("decorated", decorated.__wrapped__, decorated, decorated)
    for _ in range(3):
        pair.step(lambda: A(T(2, 3), T(2, 3)))
    expect_graph(pair.explain(), "decorated")


def test_explicit_fx_backend():
    def small(x):
        return torch.tanh(x) * 2

    check(small, lambda: A(T(4)), backend="fx", expect="graph")


def called_with_keywords(x, y, scale=1.0):
    return x * scale - y


def test_arguments_passed_by_keyword_to_the_optimized_function():
    check(called_with_keywords, lambda i: A(y=T(3), x=T(3), **({"scale": 2.0} if i else {})), expect="graph")


def random_ops(x):
    noise = torch.randn_like(x)
    return x + 0.1 * noise, F.dropout(x, p=0.5, training=True), torch.rand(2)


def test_random_ops_draw_like_eager():
    """Same seed before both calls: values and the RNG state afterwards must match eager's."""
    check(random_ops, lambda: A(T(3, 4)))


def unused_random_draw(x):
    _noise = torch.randn(3)  # unused, but it advances the RNG in eager too
    return x + torch.rand(2)


def test_an_unused_random_draw_still_advances_the_rng():
    e = check(unused_random_draw, lambda: A(T(2)), expect="graph")
    assert "randn" in e.graphs[0].code, e.graphs[0].code


def test_an_explicit_generator_draws_like_eager():
    def run(optimize):
        g = torch.Generator().manual_seed(0)

        def noisy(x):
            return x + torch.rand(2, generator=g), torch.randn(2, generator=g)

        fn = specularch.optimize(noisy) if optimize else noisy
        return [fn(torch.zeros(2)) for _ in range(5)], g.get_state(), fn
    eager, eager_state, _ = run(False)
    fast, fast_state, fn = run(True)
    assert_same(eager, fast)  # capture must not advance the generator
    assert torch.equal(eager_state, fast_state)
    assert specularch.explain(fn).graphs


def embed_after_noise(tokens, table):
    noise = torch.rand(2)
    return table[tokens] + noise  # raises for an index out of range


def test_a_graph_that_raises_leaves_the_rng_as_eager_does():
    e = check(embed_after_noise, lambda i: A(torch.tensor([1, 2]) if i != 3 else torch.tensor([1, 7]),
                                              T(5, 2)), calls=5)
    assert e.graphs, str(e)
    # the user's own error, met first by the graph: not blamed on the backend
    assert [f.kind for f in e.fallbacks] == ["exception_handling"], str(e)
    assert "IndexError" in e.fallbacks[0].explanation, str(e)


def test_calling_an_optimized_function_from_another():
    def inner_step(x):
        return torch.tanh(x) * 3

    inner_opt = specularch.optimize(inner_step)

    def outer(x):
        return inner_opt(x) + inner_opt(x * 2)

    check(outer, lambda: A(T(3)))


def test_bound_method_optimized():
    poly = Polynomial([2.0, 0.5, -1.0])
    check(poly.evaluate, lambda: A(T(3)), expect="graph")


def test_defaults_assigned_after_optimize_are_seen():
    """Python reads ``__defaults__``/``__kwdefaults__`` at each call; so must the optimized
    function (both sides of the pair call the same function object)."""
    def scaled(x, scale=2.0, weight=None, *, shift=1.0):
        y = x * scale + shift
        return y if weight is None else y * weight

    pair = Pair.of_function(scaled)
    settings = [((2.0, None), {"shift": 1.0})] * 2 + [
        ((5.0, None), {"shift": 1.0}),             # a new __defaults__ tuple
        ((5.0, None), {"shift": -3.0}),            # a new __kwdefaults__ dict
        ((5.0, T(3, seed=1)), {"shift": -3.0}),    # a tensor default appears
        ((5.0, T(3, seed=2)), None)]               # keyword-only default removed: TypeError
    for defaults, kwdefaults in settings:
        scaled.__defaults__, scaled.__kwdefaults__ = defaults, kwdefaults
        pair.step(lambda: A(T(3)))
    scaled.__kwdefaults__ = {"shift": 0.5}
    pair.step(lambda: A(T(3)))
    scaled.__kwdefaults__["shift"] = 4.0  # changed in place
    pair.step(lambda: A(T(3)))
    assert specularch.explain(pair.opt).graphs


def test_code_assigned_after_optimize_is_run():
    def f(x):
        return x + 1

    def replacement(x):
        return x * 100

    pair = Pair.of_function(f)
    for _ in range(2):
        pair.step(lambda: A(T(3)))
    f.__code__ = replacement.__code__
    assert_same(pair.opt(torch.ones(2)), torch.full((2,), 100.0))
    pair.step(lambda: A(T(3)))


def _forward_all(*xs, **options):
    return sum(xs) * options.get("scale", 1)


def forward_star_args_and_changing_kwargs(*xs, **options):
    return _forward_all(*xs, **options), len(xs)


def test_kwargs_with_changing_keys_forwarded_with_double_star():
    """The key set of ``**options`` changes between calls (a relaxation stops guarding it);
    forwarding it whole with ``**options`` must track it whole again, not fall back."""
    assert_uses_opcode(forward_star_args_and_changing_kwargs, "DICT_MERGE")
    check(forward_star_args_and_changing_kwargs,
          lambda i: (tuple(T(2) for _ in range(i % 3 + 1)), {"scale": 2} if i % 2 else {}),
          calls=6, expect="graph")


def _changeable_helper(x, k=2.0, *, b=1.0):
    return x * k + b


def calls_changeable_helper(x):
    return _changeable_helper(x)


def test_inlined_helper_code_and_defaults_assigned_after_capture_are_seen():
    helper = _changeable_helper
    saved = helper.__code__, helper.__defaults__, helper.__kwdefaults__

    def replacement(x, k=2.0, *, b=1.0):
        return x - k * b

    def change(i):
        if i == 2:
            helper.__defaults__ = (5.0,)
        elif i == 3:
            helper.__kwdefaults__["b"] = 10.0  # in place
        elif i == 4:
            helper.__kwdefaults__ = {"b": -1.0}
        elif i == 5:
            helper.__code__ = replacement.__code__
        return A(T(3))

    try:
        e = check(calls_changeable_helper, change, calls=7, expect="graph")
    finally:
        helper.__code__, helper.__defaults__, helper.__kwdefaults__ = saved
    assert any("__code__" in g for graph in e.graphs for g in graph.guards), str(e)


# ------------------------------------------------------------------ standard-library helpers
# functools / itertools / collections / operator helpers are run as their Python logic over
# the executor's values (never the C implementation on symbolic values).

def stdlib_reduce(x, ts):
    flat = x.reshape(functools.reduce(operator.mul, x.shape))
    total = functools.reduce(lambda a, b: a + b, ts)
    scaled = functools.reduce(torch.mul, ts[:0], torch.ones(2))  # empty: the initial value
    return flat * 2, total, scaled


def stdlib_itertools(a, b):
    chained = [t * 2 for t in itertools.chain(a, (b,))]
    nested = sum(itertools.chain.from_iterable([a, [b]]))
    grid = [b[i] * 10 + j for i, j in itertools.product(range(2), repeat=2)]
    running = list(itertools.accumulate(a, torch.maximum, initial=torch.zeros(2)))
    return chained, nested, grid, running, list(itertools.accumulate([1, 2, 3]))


def stdlib_partial_and_getters(x, table):
    soft = functools.partial(F.softmax, dim=-1)
    first_two = operator.itemgetter(0, 1)
    weight = operator.attrgetter("shape")
    return soft(x), first_two([x, x * 2, x * 3]), operator.itemgetter("w")(table) * weight(x)[0]


def stdlib_ordered_and_default_dicts(x, keys):
    feats = collections.OrderedDict([("in", x)])
    feats["double"] = x * 2
    feats.move_to_end("in")
    groups = collections.defaultdict(list)
    for k in keys:
        groups[k].append(x * len(groups[k]))
    counts = collections.defaultdict(int)
    for k in keys:
        counts[k] += 1
    return feats, counts, {k: sum(v) for k, v in groups.items()}, groups.get("zz"), "zz" in groups


def stdlib_iterator_consumed_once(ts):
    it = iter(ts)
    first = next(it)
    rest = list(it)
    return first, rest, list(it)


STDLIB_PROGRAMS = [
    (stdlib_reduce, lambda i: A(T(2 + i % 2, 3), [T(2) for _ in range(1 + i)])),
    (stdlib_itertools, lambda i: A([T(2) for _ in range(1 + i % 2)], T(2, 2))),
    (stdlib_partial_and_getters, lambda: A(T(2, 3), {"w": T(3)})),
    (stdlib_ordered_and_default_dicts, lambda i: A(T(2), ["a", "b", "a", "c"][:2 + i % 3])),
    (stdlib_iterator_consumed_once, lambda: A([T(2), T(2), T(2)])),
]


@pytest.mark.parametrize("fn, make_args", STDLIB_PROGRAMS, ids=[p[0].__name__ for p in STDLIB_PROGRAMS])
def test_standard_library_helpers_run_as_graph(fn, make_args):
    check(fn, make_args, calls=4, expect="graph")


def ordered_dict_returned_twice(x):
    d = collections.OrderedDict(a=x)
    return d, d  # one object on both sides: rebuilt from a graph, it would be two


def defaultdict_of_a_lambda_returned(x):
    d = collections.defaultdict(lambda: 0)
    d["a"] += 1
    return d, x * 2


@pytest.mark.parametrize("fn", [ordered_dict_returned_twice, defaultdict_of_a_lambda_returned])
def test_dicts_that_cannot_be_rebuilt_fall_back(fn):
    check(fn, lambda: A(T(2)), expect="fallback", fallback_kind="unsupported_call")


# Iterators are lazy in eager: what a list holds when the item is asked for counts, and the
# function of map/accumulate runs when the item is asked for (were snapshots taken when made).
log_of_calls = []


def iterators_see_later_appends(lst, x):
    chained, plain, mapped = itertools.chain(lst, [x]), iter(lst), map(lambda t: t * 2, lst)
    local = [x]
    numbered = enumerate(local)
    lst.append(x + 1)
    local.append(x * 3)
    return list(chained), list(plain), list(mapped), list(numbered)


def accumulate_runs_its_function_when_asked(xs):
    def step(a, b):
        log_of_calls.append("step")
        return a + b
    running = itertools.accumulate(xs, step)
    log_of_calls.append("made")
    return [t * 1 for t in running]


def dict_iterator_then_new_key(x):
    d = collections.OrderedDict(a=x)
    keys = iter(d)
    d["b"] = x * 2  # eager: RuntimeError at the next next()
    return list(keys)


def test_iterators_read_their_source_when_asked():
    check(iterators_see_later_appends, lambda i: A([T(2) for _ in range(1 + i % 2)], T(2)),
          calls=5, expect="graph")
    check(accumulate_runs_its_function_when_asked, lambda: A([T(2), T(2), T(2)]), calls=5,
          expect="graph", state=(log_of_calls.clear, lambda: list(log_of_calls)))
    check(dict_iterator_then_new_key, lambda: A(T(2)), calls=4, expect="fallback",
          fallback_kind="exception_handling")


def product_with_negative_repeat(xs):
    return list(itertools.product(xs, repeat=-1))  # eager: ValueError


def test_product_with_negative_repeat_raises_as_eager():
    check(product_with_negative_repeat, lambda: A([T(2)]), calls=4, expect="fallback",
          fallback_kind="exception_handling")
