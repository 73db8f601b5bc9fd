"""Differential programs that must fall back to eager Python: data-dependent branches that flip
and data-dependent values, printing, generators, try/except and `raise`, C calls returning Python
objects, writes the shadow heap cannot defer (through a view, through `__setattr__`, `del` of a
global), recursion past config.inline_depth, the cache limit, and module hooks. Writes the shadow
heap does defer (argument lists/objects/dicts, globals, in-place updates of argument tensors and
buffers) are checked here to run as graphs with the heap left exactly as eager leaves it. Each asserts the fallback kind, that the
record points at the offending line of this file, and that results, argument state, stdout and
exceptions are exactly eager's. A few programs whose eager run raises or whose output shape
depends on values are checked for equality with eager only."""
import contextlib
import os
import time

import pytest
import torch
from torch import nn

import specularch
from specularch.dispatch import misses
from differential import (A, DEFAULT_CALLS, T, assert_same, assert_uses_opcode, check, check_module,
                          expect_fallback, marker_line, module_globals)

pytestmark = pytest.mark.usefixtures("no_profiling")

_CALLS = 0


# ------------------------------------------------------------------ data-dependent

def data_dependent_branch(x):
    if x.sum() > 0:  # mark
        return x[:2] * 2  # the sides return different shapes: they cannot be merged
    return x - 1


def data_dependent_while(x):
    while x.abs().max() > 1:  # mark
        x = x / 2
    return x


def item_in_python_arithmetic(x):
    # `.item()` alone is captured (read after the graph runs), and so is arithmetic on it
    # that a torch op takes as a value (`x * (s + 1)`); a number used as a size is not
    s = x.sum().item()
    return x.repeat(int(abs(s)) % 2 + 1), s  # mark


def float_of_tensor(x):
    # `float(t)` taken by an op as a value is captured (test_torch_fn_objects.py), a test on
    # it speculated (test_item_speculation.py); a loop count made from it is not
    k = float(x.max())
    for _ in range(int(abs(k))):  # mark
        x = x / 2
    return x


def tolist_of_tensor(x):
    values = x.tolist()  # mark
    return x * len(values), values


# ------------------------------------------------------------------ exceptions, generators, C calls

def generator_function(x):
    for i in range(3):
        yield x * i


def try_except(x, d):
    try:
        v = d["k"]
    except KeyError:
        v = 1.5
    return x * v


def raise_value_error(x, n):
    if n < 0:
        raise ValueError("bad")  # mark
    return x + n


def perf_counter_call(x):
    t0 = time.perf_counter()  # read when the graph runs (symbolic/speculation/deferred.py); comparing
    y = x * 2                 # clock values needs them while capturing:
    return y, time.perf_counter() >= t0  # mark


def getpid_call(x):
    return x + os.getpid() % 7  # mark


def reseed_inside(x):
    torch.manual_seed(3)  # mark
    return x + torch.rand(3)


def replay_rng_inside(x):
    state = torch.get_rng_state()  # mark
    a = torch.rand(3)
    torch.set_rng_state(state)
    return x + a - torch.rand(3)


# ------------------------------------------------------------------ mutation of pre-existing state

class Box:
    def __init__(self):
        self.count = 0


def append_to_argument_list(x, lst):
    lst.append(x * 2)  # mark
    return x + len(lst)


def set_attribute_on_argument(x, obj):
    obj.last = x * 2  # mark
    obj.count = obj.count + 1
    return x + obj.count


def write_into_argument_dict(x, d):
    d["y"] = x * 2  # mark
    return x - 1


def assign_global(x):
    global _CALLS
    _CALLS += 1  # mark
    return x * _CALLS


def inplace_method_on_argument(x):
    x.add_(1)  # mark
    return x * 2


def setitem_on_argument(x):
    x[0] = 1.0  # mark
    return x.sum()


def augmented_assign_on_argument(x):
    x += 1  # mark
    return x


def setitem_at_a_changing_index(x, i):
    x[i] = -1.0  # i changes every call: a graph input, the write stays in the graph
    y = torch.zeros(6)
    y[i:i + 2] = x[i:i + 2]
    return y, x.sum()


def inplace_through_a_view_of_argument(x):
    x[0].add_(1)  # mark
    return x * 2


