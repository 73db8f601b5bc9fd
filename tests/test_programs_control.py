"""Differential programs, control-flow family: `for` over range / lists / tuples / dict items /
enumerate / zip / reversed / tensor rows, nested loops, `while`, `break`/`continue`/`for-else`,
branches on Python values (bool and str arguments, a global flag, `module.training`,
`x.dim()`, `x.shape[0]`, `x.dtype`, `isinstance`), ternaries and early returns; a Python flag
that flips between calls (recompile, then cache hits), shape and dtype changes between calls,
and a few harder constructs (`match`, `assert`, `with`) that are checked for correctness only."""
import pytest
import torch
from torch import nn

from differential import A, Pair, T, assert_uses_opcode, check, expect_graph, graph_code_without_comments

pytestmark = pytest.mark.usefixtures("no_profiling")

GLOBAL_FLAG = True


# ------------------------------------------------------------------ loops

def for_range(x, n):
    acc = x
    for i in range(n):
        acc = acc * 0.5 + i
    for i in range(1, 7, 3):
        acc = acc - i
    return acc


def for_over_list(xs):
    out = 0
    for t in xs:
        out = out + t.sum(0)
    return out


def for_over_tuple_of_ints(x):
    for s in (1, 2, 3):
        x = x * s - 1
    return x


def for_dict_items(d):
    out = {}
    for k, v in d.items():
        out[k] = v * 2 if k.startswith("w") else v - 1
    for k in d:
        out[k + "_norm"] = d[k].abs().sum()
    return out


def for_enumerate(xs):
    total = 0
    for i, t in enumerate(xs, start=1):
        total = total + i * t
    return total


def for_zip(xs, ws, names):
    out = {}
    for t, w, name in zip(xs, ws, names):
        out[name] = t * w
    return out


def for_reversed(xs):
    acc = xs[0] * 0
    for t in reversed(xs):
        acc = acc * 2 + t
    return acc


def nested_loops(x, n):
    for i in range(n):
        for j in range(i):
            x = x + i * j
        x = x * 0.5
    return x


def while_counter(x, n):
    i = 0
    while i < n:
        x = x * 2 - 1
        i += 1
    return x, i


def break_and_continue(xs, limit):
    out = xs[0] * 0
    for i, t in enumerate(xs):
        if i == 1:
            continue
        if i >= limit:
            break
        out = out + t * (i + 1)
    return out


def for_else(x, items):
    for v in items:
        if v < 0:
            break
        x = x + v
    else:
        x = x * 10
    return x


def iterate_tensor_rows(x):
    rows = []
    for row in x:
        rows.append(row * 2 + row.sum())
    return torch.stack(rows)


def loop_collect_then_stack(x, n):
    outs = []
    h = x
    for _ in range(n):
        h = torch.tanh(h * 1.5)
        outs.append(h)
    return torch.stack(outs), len(outs)


def while_true_with_break(x, limit):
    total = 0
    while True:
        total += 1
        x = x + total
        if total >= limit:
            break
    return x


def late_binding_lambdas(x):
    bound = [lambda y, i=i: y * i for i in range(3)]
    late = [lambda y: y * i for i in range(3)]  # noqa: B023 - late binding is the point
    return sum(f(x) for f in bound), sum(f(x) for f in late)


# ------------------------------------------------------------------ branches

def branch_on_bool_arg(x, flag):
    if flag:
        return x.relu()
    return x.sigmoid()


def branch_on_str_arg(x, mode):
    if mode == "sum":
        return x.sum(0)
    elif mode == "mean":
        return x.mean(0)
    return x.amax(0)


def branch_on_global_flag(x):
    if GLOBAL_FLAG:
        return x + 1
    return x - 1


def branch_on_training(m, x):
    y = m(x)
    if m.training:
        y = y * 0.5
    return y


def branch_on_dim(x):
    if x.dim() == 2:
        return x.sum(-1)
    return x.flatten(1).sum(-1)


def branch_on_shape(x):
    if x.shape[0] > 2:
        return x[:2] * 2
    return torch.cat([x, x], 0)


def branch_on_dtype(x):
    if x.dtype == torch.float16:
        return (x.float() * 2).half()
    elif x.dtype == torch.int64:
        return x * 3
    return x / 2


def branch_on_isinstance(x, s):
    if isinstance(s, torch.Tensor):
        return x * s
    elif isinstance(s, (int, float)):
        return x + s
    return x


def ternaries(x, flag, k):
    y = x * 2 if flag else x - 1
    z = y if k > 2 else -y
    return z, ("big" if k > 2 else "small")


def early_return(x, n):
    if n == 0:
        return x
    if n < 0:
        return -x, n
    y = x * n
    return y.sum()


