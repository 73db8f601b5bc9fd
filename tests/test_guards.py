"""Guards: each kind of fact a graph assumed is re-checked on every call, a changed fact makes
a new graph (never a wrong answer), and failures explain themselves with expected vs actual
and the user's file:line."""
import builtins
import enum
import math

import pytest
import torch
from torch import nn

import specularch
from differential import A, T, check
from specularch.guards import GuardSet, LocalSource, TensorGuard, ValueGuard

pytestmark = pytest.mark.usefixtures("no_profiling")


def _run(fn, *calls):
    opt = specularch.optimize(fn)
    for args in calls:
        expected = fn(*args)
        got = opt(*args)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    return specularch.explain(opt)


def scale_by_default_dtype(x):
    return x * torch.ones(3)


def test_default_dtype_change_recompiles():
    opt = specularch.optimize(scale_by_default_dtype)
    x = torch.ones(3, dtype=torch.float64)
    first = opt(x)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert opt(x).dtype == scale_by_default_dtype(x).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert first.dtype == torch.float64
    e = specularch.explain(opt)
    assert len(e.graphs) == 2 and "default_dtype" in str(e.recompiles[0]), str(e)


def matmul(x, w):
    return x @ w


def test_autocast_change_recompiles():
    opt = specularch.optimize(matmul)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    opt(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = opt(x, w), matmul(x, w)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert "autocast" in str(specularch.explain(opt).recompiles[0])


def test_grad_mode_change_recompiles_and_requires_grad_follows():
    w = torch.randn(3, requires_grad=True)
    opt = specularch.optimize(lambda x: x * w)
    x = torch.randn(3)
    assert opt(x).requires_grad
    with torch.no_grad():
        assert not opt(x).requires_grad
    assert len(specularch.explain(opt).graphs) == 2


def add_twice(a, b):
    return a + b


def test_aliased_arguments_are_guarded():
    x, y = torch.randn(3), torch.randn(3)
    e = _run(add_twice, (x, x), (x, y), (y, y))
    assert e.fallbacks == [] and len(e.graphs) >= 2, str(e)


def uses_optional_attr(m, x):
    if hasattr(m, "scale"):
        return x * m.scale
    return x


class Holder:
    pass


def test_hasattr_is_guarded():
    h = Holder()
    opt = specularch.optimize(uses_optional_attr)
    x = torch.ones(2)
    assert torch.equal(opt(h, x), x)
    h.scale = 3.0
    assert torch.equal(opt(h, x), x * 3)
    del h.scale
    assert torch.equal(opt(h, x), x)


def sum_len(x, items):
    return x * len(items)


def test_shadowing_a_builtin_after_capture_is_noticed():
    opt = specularch.optimize(sum_len)
    x = torch.ones(2)
    assert torch.equal(opt(x, [1, 2]), x * 2)
    globals()["len"] = lambda items: 10
    try:
        assert torch.equal(opt(x, [1, 2]), x * 10)
    finally:
        del globals()["len"]
    assert torch.equal(opt(x, [1, 2]), x * 2)


def make_closure(k):
    def f(x):
        return x * k
    return f


def test_closure_cells_are_guarded_per_function_object():
    f2, f3 = make_closure(2), make_closure(3)
    o2, o3 = specularch.optimize(f2), specularch.optimize(f3)
    x = torch.ones(2)
    assert torch.equal(o2(x), x * 2) and torch.equal(o3(x), x * 3) and torch.equal(o2(x), x * 2)


def test_guard_failure_explains_expected_actual_and_line():
    gs = GuardSet()
    gs.add(TensorGuard.of(LocalSource(0, "x"), torch.zeros(4, 8), where="model.py:12"))
    gs.add(ValueGuard(LocalSource(1, "flag"), True, where="model.py:13"))
    assert gs.first_failure((torch.zeros(4, 8), True), None, {}, builtins.__dict__) is None
    why = gs.first_failure((torch.zeros(3, 8), True), None, {}, builtins.__dict__)
    assert why == "L['x'].shape[0] expected 4, got 3 — model.py:12", why
    why = gs.first_failure((torch.zeros(4), True), None, {}, builtins.__dict__)
    assert why == "L['x'].shape expected (4, 8), got (4,) — model.py:12", why
    why = gs.first_failure((torch.zeros(4, 8), False), None, {}, builtins.__dict__)
    assert why == "L['flag'] expected True, got False — model.py:13", why
    check = gs.compile()
    assert check((torch.zeros(4, 8), True), None, {}, builtins.__dict__)
    assert not check((torch.zeros(4, 8, dtype=torch.float64), True), None, {}, builtins.__dict__)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.use_relu = True

    def forward(self, x):
        y = self.fc(x)
        return torch.relu(y) if self.use_relu else y


def test_module_attribute_flag_recompile_reason_names_the_attribute():
    m = specularch.optimize(Gate())
    x = torch.randn(2, 3)
    m(x)
    m.use_relu = False
    m(x)
    reason = str(specularch.explain(m).recompiles[0])
    assert "L['self'].use_relu expected True, got False" in reason, reason


# ------------------------------------------------------------------ code swapped after capture

class Helper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.scale(self.fc(x))

    def scale(self, y):
        return y * 2


class Plain:
    def ev(self, x):
        return x * 2


def calls_ev(x, p):
    return p.ev(x) + 1


def _swap(obj, name, value):
    old = obj.__dict__.get(name, None) if isinstance(obj, type) else None
    setattr(obj, name, value)
    return old


def test_a_method_swapped_on_the_class_after_capture_is_seen():
    m = specularch.optimize(Helper())
    x = torch.randn(2, 4)
    for _ in range(2):
        m(x)
    old = _swap(Helper, "scale", lambda self, y: y * 3)
    try:
        torch.testing.assert_close(m(x), Helper.forward(m, x), rtol=0, atol=0)
    finally:
        Helper.scale = old
    e = specularch.explain(m)
    assert any("Helper.__dict__['scale']" in str(r) for r in e.recompiles), str(e)


def test_an_instance_attribute_shadowing_a_method_after_capture_is_seen():
    p, x = Plain(), torch.randn(3)
    opt = specularch.optimize(calls_ev)
    for _ in range(2):
        opt(x, p)
    p.ev = lambda x: x * 10  # now found on the instance first
    torch.testing.assert_close(opt(x, p), calls_ev(x, p), rtol=0, atol=0)
    e = specularch.explain(opt)
    assert any("L['p'].__dict__ expected 'ev' not in it" in str(r) for r in e.recompiles), str(e)


def test_a_submodule_forward_patched_on_the_instance_after_capture_is_seen():
    m = specularch.optimize(Helper())
    x = torch.randn(2, 4)
    for _ in range(2):
        m(x)
    m.fc.forward = lambda t: t * 5  # a LoRA-style patch
    torch.testing.assert_close(m(x), x * 5 * 2, rtol=0, atol=0)
    assert [f.kind for f in specularch.explain(m).fallbacks] == ["unsupported_call"]


def test_a_global_module_hook_registered_after_capture_is_seen():
    from torch.nn.modules.module import register_module_forward_hook
    m = specularch.optimize(Helper())
    x = torch.randn(2, 4)
    for _ in range(2):
        m(x)
    handle = register_module_forward_hook(lambda mod, i, o: o * 0 if isinstance(mod, nn.Linear) else None)
    try:
        expected = Helper.forward(m, x)
        assert bool((expected == 0).all())
        torch.testing.assert_close(m(x), expected, rtol=0, atol=0)
    finally:
        handle.remove()
    assert {f.kind for f in specularch.explain(m).fallbacks} == {"module_hooks"}


def _signed(x, s):
    return x * math.copysign(1.0, s)


def test_float_guards_tell_signed_zeros_and_nan_apart():
    """A float baked into a graph is guarded as the same float: -0.0 is not 0.0 (``==`` says
    it is, but ``copysign``, ``1 / s`` and formatting differ), and nan is nan."""
    zero, nan = ValueGuard(LocalSource(0, "s"), expected=0.0), ValueGuard(LocalSource(0, "s"), expected=float("nan"))
    assert zero.reason(0.0) is None and zero.reason(-0.0) is not None
    assert nan.reason(float("nan")) is None and nan.reason(1.0) is not None
    opt = specularch.optimize(_signed)
    with specularch.config.patch(profile_calls=0):
        for s in (0.0, -0.0, 0.0, -0.0):
            assert torch.equal(opt(torch.ones(2), s), _signed(torch.ones(2), s)), s


class Key(str):
    """A str subclass with str's own equality: its value decides dict lookups."""


class LooseKey(str):
    """A str subclass with its own equality: guarded by identity."""

    def __eq__(self, other):
        return str.__eq__(self.lower(), str(other).lower())

    def __hash__(self):
        return hash(self.lower())


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


SCALES = {"train": 2.0, "eval": 3.0, 1: 4.0, 2: 5.0}


def scale_by_key(x, k):
    return x * SCALES[k]


@pytest.mark.parametrize("make_key", [Key, LooseKey, lambda k: Mode.TRAIN if k == "train" else Mode.EVAL],
                         ids=["str_subclass", "own_equality", "int_enum"])
def test_value_subclass_arguments_are_guarded_by_value(make_key):
    """An argument of a str/int subclass looked up in a dict: a graph captured for one value is
    not reused for another (it once had only a type guard and returned the first key's result)."""
    keys = ["train", "train", "eval", "train", "eval"]
    check(scale_by_key, lambda i: A(T(2), make_key(keys[i])), calls=len(keys))


def test_an_input_with_autograd_history_is_not_taken_for_a_leaf():
    """A step captured with a leaf input that requires grad is not reused for an input with
    autograd history: eager's backward goes on into that history (here: ``lin``'s
    gradients), the graph's stops at its inputs. It once ran the graph and lost them."""
    def run(optimized):
        torch.manual_seed(0)
        lin, head = nn.Linear(3, 3), nn.Linear(3, 1)

        def step(x):
            loss = head(x).sum()
            loss.backward()
            return loss.item()
        fn = specularch.optimize(step) if optimized else step
        grads = []
        for i in range(6):
            lin.zero_grad()
            head.zero_grad()
            x = torch.randn(2, 3, requires_grad=True) if i < 4 else lin(torch.randn(2, 3))
            fn(x)
            grads.append(None if lin.weight.grad is None else lin.weight.grad.clone())
        return grads

    with specularch.config.patch(profile_calls=0):
        got = run(True)
    expected = run(False)
    assert [g is None for g in got] == [g is None for g in expected] == [True] * 4 + [False] * 2
    assert all(torch.equal(a, b) for a, b in zip(got[4:], expected[4:]))