class Audited:
    def __init__(self):
        object.__setattr__(self, "log", [])

    def __setattr__(self, name, value):
        self.log.append(name)
        object.__setattr__(self, name, value)


def set_attribute_through_custom_setattr(x, obj):
    obj.last = 1  # mark
    return x + 1


def delete_global(x):
    global _SCRATCH
    del _SCRATCH  # mark
    return x + 1


_SCRATCH = 1


FALLBACKS = [
    (data_dependent_branch, lambda: A(T(4)), "data_dependent_branch"),
    (item_in_python_arithmetic, lambda: A(T(3)), "data_dependent_value"),
    (float_of_tensor, lambda: A(T(3)), "data_dependent_value"),
    (tolist_of_tensor, lambda: A(T(2, 2)), "data_dependent_value"),
    (raise_value_error, lambda: A(T(2), -1), "exception_handling"),
    (perf_counter_call, lambda: A(T(3)), "unsupported_call"),
    (getpid_call, lambda: A(T(3)), "unsupported_call"),
    (reseed_inside, lambda: A(T(3)), "unsupported_call"),
    (replay_rng_inside, lambda: A(T(3)), "unsupported_call"),
    (inplace_through_a_view_of_argument, lambda: A(T(3, 2)), "input_mutation"),
    (set_attribute_through_custom_setattr, lambda: A(T(2), Audited()), "side_effect"),
]

DEFERRED = [
    (data_dependent_while, lambda: A(T(4) * 4)),
    (append_to_argument_list, lambda: A(T(2), [T(2)])),
    (set_attribute_on_argument, lambda: A(T(2), Box())),
    (write_into_argument_dict, lambda: A(T(2), {"x": 1})),
    (inplace_method_on_argument, lambda: A(T(3))),
    (setitem_on_argument, lambda: A(T(3))),
    (augmented_assign_on_argument, lambda: A(T(3))),
    (setitem_at_a_changing_index, lambda i: A(T(6), i % 4)),
]


@pytest.mark.parametrize("fn, make_args", DEFERRED, ids=[f[0].__name__ for f in DEFERRED])
def test_writes_the_shadow_heap_defers_run_as_graphs(fn, make_args):
    """Formerly fallbacks: writes that outlive the call are now committed after the graph."""
    check(fn, make_args, expect="graph")


@pytest.mark.parametrize("fn, make_args, kind", FALLBACKS, ids=[f[0].__name__ for f in FALLBACKS])
def test_fallback_kind_location_and_result(fn, make_args, kind):
    e = check(fn, make_args, expect="fallback", fallback_kind=kind, fallback_line=marker_line(fn, "mark"))
    assert kind in str(e), f"the readable report should name the fallback kind:\n{e}"


def test_global_assignment_is_deferred_and_committed():
    assert_uses_opcode(assign_global, "STORE_GLOBAL")
    check(assign_global, lambda: A(T(3)), expect="graph", state=module_globals(__name__, _CALLS=0))


def test_deleting_a_global_falls_back():
    global _SCRATCH
    assert_uses_opcode(delete_global, "DELETE_GLOBAL")
    opt = specularch.optimize(delete_global)
    for _ in range(2):
        _SCRATCH = 1
        assert torch.equal(opt(torch.ones(2)), torch.ones(2) + 1)
        assert "_SCRATCH" not in globals()
    kinds = [(r.kind, r.lineno) for r in specularch.explain(opt).fallbacks]
    assert kinds == [("side_effect", marker_line(delete_global, "mark"))], kinds
    _SCRATCH = 1


def test_generator_function_runs_eagerly():
    assert_uses_opcode(generator_function, "RETURN_GENERATOR")
    check(generator_function, lambda: A(T(3)), expect="fallback", fallback_kind="generator")


def test_try_except_is_captured():
    """(Once a fallback: try/except is captured now, see test_exceptions_capture.py.)"""
    assert_uses_opcode(try_except, "PUSH_EXC_INFO")
    check(try_except, lambda i: A(T(3), {"k": 2.0} if i % 2 else {}), expect="graph")


def test_raise_after_graphs_were_captured():
    """The first calls capture a graph for n >= 0; a later n < 0 must raise exactly eager's
    ValueError('bad') (not a specularch error) and leave the argument untouched."""
    check(raise_value_error, lambda i: A(T(2), [1, 2, 1, -1, -1][i]), calls=5, expect="fallback",
          fallback_kind="exception_handling", fallback_line=marker_line(raise_value_error, "mark"))


