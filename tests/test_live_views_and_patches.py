"""Three places where an optimized call could give a wrong answer or a wrong diagnosis:

* dict views (``d.keys()``, ``d.values()``, ``d.items()``) are live views of their dict, as in
  CPython: writes to the dict after the view was made are seen, inside the call and after it
  (a view returned or stored on an object is a real view of the real dict);
* a merged tensor branch (both sides computed, selected with torch.where) whose side not taken
  raises in the graph is recorded as a data-dependent branch naming the exception and line,
  not as a backend bug, and the call still returns eager's answer;
* patching torch after capture (``nn.Linear.forward``, ``F.linear``, ``torch.relu``, a hook)
  is seen: the next call never returns the stale graph's result.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from differential import A, T, check, check_module, marker_line

pytestmark = pytest.mark.usefixtures("no_profiling")


# ------------------------------------------------------------------ live dict views

def views_of_a_new_dict(x, y):
    d = {"a": x, "b": x * 2}
    keys, values, items = d.keys(), d.values(), d.items()
    d["c"] = y
    del d["a"]
    seen = [k for k in keys]
    return ("c" in keys, "a" in keys, len(values), len(items), seen,
            sum(values), [(k, v + 1) for k, v in items], bool(keys))


def view_comparisons_and_set_ops(x):
    d = {"a": 1, "b": 2}
    keys, items, values = d.keys(), d.items(), d.values()
    d["c"] = 3
    return (keys == {"a", "b", "c"}, keys & {"b", "c", "z"}, keys - {"a"}, keys | {"z"},
            items == {("a", 1), ("b", 2), ("c", 3)}, ("c", 3) in items, 3 in values,
            values == values, d.values() == d.values(), keys.isdisjoint(["c"]),
            sorted(keys), list(values), x * len(keys))


def views_of_an_argument_dict(x, d):
    keys, values = d.keys(), d.values()
    d["new"] = x * 3
    return "new" in keys, len(values), [v * 1 for v in values], list(keys)


def iterate_view_then_mutate(x):
    d = {"a": x, "b": x + 1}
    values = d.values()
    it = iter(values)
    first = next(it)
    d["c"] = x * 2
    return first, next(it)  # eager: RuntimeError (dict changed size during iteration)


@pytest.mark.parametrize("fn", [views_of_a_new_dict, view_comparisons_and_set_ops])
def test_views_of_a_dict_made_in_the_call_are_live(fn):
    args = (lambda: A(T(3), T(3))) if fn is views_of_a_new_dict else (lambda: A(T(3)))
    check(fn, args, expect="graph")


def test_views_of_an_argument_dict_see_the_shadow_heap():
    check(views_of_an_argument_dict, lambda: A(T(3), {"a": T(3), "b": T(3)}), expect="graph")


def test_iterating_a_view_whose_dict_changed_raises_as_eager():
    check(iterate_view_then_mutate, lambda: A(T(3)))


class _Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.table = {"w": torch.ones(3)}

    def forward(self, x):
        values = self.table.values()
        self.table["h"] = self.lin(x)
        self.seen = self.table.keys()  # stored on the module: must stay a live view
        return sum(values), len(values), "h" in self.seen


def test_views_of_a_dict_held_on_self():
    def reset(m, i):
        m.table = {"w": torch.ones(3)}
    check_module(_Table, lambda: A(T(2, 3)), between=reset, expect="graph")


def returns_views(x, d):
    new = {"a": x}
    d["k"] = x + 1
    return new, new.keys(), d.items(), d.values()


def test_returned_and_stored_views_are_live_views_of_the_real_dicts():
    opt = specularch.optimize(returns_views)
    for _ in range(2):
        d = {"z": torch.zeros(2)}
        new, new_keys, d_items, d_values = opt(torch.ones(2), d)
        assert type(new_keys).__name__ == "dict_keys" and type(d_items).__name__ == "dict_items"
        assert list(new_keys) == ["a"] and list(d) == ["z", "k"] and len(d_values) == 2
        new["b"] = 1
        d["later"] = torch.ones(2)
        del d["z"]
        assert list(new_keys) == ["a", "b"]  # a view of the returned dict itself
        assert [k for k, _ in d_items] == ["k", "later"] and len(d_values) == 2
    assert not specularch.explain(opt).fallbacks

    m = specularch.optimize(_Table())
    m.table = {"w": torch.ones(3)}
    m(torch.ones(2, 3))
    m.table["after"] = torch.ones(3)
    assert list(m.seen) == ["w", "h", "after"]


# ------------------------------------------------------------------ merged branch that raises

def merged_index(x, i):
    if x.sum() > 0:  # branch
        y = x * 2
    else:
        y = x[i] + x  # op
    return y


def merged_floordiv(x, n):
    if x.sum() > 0:  # branch
        y = x * 2
    else:
        y = x // n  # op
    return y


@pytest.mark.parametrize("fn, bad, exc", [(merged_index, 5, "IndexError"),
                                          (merged_floordiv, 0, "ZeroDivisionError")])
def test_merged_branch_whose_side_not_taken_raises_is_a_data_dependent_branch(fn, bad, exc):
    opt = specularch.optimize(fn)
    base = torch.arange(1, 4)
    # positive then negative: the branch is merged (both sides, torch.where) from call 3 on
    for sign, k in [(1, 1), (-1, 1), (-1, 2), (1, bad), (1, bad)]:
        x, k = base * sign, torch.tensor(k)
        assert torch.equal(opt(x, k), fn(x, k))
    report = specularch.explain(opt)
    assert len(report.graphs) == 1
    assert [r.kind for r in report.fallbacks] == ["assumption_failed", "data_dependent_branch"]
    record = report.fallbacks[-1]
    assert record.count == 2 and record.lineno == marker_line(fn, "branch")
    assert exc in record.explanation and "side this call does not take" in record.explanation
    assert f":{marker_line(fn, 'op')}" in record.explanation
    assert "report" not in (record.explanation + record.hint).lower()


# ------------------------------------------------------------------ torch patched after capture

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _pair():
    """An eager model and an optimized copy with the same weights, both called twice (the
    second call of the optimized one runs the cached graph)."""
    eager, opt = _mlp(), specularch.optimize(_mlp())
    x = torch.randn(3, 4)
    for _ in range(2):
        assert torch.equal(opt(x), eager(x))
    return eager, opt, x


def _same_with_and_without(patch, eager, opt, x):
    before = specularch.explain(opt).stats.graph_hits
    with patch():
        assert torch.equal(opt(x), eager(x))
        assert torch.equal(opt(x), eager(x))
    assert torch.equal(opt(x), eager(x))  # unpatched: correct again
    assert specularch.explain(opt).stats.graph_hits > before  # graphs still serve the calls


def test_patching_a_torch_module_method_after_capture(monkeypatch):
    eager, opt, x = _pair()
    original = nn.Linear.forward

    def patch():
        return _patched(monkeypatch, nn.Linear, "forward",
                        lambda self, inp: original(self, inp) * 10 + 1)
    _same_with_and_without(patch, eager, opt, x)
    assert "Linear.forward was replaced" in str(specularch.explain(opt).recompiles)


def test_rebinding_a_torch_function_after_capture(monkeypatch):
    eager, opt, x = _pair()
    original = F.linear
    _same_with_and_without(lambda: _patched(monkeypatch, F, "linear",
                                            lambda i, w, b=None: original(i, w, b) - 3),
                           eager, opt, x)


def relu_twice(x):
    return torch.relu(x) + F.relu(x) * 2


@pytest.mark.parametrize("module, name", [(torch, "relu"), (F, "relu")])
def test_patching_a_function_read_through_a_module_attribute(monkeypatch, module, name):
    opt = specularch.optimize(relu_twice)
    x = torch.randn(5)
    for _ in range(2):
        assert torch.equal(opt(x), torch.relu(x) + F.relu(x) * 2)
    original = getattr(module, name)
    with _patched(monkeypatch, module, name, lambda t, **kw: original(t, **kw) * 3 + 1):
        expected = torch.relu(x) + F.relu(x) * 2  # eager, through the patch
        assert torch.equal(opt(x), expected) and torch.equal(opt(x), expected)
    assert torch.equal(opt(x), torch.relu(x) + F.relu(x) * 2)


def test_hooks_registered_after_capture():
    eager, opt, x = _pair()
    hooks = [m[0].register_forward_hook(lambda mod, args, out: out * 7) for m in (eager, opt)]
    assert torch.equal(opt(x), eager(x))
    for h in hooks:
        h.remove()
    assert torch.equal(opt(x), eager(x))


class _CallOverride(nn.Linear):
    def __call__(self, x):
        return super().__call__(x) * 2


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _CallOverride(3, 3)

    def forward(self, x):
        return self.inner(x) + 1  # call


def test_a_module_class_overriding_call_is_not_captured_as_forward():
    check_module(_Outer, lambda: A(T(2, 3)), expect="fallback", fallback_kind="unsupported_call",
                 fallback_line=marker_line(_Outer.forward, "call"))


class _patched:
    """``setattr(owner, name, value)`` for a ``with`` block (monkeypatch restores it too)."""

    def __init__(self, monkeypatch, owner, name, value):
        self.args, self.monkeypatch = (owner, name, value), monkeypatch

    def __enter__(self):
        self.original = getattr(*self.args[:2])
        self.monkeypatch.setattr(*self.args)

    def __exit__(self, *exc):
        self.monkeypatch.setattr(*self.args[:2], self.original)
