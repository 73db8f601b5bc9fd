"""Numbers the commit computes (symbolic/speculation/deferred.py): arithmetic on `.item()` values stored,
returned and printed (a running reward, a summed loss) is evaluated after the graph with
Python's own operators, bit-identical to eager; a use that steers Python still falls back.
Clock reads (`time.perf_counter()` & co.) are read before or after the graph. LBFGS and
`Tensor.numpy()` fall back once, with a precise reason, and are not captured again."""
import math
import time

import pytest
import torch
from torch import nn

import specularch
from differential import A, Pair, T, check, check_module, expect_graph, marker_line
from speculation_helpers import carried_globals

running_reward = 10.0
best = -1.0e9


# ------------------------------------------------------------------ a REINFORCE step

def make_reinforce_step():
    """A REINFORCE update with its own policy (one for each side of the comparison)."""
    torch.manual_seed(0)
    policy = nn.Linear(4, 2)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-2)

    def reinforce_step(states, actions, returns):
        global running_reward, best
        logp = torch.log_softmax(policy(states), dim=-1).gather(1, actions[:, None]).squeeze(1)
        loss = -(logp * returns).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ep_reward = returns.sum()
        running_reward = 0.05 * ep_reward.item() + 0.95 * running_reward
        best = max(best, round(running_reward, 4))
        print(f"running reward {running_reward:.6f} best {best}")
        return loss, policy.weight.detach().clone()
    return reinforce_step


def test_reinforce_running_reward_is_computed_after_the_graph(no_profiling):
    def make_args(i):
        g = torch.Generator().manual_seed(i)
        return A(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g),
                 torch.randn(6, generator=g) * 3)
    opt = specularch.optimize(make_reinforce_step())
    pair = Pair("reinforce_step", make_reinforce_step(), opt, opt,
                state=carried_globals(__name__, running_reward=10.0, best=-1.0e9))
    for _ in range(6):
        pair.step(make_args)
    e = pair.explain()
    expect_graph(e)
    assert e.stats.graph_hits >= 3, e


# ------------------------------------------------------------------ a training loop step

