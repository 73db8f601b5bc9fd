"""`warnings.warn(...)` inside an optimized function is a deferred effect like `print`: the
commit calls `warn_explicit` with the location eager's `warn` would find, so the filters, the
per-module registry ("once per location") and `showwarning` act as in eager. A filter that
turns the warning into an error makes the call run eagerly (eager raises mid-call).
Differential on the warnings recorded (text, category, file, line), values and heap state."""
import warnings

import pytest
import torch
from torch import nn

import specularch


def _hits(opt) -> int:
    return specularch.explain(opt).stats.graph_hits


def _seen(records) -> list:
    return [(str(r.message), r.category, r.filename, r.lineno) for r in records]


def _helper(x):
    warnings.warn("helper says hi", DeprecationWarning, stacklevel=2)  # the caller's line
    return x * 2


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        warnings.warn("forward runs")
        y = _helper(self.lin(x))
        warnings.warn(f"mean is {y.mean().item():.3f}", RuntimeWarning)
        return y


def _run(module_or_fn, xs, action):
    """Every warning and result of calling ``module_or_fn`` on ``xs`` under ``action``."""
    out = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter(action)
        for x in xs:
            out.append(module_or_fn(x))
    return out, _seen(records)


@pytest.mark.parametrize("action", ["always", "default", "module", "once", "ignore"])
def test_warnings_replayed_as_eager_under_each_filter_action(action):
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i % 3)) for i in range(9)]
    torch.manual_seed(0)
    ref = Counter()
    torch.manual_seed(0)
    fast_module = Counter()
    fast = specularch.optimize(fast_module)
    expected, eager_seen = _run(ref, xs, action)
    got, fast_seen = _run(fast, xs, action)
    assert fast_seen == eager_seen
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert fast_module.calls == ref.calls
    assert _hits(fast) >= 4, specularch.explain(fast)


def test_once_per_location_across_graph_calls():
    """The default filter shows a warning once per (text, category, line) per module: the
    profiled eager calls fill the module's registry and the graph calls consult it."""
    def step(x):
        warnings.warn("deprecated path", FutureWarning)
        return x.relu()
    fast = specularch.optimize(step)
    xs = [torch.randn(5) for _ in range(8)]
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("default")
        for x in xs:
            step(x)
        eager_seen = _seen(records)
        records.clear()
        warnings.simplefilter("default")  # a filter change resets the registry, as in eager
        for x in xs:
            assert torch.equal(fast(x), x.relu())
        assert _seen(records) == eager_seen and len(eager_seen) == 1
    assert _hits(fast) >= 4


def test_error_filter_raises_as_eager_and_leaves_the_same_state():
    torch.manual_seed(0)
    ref = Counter()
    torch.manual_seed(0)
    fast_module = Counter()
    fast = specularch.optimize(fast_module)
    x = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for _ in range(8):  # captured under "always"
            assert torch.equal(fast(x), ref(x))
    assert _hits(fast) >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="forward runs"):
            ref(x)
        for _ in range(3):
            with pytest.raises(UserWarning, match="forward runs"):
                fast(x)
    assert fast_module.calls == ref.calls + 2
    with warnings.catch_warnings():  # an error for only one of the categories, after capture
        warnings.simplefilter("always")
        warnings.filterwarnings("error", category=RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="mean is"):
            ref(x)
        with pytest.raises(RuntimeWarning, match="mean is"):
            fast(x)
    assert fast_module.calls == ref.calls + 2


class Far(nn.Module):
    def forward(self, x):
        warnings.warn("your call site", stacklevel=2)  # the line in nn.Module's call machinery
        return x + 1


def test_stacklevel_outside_the_call_runs_eagerly():
    x = torch.ones(2)
    _, eager_seen = _run(Far(), [x] * 5, "always")
    fast = specularch.optimize(Far())
    _, fast_seen = _run(fast, [x] * 5, "always")
    assert [w[:2] for w in fast_seen] == [w[:2] for w in eager_seen]
    assert specularch.explain(fast).fallbacks[0].kind == "unsupported_call"


@pytest.mark.xfail(strict=True, reason="known: an eager run of an optimized object has "
                   "specularch's unbinder frame as the caller of its root frame, so stacklevel=2 "
                   "names '<specularch unbinder>' (not introduced here; see the report)")
def test_stacklevel_outside_the_call_names_the_callers_line():
    x = torch.ones(2)
    _, eager_seen = _run(Far(), [x] * 5, "always")
    _, fast_seen = _run(specularch.optimize(Far()), [x] * 5, "always")
    assert fast_seen == eager_seen