def test_optimized_call_raises_exactly_value_error():
    opt = specularch.optimize(raise_value_error)
    for _ in range(DEFAULT_CALLS):
        with pytest.raises(ValueError) as info:
            opt(torch.ones(2), -1)
        assert type(info.value) is ValueError and str(info.value) == "bad"


# ------------------------------------------------------------------ print

def print_tensor(x):
    print(x)  # mark
    return x + 1


def print_hello(x):
    print("hello")  # mark
    return x * 2


# A tensor's text (its values, and `grad_fn=<...>` when it requires grad) is not captured;
# plain values are printed by the commit (tests/test_deferred_print.py).
@pytest.mark.parametrize("fn, printed, kind", [(print_tensor, lambda x: f"{x}\n", "data_dependent_value"),
                                               (print_hello, lambda x: "hello\n", None)],
                         ids=["print_tensor", "print_hello"])
def test_print_runs_exactly_once_per_call(fn, printed, kind, capsys):
    opt = specularch.optimize(fn)
    for i in range(DEFAULT_CALLS + 2):
        x = T(2, 3, seed=i)
        expected = fn(x.clone())
        eager_out = capsys.readouterr().out
        got = opt(x.clone())
        opt_out = capsys.readouterr().out
        assert_same(expected, got, f"call #{i + 1} result")
        assert eager_out == printed(x), f"test bug: eager printed {eager_out!r}"
        assert opt_out == eager_out, f"call #{i + 1}: optimized printed {opt_out!r}, eager printed {eager_out!r}"
    explanation = specularch.explain(opt)
    if kind is None:
        assert not explanation.fallbacks and explanation.stats.graph_hits >= 2, explanation
    else:
        expect_fallback(explanation, kind, filename=fn.__code__.co_filename,
                        lineno=marker_line(fn, "mark"), what=fn.__name__)


# ------------------------------------------------------------------ limits

def _countdown(x, n):
    if n == 0:
        return x
    return _countdown(x * 0.5 + 1, n - 1)


def deep_recursion(x):
    return _countdown(x, 10)


def test_recursion_deeper_than_inline_depth():
    with specularch.config.patch(inline_depth=4):
        check(deep_recursion, lambda: A(T(3)), expect="fallback", fallback_kind="recursion_limit")


def mode_switch(x, mode):
    if mode == 0:
        return x + 1
    elif mode == 1:
        return x * 2
    return x - 3


def test_cache_limit():
    with specularch.config.patch(cache_limit=2):
        e = check(mode_switch, lambda i: A(T(3), i % 3), calls=9, expect="fallback", fallback_kind="cache_limit")
    assert len(e.graphs) <= 2, f"cache_limit=2 allows at most two graphs:\n{e}"


# ------------------------------------------------------------------ module hooks

def _double_output_hook(module, inputs, output):
    module.hook_calls = getattr(module, "hook_calls", 0) + 1
    return output * 2


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)  # mark
        return self.out(torch.relu(h))


def make_hooked_submodule():
    m = Hooked()
    m.fc.register_forward_hook(_double_output_hook)
    return m


def make_hooked_top_module():
    m = Hooked()
    m.register_forward_hook(_double_output_hook)
    return m


def test_submodule_forward_hook():
    check_module(make_hooked_submodule, lambda: A(T(2, 4)), expect="fallback", fallback_kind="module_hooks",
                 fallback_line=marker_line(Hooked, "mark"))


def test_hook_on_the_optimized_module_runs_once_per_call():
    check_module(make_hooked_top_module, lambda: A(T(2, 4)), grad=True)


class StepCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.steps.add_(1)  # mark
        return self.fc(x) * self.steps


class RemembersLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        y = self.fc(x)
        self.last_norm = y.norm()  # mark
        return y


def test_buffer_updated_in_place_inside_forward_is_committed():
    check_module(StepCounter, lambda: A(T(2, 3)), expect="graph")


def test_attribute_assigned_on_self_inside_forward_is_committed():
    check_module(RemembersLast, lambda: A(T(2, 3)), expect="graph")


# ------------------------------------------------------------------ eager raises / value-dependent shapes

def boolean_mask_indexing(x):
    return x[x > 0] * 2


def shape_mismatch(x, y):
    return x + y