def shape_polymorphic(x):
    b, n = x.shape
    return (x.reshape(n, b) * 2).sum(0), x.new_ones(b).cumsum(0)


def dtype_polymorphic(x):
    return (x * 2 + 1).sum(), x.dtype, (x > 0).sum()


def empty_and_size_one(x):
    return x.sum(0), x.shape[0] == 0, x.expand(x.shape[0], 3) * 2, x.new_zeros(x.shape[0])


def non_contiguous_inputs(x):
    return x.reshape(-1) * 2, x.is_contiguous(), x.contiguous().view(-1), x.stride()


def _module_for_training(i):
    m = nn.Linear(3, 2)
    return m.train() if i % 2 == 0 else m.eval()


LOOPS = [
    (for_range, lambda i: A(T(3), 3 + i), ["FOR_ITER", "GET_ITER", "JUMP_BACKWARD"]),
    (for_over_list, lambda: A([T(2, 3), T(2, 3), T(2, 3)]), ["FOR_ITER"]),
    (for_over_tuple_of_ints, lambda: A(T(4)), ["FOR_ITER"]),
    (for_dict_items, lambda: A({"w1": T(3), "b1": T(3), "w2": T(2)}), ["FOR_ITER"]),
    (for_enumerate, lambda: A([T(2), T(2), T(2)]), ["FOR_ITER"]),
    (for_zip, lambda: A([T(2), T(3)], [T(2), T(3)], ["a", "b"]), ["FOR_ITER"]),
    (for_reversed, lambda: A([T(3), T(3), T(3)]), ["FOR_ITER"]),
    (nested_loops, lambda: A(T(2), 4), ["FOR_ITER"]),
    (while_counter, lambda i: A(T(3), 2 + i), ["POP_JUMP_BACKWARD_IF_TRUE"]),
    (break_and_continue, lambda i: A([T(2)] * 5, 3 + i % 2), ["JUMP_BACKWARD"]),
    (for_else, lambda i: A(T(2), [1, 2, 3] if i % 2 == 0 else [1, -1, 3]), ["FOR_ITER"]),
    (iterate_tensor_rows, lambda: A(T(3, 4)), ["FOR_ITER"]),
    (loop_collect_then_stack, lambda: A(T(2, 2), 4), ["FOR_ITER"]),
    (while_true_with_break, lambda: A(T(3), 3), ["JUMP_BACKWARD"]),
    (late_binding_lambdas, lambda: A(T(3)), ["LOAD_DEREF"]),
]

BRANCHES = [
    (branch_on_bool_arg, lambda i: A(T(2, 3), i % 2 == 0), ["POP_JUMP_FORWARD_IF_FALSE"]),
    (branch_on_str_arg, lambda i: A(T(3, 2), ["sum", "mean", "max"][i]), ["COMPARE_OP"]),
    (branch_on_training, lambda i: A(_module_for_training(i), T(2, 3)), ["LOAD_ATTR"]),
    (branch_on_dim, lambda i: A(T((3, 4) if i % 2 == 0 else (2, 3, 4))), ["COMPARE_OP"]),
    (branch_on_shape, lambda i: A(T([(4, 3), (2, 3), (5, 3)][i])), ["COMPARE_OP"]),
    (branch_on_dtype, lambda i: A(T(4, dtype=[torch.float16, torch.int64, torch.float32][i])), ["COMPARE_OP"]),
    (branch_on_isinstance, lambda i: A(T(3), [T(3), 2, "none"][i]), ["LOAD_GLOBAL"]),
    (ternaries, lambda i: A(T(3), i % 2 == 0, i + 1), ["POP_JUMP_FORWARD_IF_FALSE"]),
    (early_return, lambda i: A(T(3), [0, -2, 3][i]), ["RETURN_VALUE"]),
    (shape_polymorphic, lambda i: A(T([(2, 3), (4, 5), (2, 3), (6, 1)][i])), ["UNPACK_SEQUENCE"]),
    (empty_and_size_one, lambda i: A(T([(0, 3), (1, 3), (4, 3), (1, 3)][i])), ["COMPARE_OP"]),
    (non_contiguous_inputs, lambda i: A(T(3, 4) if i % 2 == 0 else T(4, 3).t()), ["LOAD_METHOD"]),
    (dtype_polymorphic, lambda i: A(T(5, dtype=[torch.float32, torch.float64, torch.float32, torch.int32][i])),
     ["BINARY_OP"]),
]


@pytest.mark.parametrize("fn, make_args, opcodes", LOOPS, ids=[p[0].__name__ for p in LOOPS])
def test_loop_program_runs_as_graph(fn, make_args, opcodes):
    for opcode in opcodes:
        assert_uses_opcode(fn, opcode)
    check(fn, make_args, expect="graph")


