"""Differential programs, basic family: locals, globals, closures and cells, constants,
attributes, tensor subscripts and slices, arithmetic and comparisons on tensors and Python
scalars, `is`/`in`/`and`/`or`/`not` on Python values, f-strings, building and unpacking
containers, star-unpacking, comprehensions, generator expressions, lambdas, nested functions and
returning nested structures. Every program here must run as a graph with no fallback."""
import pytest
import torch

import specularch
from differential import A, Pair, T, assert_same, assert_uses_opcode, check, expect_graph

pytestmark = pytest.mark.usefixtures("no_profiling")

SCALE = 3
OFFSET = 0.5
G_WEIGHT = T(4, seed=11)
CONFIG = {"scale": 2.0, "bias": True, "names": ("a", "b")}


# ------------------------------------------------------------------ locals, globals, closures

def locals_chain(x, y):
    a = x * 2
    b = a + y
    c = b * a - x
    a = c / 3
    return a, b


def globals_constant_and_tensor(x):
    y = x * SCALE + G_WEIGHT - OFFSET
    if CONFIG["bias"]:
        y = y + CONFIG["scale"]
    return y, CONFIG["names"][1]


def _make_closure():
    weight = T(4, seed=3)
    k = 2

    def closure_reads_tensor_and_int(x):
        return x * weight + k

    return closure_reads_tensor_and_int


closure_reads_tensor_and_int = _make_closure()


def nonlocal_cell_writes(x):
    total = 0

    def bump(v):
        nonlocal total
        total += v
        return total

    bump(1)
    bump(2)
    return x * total, total


def constants(x):
    return x + 1, None, True, 1.5, "s", (1, 2), -3, b"raw", 2 ** 10


# ------------------------------------------------------------------ attributes

class Affine:
    def __init__(self, scale, shift):
        self.scale = scale
        self.shift = shift


def tensor_attributes(x):
    return x.T + 1, x.shape, x.dtype, x.ndim, x.is_floating_point(), x.device, x.mT.shape


def object_attributes(x, obj):
    return x * obj.scale + obj.shift


# ------------------------------------------------------------------ subscripts

def index_basic(x):
    return x[0], x[1, 2], x[:, 1], x[1:3], x[2][1]


def index_negative(x):
    return x[-1], x[:, -2:], x[-3:-1], x[-1, -1]


def index_step(x):
    return x[::2], x[1::3, ::2], x[:, 1:4:2]


def index_none_ellipsis(x):
    return x[None], x[..., 0], x[:, None, 1:], x[..., None], x[None, ..., None, 0]


def index_long_tensor(x, idx):
    return x[idx], x[:, idx], x[idx, idx]


def index_computed_bounds(x, i, j):
    return x[i:j], x[:, i], x[i:j, j - 1:]


def setitem_on_local(x):
    y = x.clone()
    y[0] = 0.0
    y[:, 1] += 2
    y[y > 1] = 1.0
    return y


def python_sequence_subscripts(xs, name, tup):
    return xs[1:], xs[::-1], xs[-1] * 2, name[:3], name[-1], tup[-1] + tup[0]


# ------------------------------------------------------------------ arithmetic and comparisons

def arith_tensors(x, y):
    return x + y, x - y, x * y, x / y, x // y, x % y, x ** 2, x @ y.T, -x, +(x * y)


def arith_tensor_scalar(x):
    return 2 + x, x - 1.5, 3 * x, x / 4, x // 0.7, x % 2, 2 ** x, x ** 0.5, 1 - x, 6 / (x.abs() + 1)


def arith_int_tensors(a, b):
    return a + b, a * 3, a // 2, a % 3, a & b, a | b, a ^ b, a << 1, a >> 1, -a


def bool_tensor_ops(m, n):
    return ~m, m & n, m | n, m ^ n, (~m).sum()


def python_scalar_math(x, n, s):
    k = n * 2 + 1
    h = k / 4
    q = k // 3
    r = k % 3
    p = n ** 2
    mixed = n + s
    return x * h + q - r + p * mixed, k, h, q, r, p, mixed, -n, +s, 7 / 2, 7 // -2, -7 % 3