def inplace_on_leaf_requiring_grad(x):
    x.mul_(2)
    return x


def matmul_shapes(x, y):
    return x @ y


def missing_key(x, d):
    return x * d["missing"]


def zero_division(x, n):
    return x * (1 / n)


@pytest.mark.parametrize("fn, make_args", [
    (boolean_mask_indexing, lambda: A(T(3, 4))),
    (shape_mismatch, lambda: A(T(3), T(4))),
    (inplace_on_leaf_requiring_grad, lambda: A(T(3, requires_grad=True))),
    (matmul_shapes, lambda i: A(T(2, 3), T(3, 2) if i < 2 else T(4, 2))),
    (missing_key, lambda: A(T(2), {"present": 1.0})),
    (zero_division, lambda i: A(T(2), [2, 1, 0][i])),
], ids=["boolean_mask_indexing", "shape_mismatch", "inplace_on_leaf_requiring_grad", "error_after_graphs",
        "missing_key", "zero_division"])
def test_equals_eager_including_exceptions(fn, make_args):
    check(fn, make_args)


def test_strict_mode_raises_instead_of_falling_back():
    opt = specularch.optimize(item_in_python_arithmetic)
    with specularch.config.patch(strict=True):
        with pytest.raises(specularch.records.SpecularchStrictError, match="data_dependent_value"):
            for _ in range(DEFAULT_CALLS + 2):
                opt(torch.ones(3))


def test_fallback_count_is_the_number_of_calls_that_ran_eagerly():
    """Each record's ``count`` is how many calls ran eagerly for its reason, also when the
    same reason recurs (the graph raising again, a generator called again)."""
    def gather(x, idx):
        return x[idx] * 2  # mark

    opt = specularch.optimize(gather)
    bad = [i % 3 == 1 for i in range(7)]
    for is_bad in bad:
        with pytest.raises(IndexError) if is_bad else contextlib.nullcontext():
            opt(torch.arange(4.0), torch.tensor([1, 9 if is_bad else 2]))
    e = specularch.explain(opt)
    assert [(f.kind, f.count) for f in e.fallbacks] == [("exception_handling", sum(bad))], str(e)
    assert e.stats.fallback_calls == sum(bad), str(e)

    gen = specularch.optimize(generator_function)
    for _ in range(3):
        list(gen(torch.ones(2)))
    assert [(f.kind, f.count) for f in specularch.explain(gen).fallbacks] == [("generator", 3)]

    item = specularch.optimize(item_in_python_arithmetic)
    for i in range(4):
        item(T(i % 2 + 2))
    e = specularch.explain(item)
    assert sum(f.count for f in e.fallbacks) == e.stats.fallback_calls == 4, str(e)


def test_a_capture_failing_on_tensor_values_leaves_other_values_to_graphs(monkeypatch):
    """A call that cannot be captured because of tensor values the guards do not see (an
    index out of range; a ``raise`` under a speculated tensor branch) does not make every
    later call with the same guards eager; after ``VALUE_DEPENDENT_RETRIES`` such calls the
    path is remembered as eager, so captures stay bounded."""
    captures = []
    capture = misses.capture
    monkeypatch.setattr(misses, "capture",
                        lambda *a, **k: captures.append(1) or capture(*a, **k))

    def gather(x, idx):
        return x[idx] * 2

    def checked(x):
        if x.sum() < 0:
            raise ValueError("negative input")
        return x + 1

    for fn, bad, good, error in [(gather, (T(4), torch.tensor([9])), (T(4), torch.tensor([1])),
                                  IndexError),
                                 (checked, (-torch.ones(3),), (torch.ones(3),), ValueError)]:
        opt = specularch.optimize(fn)
        with pytest.raises(error):
            opt(*bad)
        for _ in range(3):
            assert_same(fn(*good), opt(*good))
        e = specularch.explain(opt)
        assert len(e.graphs) == 1 and e.stats.graph_hits == 2, str(e)

    always_bad = specularch.optimize(gather)
    captures.clear()
    retries = specularch.dispatch.VALUE_DEPENDENT_RETRIES
    for _ in range(retries + 4):
        with pytest.raises(IndexError):
            always_bad(T(4), torch.tensor([9]))
    assert len(captures) == retries + 1
    assert specularch.explain(always_bad).stats.fallback_calls == retries + 4
