"""Compare mode (``pytest --specularch=compare``, specularch/validate.py): the eager reference
run is isolated from the real program (helpers' globals, counters, printing), gradients,
module attributes and number globals are compared, a mismatch the test swallows still fails
it, and the summary counts fallback calls."""
import random
import textwrap

import pytest
import torch
from torch import nn

import specularch
from specularch import dispatch, validate

pytest_plugins = ["pytester"]

HELPERS = textwrap.dedent("""
    CALLS = []

    def note(y):
        CALLS.append(tuple(y.shape))
""")

SIDE_EFFECTS = textwrap.dedent("""
    import torch
    from torch import nn
    import helpers

    LOG = []
    COUNT = 0

    def record(value):
        LOG.append(value)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            global COUNT
            COUNT += 1
            y = self.fc(x)
            record(1)
            helpers.note(y)
            print("forward ran")
            return y

    def test_side_effects_happen_once(capsys):
        model = Model()
        for _ in range(6):
            model(torch.randn(4, 3))
        assert LOG == [1] * 6 and COUNT == 6 and len(helpers.CALLS) == 6
        assert capsys.readouterr().out.count("forward ran") == 6

    def train_step(model, x):
        global COUNT
        COUNT += 1
        loss = model(x).sum()
        loss.backward()
        return loss

    def test_training_step_graph():
        model = nn.Linear(3, 2)
        for _ in range(6):
            train_step(model, torch.randn(4, 3))
""")


def test_reference_run_does_not_repeat_side_effects(pytester, monkeypatch):
    pytester.makepyfile(helpers=HELPERS, test_suite=SIDE_EFFECTS)
    monkeypatch.setenv("SPECULARCH_PROFILE_CALLS", "1")
    result = pytester.runpytest_subprocess("--specularch=compare", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*mismatches: 0*"])
    assert "graph hits: 0," not in result.stdout.str()  # something did run as a graph


# Differs from eager only in gradients: every gradient a captured backward computes is
# scaled by 1.001 (the graph's values are untouched).
GRAD_BROKEN_BACKEND = textwrap.dedent("""
    import operator
    import torch
    import specularch

    def grad_broken(gm, example_inputs):
        graph = gm.graph
        for node in list(graph.nodes):
            if node.target is torch.autograd.grad:
                for user in list(node.users):
                    with graph.inserting_after(user):
                        scaled = graph.call_function(operator.mul, (user, 1.001))
                    user.replace_all_uses_with(scaled, delete_user_cb=lambda n: n is not scaled)
        gm.recompile()
        return gm.forward

    specularch.register_backend("grad_broken", grad_broken, replace=True,
                                help="scales gradients by 1.001 (test only)")
""")

GRAD_SUITE = textwrap.dedent("""
    import torch
    from torch import nn

    def train_step(model, x):
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss.detach()

    def test_gradients():
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        for _ in range(4):
            model.zero_grad()
            train_step(model, torch.randn(4, 3))
""")


def test_compare_mode_catches_a_backend_that_perturbs_only_gradients(pytester, monkeypatch):
    pytester.makepyfile(test_suite=GRAD_SUITE)
    pytester.makeconftest(GRAD_BROKEN_BACKEND)
    monkeypatch.setenv("SPECULARCH_BACKEND", "grad_broken")
    result = pytester.runpytest_subprocess("--specularch=compare", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*SpecularchMismatch*train_step differs from eager: "
                                 "arguments after the call[[]0[]][[]'weight'[]].grad*",
                                 "*mismatches: 1*"])


SWALLOWING_SUITE = textwrap.dedent("""
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x) * 2

    def test_swallows_errors():
        model = Model()
        for _ in range(5):
            try:
                model(torch.randn(4, 3))
            except Exception:
                pass
""")

OUTPUT_BROKEN_BACKEND = textwrap.dedent("""
    import specularch

    def broken(gm, example_inputs):
        def run(*args):
            return tuple(o + 1e-3 if o.is_floating_point() else o for o in gm.forward(*args))
        return run

    specularch.register_backend("broken", broken, help="adds 1e-3 to every output (test only)",
                                replace=True)
""")


def test_a_mismatch_the_test_catches_still_fails_it(pytester, monkeypatch):
    pytester.makepyfile(test_suite=SWALLOWING_SUITE)
    pytester.makeconftest(OUTPUT_BROKEN_BACKEND)
    monkeypatch.setenv("SPECULARCH_BACKEND", "broken")
    result = pytester.runpytest_subprocess("--specularch=compare", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*caught by the test, but a specularch mismatch was raised*",
                                 "*Model.forward differs from eager*"])


# A step every call of which falls back (unsupported_call), for the summary tests.
FALLING_BACK_STEP = textwrap.dedent("""
        import torch

        def train_step(x):
            id(x)  # not captured: every call falls back (unsupported_call)
            return x + 1
""")


def test_summary_counts_fallback_calls_not_records(pytester, monkeypatch):
    pytester.makepyfile(test_suite=FALLING_BACK_STEP + textwrap.dedent("""
        def test_prints():
            for _ in range(4):
                train_step(torch.ones(2))
    """))
    monkeypatch.setenv("SPECULARCH_PROFILE_CALLS", "0")
    result = pytester.runpytest_subprocess("--specularch=on", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*fell back to eager: 4)*",
                                 "fallback calls by kind: unsupported_call=4 (1 site)"])