class Trainer(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        self._opt = torch.optim.Adam(self.net.parameters(), lr=1e-2)
        self.total = 0.0
        self.steps = 0
        self.history = []

    def forward(self, x, y):
        self._opt.zero_grad()
        loss = nn.functional.mse_loss(self.net(x), y)
        loss.backward()
        self._opt.step()
        self.total += loss.item()
        self.steps += 1
        self.avg = self.total / self.steps
        self.history.append(-loss.item() * 2 + 1)
        return loss


def test_train_step_sums_loss_item_into_an_attribute(no_profiling):
    def make_args(i):
        g = torch.Generator().manual_seed(i)
        return A(torch.randn(7, 5, generator=g), torch.randn(7, 1, generator=g))
    e = check_module(Trainer, make_args, calls=6, expect="graph")
    assert e.stats.graph_hits >= 3, e


# ------------------------------------------------------------------ every operation, bit-exact

def arithmetic(x, scale):
    s, m = x.sum().item(), x.abs().max().item()
    n = (x > 0).sum().item()  # an int
    out = [s + m, s - 0.1, 0.1 * s, s / 3, m // 0.3, s % 0.7, s ** 2, 2 ** n, -s, +m, abs(s),
           round(s, 3), round(m), int(s * 100), float(n), min(s, m, 0.25), max(0.5, m),
           math.sqrt(m), math.exp(s / 10), math.floor(s), s * scale, n + 1, n * scale, n // 2]
    total = 0
    for v in out:
        total += v
    out.append(total)
    out.append(sum([s, m, s * m]))
    return out


def test_arithmetic_on_item_values_is_bit_identical(no_profiling):
    def make_args(i):
        g = torch.Generator().manual_seed(10 + i)
        return A(torch.randn(3, 4, generator=g, dtype=torch.float64), 0.3 + i)
    check(arithmetic, make_args, calls=5, expect="graph")


# ------------------------------------------------------------------ errors and steering

class Counter:
    def __init__(self):
        self.seen = 0
        self.ratio = None


counter = Counter()


def ratio_step(x, c):
    c.seen = c.seen + 1
    big = (x > 1.5).sum().item()
    c.ratio = x.sum().item() / big  # ZeroDivisionError when no element is > 1.5
    return torch.nn.functional.dropout(x, 0.5) * 2


def test_a_recipe_that_raises_at_commit_writes_nothing_and_eager_raises(no_profiling):
    def make_args(i):  # call 0 captures (some x > 1.5); call 2 has none: eager raises
        x = torch.full((4,), 0.5) if i == 2 else torch.tensor([2.0, 0.1, -1.0, 3.0 + i])
        return A(x, Counter())
    e = check(ratio_step, make_args, calls=4)
    assert e.stats.graph_hits >= 2, e
    assert [f.kind for f in e.fallbacks] == ["exception_handling"], e
    assert "ZeroDivisionError" in e.fallbacks[0].explanation


def steer(x):
    global running_reward
    running_reward = 0.9 * running_reward + x.sum().item()
    if running_reward > 5:  # steer
        return x * 2
    return x


def test_a_recipe_that_steers_python_is_speculated(no_profiling):
    """The test on the recipe is computed in the graph and checked before the commit (its
    global stays unwritten when it flips: the call runs eagerly)."""
    e = check(steer, lambda: A(T(4)), calls=8, state=carried_globals(__name__, running_reward=1.0))
    assert e.stats.graph_hits >= 1, e
    assert {f.kind for f in e.fallbacks} <= {"assumption_failed", "data_dependent_value"}, e


def returns_type(x):
    v = max(0, x.sum().item())  # int or float: depends on the value
    return isinstance(v, float)  # type


def test_a_value_dependent_type_is_not_guessed(no_profiling):
    check(returns_type, lambda: A(T(4)), expect="fallback", fallback_kind="data_dependent_value",
          fallback_line=marker_line(returns_type, "type"))


# ------------------------------------------------------------------ clocks

def timed(x, w, log):
    t0 = time.perf_counter()
    for _ in range(12):
        x = torch.tanh(x @ w)
    y = x.sum()
    t1 = time.perf_counter()
    log.append(t1 - t0)
    return y, t0, t1


def test_clock_reads_bracket_the_graph(no_profiling):
    opt = specularch.optimize(timed)
    x, w = torch.randn(192, 192), torch.randn(192, 192) / 14
    shares = []
    for _ in range(4):
        log = []
        before = time.perf_counter()
        y, t0, t1 = opt(x, w, log)
        after = time.perf_counter()
        assert before <= t0 <= t1 <= after
        assert log == [t1 - t0]  # the recipe over the same two reads
        assert torch.equal(y, timed(x, w, [])[0])
        shares.append((t1 - t0) / (after - before))
    e = specularch.explain(opt)
    assert not e.fallbacks and e.stats.graph_hits >= 3, e
    # t0 is read before the graph runs and t1 after it: the interval holds the graph's run,
    # most of the call (at least once, on a busy machine)
    assert max(shares[1:]) > 0.5, shares


def clock_in_between(x):
    y = x * 2
    t = time.time()  # between
    return y + 1, t


def test_a_clock_read_between_tensor_ops_falls_back(no_profiling):
    opt = specularch.optimize(clock_in_between)
    for _ in range(3):
        x = torch.randn(3)
        before = time.time()
        y, t = opt(x)
        assert torch.equal(y, x * 2 + 1) and before <= t <= time.time()
    e = specularch.explain(opt)
    assert [f.kind for f in e.fallbacks] == ["unsupported_call"], e
    assert "between tensor operations" in e.fallbacks[0].explanation
    assert e.fallbacks[0].lineno == marker_line(clock_in_between, "between")


# ------------------------------------------------------------------ LBFGS and numpy: cheap fallbacks

def _count_captures(monkeypatch) -> list:
    from specularch.dispatch import misses
    calls = []
    real = misses.capture_with_relaxations

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(misses, "capture_with_relaxations", counting)
    return calls


class LBFGSFit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self._opt = torch.optim.LBFGS(self.lin.parameters(), lr=0.5, max_iter=5)

    def forward(self, x, y):
        def closure():
            self._opt.zero_grad()
            loss = ((self.lin(x) - y) ** 2).mean()
            loss.backward()
            return loss
        return self._opt.step(closure)  # lbfgs


def test_lbfgs_falls_back_once_with_its_reason(no_profiling, monkeypatch):
    captures = _count_captures(monkeypatch)
    e = check_module(LBFGSFit, lambda: A(T(8, 3), T(8, 1)), calls=4, expect="fallback",
                     fallback_kind="unsupported_call",
                     fallback_line=marker_line(LBFGSFit.forward, "lbfgs"))
    assert "LBFGS" in e.fallbacks[0].explanation and "closure" in e.fallbacks[0].explanation
    assert len(captures) == 1, "a remembered fallback must not be captured again"


def to_numpy(x):
    return (x * 2).detach().cpu().numpy()  # numpy


def test_numpy_falls_back_once_with_its_reason(no_profiling, monkeypatch):
    captures = _count_captures(monkeypatch)
    opt = specularch.optimize(to_numpy)
    for _ in range(4):
        x = torch.randn(3)
        assert (opt(x) == to_numpy(x)).all()
    e = specularch.explain(opt)
    assert [f.kind for f in e.fallbacks] == ["data_dependent_value"], e
    assert e.fallbacks[0].lineno == marker_line(to_numpy, "numpy")
    assert "shares the tensor's memory" in e.fallbacks[0].explanation
    assert len(captures) == 1


@pytest.mark.parametrize("fn", [time.time, time.monotonic, time.perf_counter_ns])
def test_every_clock_is_deferred(fn, no_profiling):
    def read(x):
        start = fn()
        return x + 1, fn() - start
    opt = specularch.optimize(read)
    for _ in range(3):
        y, dt = opt(torch.ones(2))
        assert torch.equal(y, torch.full((2,), 2.0)) and dt >= 0 and type(dt) is type(fn())
    assert not specularch.explain(opt).fallbacks