def tensor_comparisons(x, y):
    return x > 0, x < y, x >= 0.5, x <= y, x == y, x != 0, torch.eq(x, x)


def where_and_clamp(x, y):
    return torch.where(x > 0, x, 0.0), x.clamp(min=-1, max=1), torch.maximum(x, y), x.abs().sqrt()


def type_promotion(a, m, h):
    return a + 1.5, m + 1, h * 2.0, a / 2, h + a, m & (a > 0), a * True, torch.tensor(3) / 2


def aliased_arguments(a, b):
    return a * 2 + b, a is b


def dtype_conversions(x, y):
    return x.to(torch.float64), x.long(), x.type_as(y), x.to(y.dtype), x.bool(), x.half().float()


# ------------------------------------------------------------------ Python values

def identity_and_membership(x, mode, opts, names):
    out = x
    is_default = mode is None
    if opts is not names and is_default:
        out = out * 3
    if mode is None:
        out = out + 1
    if mode is not None and mode in names:
        out = out * 2
    if "scale" in opts:
        out = out * opts["scale"]
    if "shift" not in opts:
        out = out - 1
    return out, is_default


def boolean_python_values(x, a, b, scale):
    k = (a and scale) or 2
    use = not b
    z = x * k
    if a or use:
        z = z + 1
    if not (a and b):
        z = z - 2
    return z, k, use


def python_idioms(x, n):
    a, b = x, x * 2
    a, b = b, a
    if 0 < n < 10 and (m := n * 2) > 3:
        a = a + m
    tmp = a * 3
    del tmp
    return a - b


def fstring_keys(x, prefix, n):
    out = {}
    for i in range(n):
        out[f"{prefix}_{i}"] = x * i
    name = f"{prefix}.weight{n:02d}"
    return out, name


def string_methods(x, name):
    parts = name.split(".")
    key = "_".join(p.upper() for p in parts)
    scale = len(key) if key.startswith("A") else 1
    tag = "%s-%d" % (parts[0], scale)
    return x * scale, key, tag


# ------------------------------------------------------------------ containers

def build_and_unpack(x, y):
    t = (x, y)
    lst = [x, y, x + y]
    d = {"x": x, "y": y}
    s = {1, 2, 3}
    a, b = t
    c, d2, e = lst
    k = "dyn"
    dd = {k: a}
    merged = {**d, **dd}
    seq = [*lst, *t]
    return a + b, c * e, d2, merged, len(s), sorted(s), seq, (*t, 1)


def star_unpacking(xs, x):
    first, *rest = xs
    *init, last = x.unbind(0)
    a, *mid, z = range(5)
    return first + sum(rest), torch.stack(init), last, a, mid, z


def shape_tuple_building(x):
    new_shape = (*x.shape[:-1], 2, -1)
    return x.reshape(new_shape), new_shape, x.shape[1:], x.shape + (1,)


def comprehensions(xs, d):
    scaled = [t * i for i, t in enumerate(xs)]
    shifted = {k: v + 1 for k, v in d.items()}
    residues = {n % 3 for n in range(7)}
    nested = [[i * j for j in range(3)] for i in range(2)]
    return scaled, shifted, sorted(residues), nested, [t for t in xs if t.dim() == 1]


def generator_expressions(xs):
    total = sum(t * t for t in xs)
    shifted = tuple(t + 1 for t in xs)
    biggest = max(t.shape[0] for t in xs)
    return total, shifted, biggest, any(t.dim() > 1 for t in xs)


def lambdas(x, k):
    f = lambda t, s=2: t * s + 1  # noqa: E731
    g = lambda: x.sum(0) * k  # noqa: E731
    h = sorted([3, 1, 2], key=lambda v: -v)
    return f(x), f(x, s=k), g(), h


def nested_functions(x):
    def inner(y, k=3):
        return y * k + x

    def outer(y):
        return inner(inner(y), k=1)

    return outer(x)


def returns_nested_structure(x, y):
    return [x, {"a": (x * y, 1), "b": [None, "s", 2.5]}, (y,), {"e": {}}]


# ------------------------------------------------------------------ the table

def _xy():
    return A(T(3, 4), T(3, 4))