def test_summary_counts_calls_of_tests_whose_fixtures_reset_specularch(pytester, monkeypatch):
    # Like this repository's own conftest: every test ends with specularch.reset(), which
    # empties the statistics; the summary still counts what each test ran.
    pytester.makeconftest(textwrap.dedent("""
        import pytest
        import specularch

        @pytest.fixture(autouse=True)
        def fresh():
            yield
            specularch.reset()
    """))
    pytester.makepyfile(test_suite=FALLING_BACK_STEP + textwrap.dedent("""
        def test_one():
            for _ in range(3):
                train_step(torch.ones(2))

        def test_two():
            for _ in range(2):
                train_step(torch.ones(2))
    """))
    monkeypatch.setenv("SPECULARCH_PROFILE_CALLS", "0")
    result = pytester.runpytest_subprocess("--specularch=on", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["optimized code objects: 1, graphs: 0, calls: 5 (*fell back to eager: 5)*",
                                 "fallback calls by kind: unsupported_call=5 (1 site)"])


def test_bad_variable_is_a_usage_error(pytester, monkeypatch):
    pytester.makepyfile(test_suite="def test_nothing():\n    pass\n")
    monkeypatch.setenv("SPECULARCH_STRICT", "sure")
    result = pytester.runpytest_subprocess("--specularch=on", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*SPECULARCH_STRICT='sure' is not valid*"])


# --- the validator itself, in this process -------------------------------------------------

COUNT = 0
LOG = []


def bump(x):
    global COUNT
    COUNT += 1
    LOG.append(COUNT)
    print("bumped", COUNT)
    return x + 1


def _validate(fn, args, run=None):
    state = specularch.optimize(fn).__specularch_state__
    with specularch.config.patch(profile_calls=0):
        return validate.validator(state, args, None, run or dispatch.run_unwrapped)


@pytest.fixture(autouse=True)
def _fresh():
    global COUNT
    COUNT, mismatches = 0, len(validate.MISMATCHES)
    LOG.clear()
    yield
    del validate.MISMATCHES[mismatches:]


def test_validator_runs_side_effects_once(capsys):
    out = _validate(bump, (torch.ones(2),))
    assert torch.equal(out, torch.full((2,), 2.0))
    assert COUNT == 1 and LOG == [1]
    assert capsys.readouterr().out == "bumped 1\n"


def test_validator_compares_number_globals():
    def run_counting_twice(state, slots, cells):
        global COUNT
        out = bump(*slots)
        COUNT += 1
        return out

    with pytest.raises(validate.SpecularchMismatch, match=r"global .*\.COUNT after the call: "
                                                          r"eager 1 vs optimized 2"):
        _validate(bump, (torch.ones(2),), run_counting_twice)


def test_validator_compares_printed_text(capsys):
    def run_quietly(state, slots, cells):
        global COUNT
        COUNT += 1
        LOG.append(COUNT)
        return slots[0] + 1

    with pytest.raises(validate.SpecularchMismatch, match="printed stdout: eager 'bumped 1\\\\n' "
                                                          "vs optimized ''"):
        _validate(bump, (torch.ones(2),), run_quietly)


def draws_once(x):
    return x * random.random()


def test_validator_compares_python_s_random_state():
    """Compare mode puts Python's generator back for the optimized run and compares where
    each run leaves it (here a run that draws once more than eager)."""
    random.seed(0)
    got, state = _validate(draws_once, (torch.ones(2),)), random.getstate()
    random.seed(0)
    assert torch.equal(got, draws_once(torch.ones(2))) and random.getstate() == state

    def run_drawing_twice(state, slots, cells):
        out = dispatch.run_unwrapped(state, slots, cells)
        random.random()
        return out

    with pytest.raises(validate.SpecularchMismatch, match="Python's random module is left in "
                                                          "another state than eager leaves it"):
        _validate(draws_once, (torch.ones(2),), run_drawing_twice)


def forward_step(model, x):
    model.train()
    return model(x).sum()


def test_validator_compares_module_attributes():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0))
    model.eval()

    def run_forgetting_train(state, slots, cells):
        return slots[0](slots[1]).sum()  # leaves the model in eval mode

    with pytest.raises(validate.SpecularchMismatch, match=r"arguments after the call\[0\]"
                                                          r"\['training'\]: eager True vs "
                                                          r"optimized False"):
        _validate(forward_step, (model, torch.ones(1, 2)), run_forgetting_train)


def test_validator_compares_gradients():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    a.grad, b.grad = torch.ones(2), torch.full((2,), 1.001)
    assert validate._first_difference(a, b, "x").startswith("x.grad[0]: eager 1.0 vs")
    assert validate._first_difference(a, a.detach().clone().requires_grad_(), "x") == \
        "x.grad: Tensor vs NoneType"


def test_reached_globals_follow_helpers_into_other_modules(tmp_path, monkeypatch):
    (tmp_path / "reach_helpers.py").write_text(textwrap.dedent("""
        import torch
        STORE = []
        SCALE = 2.0

        def deeper(y):
            STORE.append(y)

        def helper(y):
            deeper(y)
            return y * SCALE
    """))
    (tmp_path / "reach_main.py").write_text(textwrap.dedent("""
        import torch
        import reach_helpers
        from reach_helpers import helper
        TOTAL = 0

        def step(x):
            global TOTAL, CREATED
            TOTAL += 1
            CREATED = True
            return helper(x) + torch.zeros(1)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import reach_main
    state = specularch.optimize(reach_main.step).__specularch_state__
    found = {(ns["__name__"], name) for ns, name in
             validate._reached_bindings(state.target, (torch.ones(1),), None)}
    assert {("reach_main", "TOTAL"), ("reach_main", "CREATED"), ("reach_helpers", "STORE"),
            ("reach_helpers", "SCALE")} <= found
    assert not any(module.startswith("torch") for module, _ in found)