@pytest.mark.parametrize("fn, make_args, opcodes", BRANCHES, ids=[p[0].__name__ for p in BRANCHES])
def test_branch_program_runs_as_graph(fn, make_args, opcodes):
    """Each call may take another branch or shape/dtype: every call must still equal eager,
    through recompiles (within the default cache limit) rather than fallbacks."""
    for opcode in opcodes:
        assert_uses_opcode(fn, opcode)
    calls = 4 if fn in (shape_polymorphic, dtype_polymorphic, empty_and_size_one, non_contiguous_inputs) else 3
    check(fn, make_args, calls=calls, expect="graph")


def test_list_length_changes_between_calls():
    check(for_over_list, lambda i: A([T(2, 3) for _ in range(1 + i % 3)]), calls=5, expect="graph")


def test_requires_grad_and_grad_mode_changes_between_calls():
    """Whether outputs require grad follows the inputs and the grad mode of each call."""
    def affine(x, w):
        return x @ w + 1

    pair = Pair.of_function(affine)
    pair.step(lambda: A(T(2, 3), T(3, 3)))
    pair.step(lambda: A(T(2, 3), T(3, 3, requires_grad=True)))
    with torch.no_grad():
        pair.step(lambda: A(T(2, 3), T(3, 3, requires_grad=True)))
    pair.step(lambda: A(T(2, 3, requires_grad=True), T(3, 3)))
    pair.step(lambda: A(T(2, 3), T(3, 3)))
    expect_graph(pair.explain(), "affine")


def test_global_flag_change_is_guarded(monkeypatch):
    assert_uses_opcode(branch_on_global_flag, "LOAD_GLOBAL")
    check(branch_on_global_flag, lambda: A(T(3)), expect="graph")
    monkeypatch.setitem(globals(), "GLOBAL_FLAG", False)
    check(branch_on_global_flag, lambda: A(T(3)), expect="graph")


def test_python_flag_flip_recompiles_then_hits_cache():
    def flip(x, flag):
        if flag:
            y = x.sin()
        else:
            y = x.cos()
        return y * 2

    pair = Pair.of_function(flip)
    for _ in range(3):
        pair.step(lambda: A(T(3, 4), True))
        pair.step(lambda: A(T(3, 4), False))
    e = pair.explain()
    expect_graph(e, "flip")
    assert len(e.graphs) == 2, f"one graph per flag value expected:\n{e}"
    kinds = sorted(("sin" in c, "cos" in c) for c in map(graph_code_without_comments, e.graphs))
    assert kinds == [(False, True), (True, False)], f"each graph should hold only its branch:\n{e}"
    for g in e.graphs:
        assert any("flag" in guard for guard in g.guards), f"graph must guard on `flag`: {g.guards}"
    assert e.stats.recompiles >= 1 and len(e.recompiles) >= 1, str(e)
    assert str(e)

    pair.step(lambda: A(T(3, 4), True))
    after = pair.explain()
    assert len(after.graphs) == 2, f"calling with a seen flag value must not capture again:\n{after}"
    assert after.stats.graph_hits == e.stats.graph_hits + 1
    assert after.stats.captures == e.stats.captures
    assert after.stats.calls == e.stats.calls + 1


# ------------------------------------------------------------------ harder constructs: correctness only

def match_statement(x, spec):
    match spec:
        case ("scale", k):
            return x * k
        case {"shift": s}:
            return x + s
        case [*_]:
            return x * len(spec)
        case _:
            return -x


def assert_on_python_value(x, n):
    # pytest rewrites asserts in test modules: the failing path calls pytest's helpers to build
    # the message, which the optimized call must reproduce exactly.
    assert n > 0, "n must be positive"
    return x * n


def with_no_grad(x, w):
    with torch.no_grad():
        frozen = x * w
    return frozen + x * w


@pytest.mark.parametrize("fn, make_args, opcode", [
    (match_statement, lambda i: A(T(3), [("scale", 2.0), {"shift": 1.5}, [1, 2, 3]][i]), "MATCH_SEQUENCE"),
    (assert_on_python_value, lambda i: A(T(3), [2, 3, -1][i]), "RAISE_VARARGS"),
    (with_no_grad, lambda: A(T(3, requires_grad=True), T(3, requires_grad=True)), "BEFORE_WITH"),
], ids=["match_statement", "assert_on_python_value", "with_no_grad"])
def test_hard_construct_equals_eager(fn, make_args, opcode):
    assert_uses_opcode(fn, opcode)
    check(fn, make_args, grad=fn is with_no_grad)
