"""Draws from Python's ``random`` module inside an optimized call (guards/draws.py,
symbolic/library/python_random.py): ``random.random()`` is the call's next draw, guarded where
a branch reads it (one graph per outcome) and a number input where the graph computes with it.
Every check is differential (``differential.check``): eager and optimized run from the same
seed, results, the heap, and Python's generator state after the call must be equal."""
import random

import pytest
import torch
from torch import nn

import specularch
from specularch import tiering
from specularch.guards import draws

from differential import A, T, check, check_module, expect_fallback, marker_line

torch.manual_seed(0)
LIN = nn.Linear(4, 4)
CALLS = 24  # seeds 0..23 give both outcomes of every draw below


def teacher_forcing(x, ratio):
    if random.random() < ratio:  # draw
        return LIN(x) * 2
    return LIN(x) - 1


def test_a_branch_on_a_draw_is_one_graph_per_outcome_with_eager_s_numbers():
    report = check(teacher_forcing, lambda: A(T(3, 4), 0.5), calls=CALLS, expect="graph")
    assert len(report.graphs) == 2 and report.stats.graph_hits >= CALLS - 3 - 2
    (recompile,) = report.recompiles
    assert "(random.random()#1 < 0.5) expected" in str(recompile)
    assert f"test_python_random.py:{marker_line(teacher_forcing, 'draw')}" in str(recompile)


def scaled(x):
    return x * random.random() + random.uniform(-1, 1) + random.uniform(a=2, b=3)


def test_a_draw_computed_with_is_a_number_input_and_uniform_is_eager_s_arithmetic():
    report = check(scaled, lambda: A(T(3)), calls=8, expect="graph")
    assert len(report.graphs) == 1
    graph = specularch.explain(scaled_opt := specularch.optimize(scaled), verbose=True)
    for _ in range(5):
        scaled_opt(T(3))
    graph = specularch.explain(scaled_opt).graphs[0]
    assert graph.code.count("random_draw_") >= 3  # three number inputs


def discarded(x):
    random.random()
    return x + 1


def draws_then_branches_on_a_size(x):
    first = random.random()
    if x.shape[0] == 3:  # a size guard: checked after the draw guards, by one C++ call
        if random.random() < 0.5:
            return x * first
        return x - first
    return x + first


def test_a_path_makes_its_draws_whatever_its_guards_read():
    """An unread draw still advances the generator; a call whose other entries' guards read
    further than its own path draws is put back to its own number of draws."""
    check(discarded, lambda: A(T(2)), calls=6, expect="graph")
    report = check(draws_then_branches_on_a_size, lambda i: A(T(3 if i % 3 else 4)),
                   calls=CALLS, expect="graph")
    assert len(report.graphs) == 3


def loop_of_draws(x):
    for _ in range(3):
        if random.random() < 0.5:
            x = LIN(x)
    return x


def draws_n_times(x, n):
    for _ in range(n):
        x = x * random.random()
    return x


def test_loops_that_draw_are_unrolled_and_every_path_is_eager_s():
    report = check(loop_of_draws, lambda: A(T(2, 4)), calls=40, expect="graph")
    assert len(report.graphs) == 8  # 2 ** 3 outcomes
    report = check(draws_n_times, lambda i: A(T(3), i % 3 + 1), calls=12, expect="graph")
    assert any("draws from Python's random module" in loop.why  # not rolled: one body per draw
               for g in report.graphs for loop in g.loops if not loop.rolled)


def raises_below(x):
    if random.random() < 0.3:
        raise ValueError("drew low")
    return x * 2


def reads_data_after_a_draw(x):
    r = random.random()
    y = x * 2
    if r < 0.5:
        return y, len(y.tolist())  # not captured: the call runs eagerly
    return y, 0


def test_eager_runs_after_a_draw_make_the_same_draws():
    """A path that raises, or one capture refuses, runs the original: the generator is put
    back first, so the original draws what the guards read."""
    check(raises_below, lambda: A(T(2)), calls=CALLS)
    report = check(reads_data_after_a_draw, lambda: A(T(3)), calls=CALLS, expect="fallback",
                   fallback_kind="data_dependent_value")
    assert report.graphs and report.stats.graph_hits > 0