PROGRAMS = [
    (locals_chain, _xy, ["STORE_FAST"]),
    (globals_constant_and_tensor, lambda: A(T(4)), ["LOAD_GLOBAL"]),
    (closure_reads_tensor_and_int, lambda: A(T(2, 4)), ["LOAD_DEREF"]),
    (nonlocal_cell_writes, lambda: A(T(3)), ["STORE_DEREF", "MAKE_CELL"]),
    (constants, lambda: A(T(2)), ["LOAD_CONST"]),
    (tensor_attributes, lambda: A(T(3, 4)), ["LOAD_ATTR"]),
    (object_attributes, lambda: A(T(4), Affine(2.5, T(4))), ["LOAD_ATTR"]),
    (index_basic, lambda: A(T(4, 5)), ["BINARY_SUBSCR", "BUILD_SLICE"]),
    (index_negative, lambda: A(T(4, 5)), ["BINARY_SUBSCR"]),
    (index_step, lambda: A(T(6, 5)), ["BUILD_SLICE"]),
    (index_none_ellipsis, lambda: A(T(3, 4)), ["BINARY_SUBSCR"]),
    (index_long_tensor, lambda: A(T(4, 4), torch.tensor([3, 0, 0, 2])), ["BINARY_SUBSCR"]),
    (index_computed_bounds, lambda i: A(T(6, 6), 1 + i % 2, 4), ["BUILD_SLICE"]),
    (setitem_on_local, lambda: A(T(3, 4)), ["STORE_SUBSCR"]),
    (python_sequence_subscripts, lambda: A([T(2), T(2), T(2)], "hello", (1, 5, 9)), ["BUILD_SLICE"]),
    (arith_tensors, lambda: A(T(3, 3), T(3, 3)), ["BINARY_OP", "UNARY_NEGATIVE", "UNARY_POSITIVE"]),
    (arith_tensor_scalar, lambda: A(T(3, 4)), ["BINARY_OP"]),
    (arith_int_tensors, lambda: A(T(3, 4, dtype=torch.int64), T(3, 4, dtype=torch.int64)), ["BINARY_OP"]),
    (bool_tensor_ops, lambda: A(T(5, dtype=torch.bool), T(5, dtype=torch.bool)), ["UNARY_INVERT"]),
    (python_scalar_math, lambda i: A(T(3), 2 + i, 0.25), ["BINARY_OP"]),
    (tensor_comparisons, lambda: A(T(3, 4), T(3, 4)), ["COMPARE_OP"]),
    (where_and_clamp, _xy, ["COMPARE_OP"]),
    (dtype_conversions, lambda: A(T(3, 4), T(2, dtype=torch.float64)), ["LOAD_METHOD"]),
    (type_promotion, lambda: A(T(3, dtype=torch.int64), T(3, dtype=torch.bool), T(3, dtype=torch.float16)),
     ["BINARY_OP"]),
    (aliased_arguments, lambda: (lambda t: A(t, t))(T(3)), ["IS_OP"]),
    (identity_and_membership, lambda i: A(T(4), [None, "a", "z"][i % 3], {"scale": 3.0}, ("a", "b")),
     ["IS_OP", "CONTAINS_OP", "POP_JUMP_FORWARD_IF_NONE"]),
    (boolean_python_values, lambda i: A(T(4), i % 2 == 0, i == 1, 1.5), ["JUMP_IF_TRUE_OR_POP", "UNARY_NOT"]),
    (python_idioms, lambda: A(T(3), 4), ["DELETE_FAST", "SWAP", "COPY"]),
    (fstring_keys, lambda: A(T(2), "layer", 3), ["FORMAT_VALUE", "BUILD_STRING"]),
    (string_methods, lambda: A(T(2), "attn.proj.w"), ["LOAD_METHOD"]),
    (build_and_unpack, _xy, ["BUILD_MAP", "BUILD_CONST_KEY_MAP", "BUILD_SET", "UNPACK_SEQUENCE",
                             "DICT_UPDATE", "LIST_EXTEND", "LIST_TO_TUPLE"]),
    (star_unpacking, lambda: A([T(3), T(3), T(3)], T(4, 2)), ["UNPACK_EX"]),
    (shape_tuple_building, lambda: A(T(2, 3, 4)), ["LIST_TO_TUPLE"]),
    (comprehensions, lambda: A([T(2), T(2, 2), T(2)], {"p": T(3), "q": T(1)}),
     ["LIST_APPEND", "MAP_ADD", "SET_ADD"]),
    (generator_expressions, lambda: A([T(3), T(3), T(3, 3)]), ["YIELD_VALUE"]),
    (lambdas, lambda: A(T(2, 3), 3), ["MAKE_FUNCTION"]),
    (nested_functions, lambda: A(T(3)), ["MAKE_FUNCTION", "LOAD_CLOSURE"]),
    (returns_nested_structure, _xy, ["BUILD_LIST", "BUILD_TUPLE"]),
]