inner = specularch.optimize(lambda x: x * random.random())


def calls_an_optimized_function(x):
    return inner(x) + random.random()


def test_an_inlined_optimized_function_s_draws_are_the_caller_s():
    check(calls_an_optimized_function, lambda: A(T(3)), calls=8, expect="graph")


def draws_under_a_tensor_branch(x):
    if x.sum() > 0:  # branch
        return x * random.random()
    return x - random.random()


def test_a_draw_on_a_side_of_a_merged_tensor_branch_is_refused():
    report = check(draws_under_a_tensor_branch, lambda: A(T(3)), calls=12)
    merged = [f for f in report.fallbacks if f.kind == "data_dependent_branch"]
    assert merged and "a draw from Python's random module on one side of a branch on a " \
                      "tensor value" in merged[0].explanation


class Sampler(nn.Module):
    """An epsilon-greedy action choice in forward."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 3)
        self.explored = 0

    def forward(self, obs, eps: float = 0.25):
        values = self.q(obs)
        if random.random() < eps:
            self.explored += 1
            return torch.randint(0, 3, ()), values
        return values.argmax(), values


def test_epsilon_greedy_module_matches_eager_and_counts_like_eager():
    report = check_module(Sampler, lambda: A(T(4)), calls=CALLS, expect="graph")
    assert len(report.graphs) == 2


def own_generator(x, rng):
    if rng.random() < 0.5:  # mark
        return x * 2
    return x - 1


def randint_draw(x, rng=None):
    return x * random.randint(1, 5)  # randint


def test_other_generators_and_functions_run_eagerly_and_say_what_is_captured():
    for fn, marker in ((own_generator, "mark"), (randint_draw, "randint")):
        opt = specularch.optimize(fn)
        for seed in range(6):
            results, states = [], []
            for f in (fn, opt):
                random.seed(seed)
                results.append(f(torch.ones(2), random.Random(seed)))
                states.append(random.getstate())
            assert torch.equal(*results) and states[0] == states[1]
        (record,) = expect_fallback(specularch.explain(opt), "unsupported_call",
                                    lineno=marker_line(fn, marker))
        assert "only random.random() and random.uniform()" in record.explanation
        assert "random.random() < p" in record.hint


def _same_draws(fn, opt, args, seed):
    random.seed(seed)
    expected, state = fn(*args), random.getstate()
    random.seed(seed)
    got = opt(*args)
    assert random.getstate() == state, f"seed {seed}: other draws than eager's"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_exact_mode_draws_eager_s_numbers_bit_for_bit():
    opt = specularch.optimize(teacher_forcing, exact=True)
    for seed in range(16):
        random.seed(seed)
        expected = teacher_forcing(torch.ones(3, 4), 0.5)
        random.seed(seed)
        assert torch.equal(opt(torch.ones(3, 4), 0.5), expected)
    assert specularch.explain(opt).stats.graph_hits == 16 - 3 - 2


@pytest.mark.parametrize("fn, args", [(teacher_forcing, (torch.ones(3, 4), 0.5)),
                                      (scaled, (torch.ones(3),))], ids=["branch", "number input"])
def test_a_kept_compiled_candidate_draws_eager_s_numbers(promoted, fn, args):
    """TorchScript's candidate, always kept: a draw the graph computes with is its number
    input; the guards' draws are unchanged by the tier."""
    opt = specularch.optimize(fn)
    entries = opt.__specularch_state__.entries
    graphs = 2 if fn is teacher_forcing else 1
    for seed in range(400):
        _same_draws(fn, opt, args, seed)
        assert tiering.wait(timeout=120)
        if len(entries) == graphs and all(e.tier.settled for e in entries):
            break
    for seed in range(8):
        _same_draws(fn, opt, args, 1000 + seed)
    assert all(e.backend == "torchscript" for e in entries), [e.tier.lines() for e in entries]


def test_a_draw_outside_a_dispatched_call_is_refused():
    """Nothing saved the generator's state: a guard or capture reading a draw there fails."""
    with pytest.raises(LookupError):
        draws.draw(0)
    with draws.call() as call:
        first = draws.draw(0)
        assert draws.draw(0) == first and call.start is not None
    with pytest.raises(LookupError):
        draws.draw(0)