@pytest.mark.parametrize("fn, make_args, opcodes", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_basic_program_runs_as_graph(fn, make_args, opcodes):
    for opcode in opcodes:
        assert_uses_opcode(fn, opcode)
    check(fn, make_args, expect="graph")


def test_augmented_assignment_on_local_tensor_is_not_input_mutation():
    def inplace_on_intermediate(x):
        y = x * 1.0
        y += 1
        y *= 2
        y[0] -= 1
        y.add_(x)
        return y

    assert_uses_opcode(inplace_on_intermediate, "BINARY_OP", "+=")
    check(inplace_on_intermediate, lambda: A(T(3, 2)), expect="graph")


def test_returned_argument_keeps_its_identity():
    def passthrough(x, y):
        return x, y * 2, [x]

    check(passthrough, _xy, expect="graph")


def test_ops_that_return_self_keep_identity():
    """In eager these return the argument object itself (not a copy, not a view), so a caller's
    later in-place update of the result changes the argument: the optimized call must agree."""
    def returns_self_aliases(x):
        return (+x, torch.nn.functional.dropout(x, p=0.5, training=False), x.contiguous(), x.float(),
                x.to(torch.float32), x.type_as(x))

    assert_uses_opcode(returns_self_aliases, "UNARY_POSITIVE")
    check(returns_self_aliases, lambda: A(T(3, 2)), expect="graph")


def test_tensor_negative_step_raises_like_eager():
    def negative_step(x):
        return x[::-1]

    check(negative_step, lambda: A(T(4)))


def test_view_outputs_alias_their_inputs():
    """A view returned by the call shares memory with the argument, as in eager: writing into
    the result afterwards must change the argument the same way."""
    def views_of_input(x):
        return x[0], x.t(), x.view(-1)[2:5], x[:, 1:].unsqueeze(0)

    opt = specularch.optimize(views_of_input)
    for i in range(3):
        x_eager, x_opt = T(3, 4, seed=i), T(3, 4, seed=i)
        out_eager, out_opt = views_of_input(x_eager), opt(x_opt)
        assert_same(out_eager, out_opt, f"call #{i + 1} result")
        for k, (e, o) in enumerate(zip(out_eager, out_opt)):
            e.add_(k + 1)
            o.add_(k + 1)
            assert_same(x_eager, x_opt, f"call #{i + 1}: argument after writing into result[{k}]")
    expect_graph(specularch.explain(opt), "views_of_input")


def test_closure_cell_change_between_calls_is_seen():
    def make():
        k = 1

        def scaled_by_cell(x):
            return x * k

        def set_k(value):
            nonlocal k
            k = value

        return scaled_by_cell, set_k

    fn, set_k = make()
    pair = Pair.of_function(fn)
    for value in (1, 1, 5, 5, 2.5):
        set_k(value)
        pair.step(lambda: A(T(3)))
    expect_graph(pair.explain(), "scaled_by_cell")


def test_global_tensor_replaced_or_updated_between_calls(monkeypatch):
    pair = Pair.of_function(globals_constant_and_tensor)
    pair.step(lambda: A(T(4)))
    monkeypatch.setitem(globals(), "G_WEIGHT", T(4, seed=12))
    pair.step(lambda: A(T(4)))
    G_WEIGHT.mul_(3)
    pair.step(lambda: A(T(4)))
    monkeypatch.setitem(globals(), "SCALE", 7)
    pair.step(lambda: A(T(4)))
    expect_graph(pair.explain(), "globals_constant_and_tensor")
