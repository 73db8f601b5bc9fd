"""Configuration values checked when set (from Python and from ``SPECULARCH_*`` variables, by
the same kinds), one clear error for a bad variable at specularch's first use, a clear
``TypeError`` for objects torch.jit / torch.compile made, and process state (grad mode,
inference mode, default dtype, the frame hook) put back when a call is interrupted by a
``KeyboardInterrupt`` anywhere."""
import contextlib
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx

import specularch
from specularch import ConfigError, config, frames
from specularch.config import OPTIONS, check_environment

config_module = importlib.import_module("specularch.config")


@pytest.fixture
def saved_config():
    """Values assigned with ``config.X = v`` are process-wide: put them back after the test."""
    before = dict(config_module._BASE_VALUES)
    yield
    config_module._BASE_VALUES.clear()
    config_module._BASE_VALUES.update(before)


# --- values set from Python -----------------------------------------------------------------
# Generated from each option's default, so an option added to OPTIONS is covered at once.

def _good_values(option):
    d = option.default
    if isinstance(d, bool):
        return [d, not d]
    if isinstance(d, int):
        return [d, d + 1]
    if isinstance(d, float):
        return [d, 2, 0.5]
    if isinstance(d, frozenset):
        return [d, set(d), sorted(d)]
    if isinstance(d, str):
        return [d, *specularch.list_backends()] if option.name == "backend" else [d]
    raise AssertionError(f"no good values for {option.name}: teach this test its kind")


def _bad_values(option):
    d = option.default
    common = [None, object()]
    if isinstance(d, bool):
        return common + ["yes", 1, "1"]
    if isinstance(d, int):
        return common + [str(d), -1, True, 2.5]
    if isinstance(d, float):
        return common + [str(d), -1.0, 0, float("inf"), float("nan"), True]
    if isinstance(d, frozenset):
        return common + [",".join(sorted(d)) or "x", {1}, ["", "a"]]
    if isinstance(d, str):
        return common + ["", 3, "no-such-" + d]
    raise AssertionError(f"no bad values for {option.name}: teach this test its kind")


GOOD = [(name, v) for name, o in OPTIONS.items() for v in _good_values(o)]
BAD = [(name, v) for name, o in OPTIONS.items() for v in _bad_values(o)]


def _id(name, value) -> str:
    """A test id that is the same in every process (pytest-xdist's workers compare their
    collections): sets in sorted order, an ``object()`` by its type."""
    if isinstance(value, (set, frozenset)):
        shown = f"{type(value).__name__}({sorted(value, key=repr)!r})"
    elif type(value) is object:
        shown = "object()"
    else:
        shown = repr(value)
    return f"{name}={shown}"


def _stored(value):
    return frozenset(value) if isinstance(value, (set, list)) else value


@pytest.mark.parametrize("name,value", GOOD, ids=[_id(n, v) for n, v in GOOD])
def test_every_option_takes_a_value_of_its_kind(name, value, saved_config):
    with config.patch(**{name: value}):
        assert getattr(config, name) == _stored(value)
    setattr(config, name, value)
    assert getattr(config, name) == _stored(value)


@pytest.mark.parametrize("name,value", BAD, ids=[_id(n, v) for n, v in BAD])
def test_every_option_refuses_a_value_of_another_kind(name, value, saved_config):
    before = getattr(config, name)
    for set_it in (lambda: setattr(config, name, value),
                   lambda: config.patch(**{name: value}).__enter__()):
        with pytest.raises(ConfigError) as error:
            set_it()
        message = str(error.value)
        assert f"specularch.config.{name}=" in message and "is not valid: expected" in message
        assert getattr(config, name) == before  # nothing was stored
    assert config_module._Config().__dict__["_overrides"] == []


def test_defaults_and_variables_go_through_the_same_kind():
    """Each default is a value its kind accepts, and the variable spelling the default parses
    to the default (the variable and Python are checked by one kind)."""
    for option in OPTIONS.values():
        assert option.kind.check(option.default) == option.default, option.name
        d = option.default
        text = (("1" if d else "0") if isinstance(d, bool) else
                ",".join(sorted(d)) if isinstance(d, frozenset) else str(d))
        assert option.parse(text) == d, option.name


def test_unknown_option_names_raise_with_a_suggestion(saved_config):
    with pytest.raises(ConfigError, match="did you mean 'cache_limit'"):
        config.cach_limit = 3
    with pytest.raises(ConfigError, match="no option 'cach_limit'"):
        with config.patch(cach_limit=3):
            pass
    with pytest.raises(AttributeError):
        config.cach_limit
    assert getattr(config, "cach_limit", "default") == "default"


def test_a_refused_value_leaves_optimized_calls_as_eager(saved_config):
    """The reported bug: ``config.profile_calls = "3"`` made every later call raise."""
    def f(x, n):
        return x * n + 1

    with pytest.raises(ConfigError, match="profile_calls='3' .*non-negative int"):
        config.profile_calls = "3"
    g = specularch.optimize(f)
    for i in range(5):
        x = torch.randn(3)
        torch.testing.assert_close(g(x, i), f(x, i))
    assert specularch.explain(g).stats.calls == 5


def test_python_values_are_stored_as_the_variable_would_give_them(saved_config):
    config.log = ["all"]
    assert config.log == frozenset(config_module.LOG_TOPICS)
    config.log = frozenset({"graphs"})
    assert config.log == frozenset({"graphs"})
    config.backend = "torchscript"
    assert config.backend == "torchscript"
    config.distributed_bucket_mb = 4
    assert type(config.distributed_bucket_mb) is float


def test_a_backend_name_is_checked_against_the_registry(saved_config):
    with pytest.raises(ConfigError, match="'nope' is not valid: expected one of .*fx"):
        config.backend = "nope"
    specularch.register_backend("test_config_backend", lambda gm, ex: gm.forward, help="test",
                                replace=True)
    config.backend = "test_config_backend"
    assert config.backend == "test_config_backend"


# --- bad variables without the switch: one ConfigError at the first use ----------------------

def _bad_text(option):
    """A text the option's variable does not accept (None when every text is accepted)."""
    backends = specularch.list_backends()
    for text in ("not-valid-@", "-1", "0", ""):
        if check_environment({option.env: text}, backends)[0]:
            return text
    return None


VARIABLES = [(o.env, _bad_text(o)) for o in OPTIONS.values()
             if o.env and o.env != "SPECULARCH" and _bad_text(o) is not None]


@pytest.fixture
def fresh_environment(monkeypatch, saved_config):
    """No SPECULARCH* variable, and the configuration not read from the environment yet."""
    for name in list(os.environ):
        if name.startswith("SPECULARCH"):
            monkeypatch.delenv(name)
    config_module._BASE_VALUES.clear()


@pytest.mark.parametrize("variable,text", VARIABLES, ids=[v for v, _ in VARIABLES])
def test_a_bad_variable_is_one_config_error_at_the_first_use(variable, text, monkeypatch,
                                                            fresh_environment):
    """Every variable the same way: optimize() raises the one-line message the switch prints,
    and so does any read of the configuration (not a fallback per code object)."""
    monkeypatch.setenv(variable, text)
    expected = check_environment(backends=specularch.list_backends())[0][0]

    def f(x):
        return x + 1

    for _ in range(2):  # the first use and the next: the same error
        with pytest.raises(ConfigError) as error:
            specularch.optimize(f)
        assert str(error.value) == expected
        assert str(error.value).startswith(f"{variable}={text!r} is not valid: expected ")
        assert "\n" not in str(error.value)
    if variable != "SPECULARCH_BACKEND":  # (its name is checked against the registry later)
        with pytest.raises(ConfigError, match=f"^{variable}="):
            config.strict


def _env(extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULARCH")}
    env.update(extra)
    return env


LIBRARY_SCRIPT = textwrap.dedent("""
    import torch, specularch
    print("imported")
    def f(x):
        return x * 2 + 1
    g = specularch.optimize(f)
    for _ in range(5):
        g(torch.ones(2))
    print("ran")
""")

# One variable for each way a bad value used to behave: a traceback at the first call
# (PROFILE_CALLS), an internal_error fallback (MAX_INSTRUCTIONS), a backend_error warning per
# code object (BACKEND), silence (STRICT).
REPRESENTATIVE = [("SPECULARCH_PROFILE_CALLS", "three"), ("SPECULARCH_MAX_INSTRUCTIONS", "many"),
                  ("SPECULARCH_BACKEND", "nope"), ("SPECULARCH_STRICT", "maybe")]


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("variable,text", REPRESENTATIVE, ids=[v for v, _ in REPRESENTATIVE])
def test_a_bad_variable_in_a_fresh_process_stops_it_at_optimize(variable, text, tmp_path):
    script = tmp_path / "lib.py"
    script.write_text(LIBRARY_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], env=_env({variable: text}),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stdout == "imported\n", (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    expected = (f"specularch.config.ConfigError: {variable}={text!r} is not valid: expected")
    assert lines[-1].startswith(expected), out.stderr
    assert lines[0] == "Traceback (most recent call last):" and len(lines) <= 8, out.stderr
    assert "fallback" not in out.stderr and "Warning" not in out.stderr
    if variable != REPRESENTATIVE[0][0]:
        return  # (the CLI prints what check_environment() says: see the test above)
    cli = subprocess.run([sys.executable, "-m", "specularch", "explain", str(script)],
                         env=_env({variable: text}), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and cli.stdout == ""
    assert cli.stderr.strip() == "specularch: " + lines[-1].split(": ", 1)[1]


def test_an_unknown_variable_is_warned_about_once(monkeypatch, fresh_environment):
    monkeypatch.setenv("SPECULARCH_CACHE_LIMT", "2")
    with pytest.warns(UserWarning, match="unknown variable SPECULARCH_CACHE_LIMT "
                                         r"\(did you mean SPECULARCH_CACHE_LIMIT\?\)"):
        specularch.optimize(lambda x: x)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specularch.optimize(lambda x: x)
        assert config.cache_limit == OPTIONS["cache_limit"].default


# --- objects torch.jit / torch.compile made ---------------------------------------------------

def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _plus_one(x):
    return x + 1


MADE_BY_TORCH = {
    "jit.script(module)": (lambda: torch.jit.script(_linear()), "torch.jit.script(model)"),
    "jit.trace(module)": (lambda: torch.jit.trace(_linear(), torch.ones(1, 3)),
                          "torch.jit.trace(model)"),
    "jit.script(fn)": (lambda: torch.jit.script(_plus_one), "torch.jit.script(fn)"),
    "jit.trace(fn)": (lambda: torch.jit.trace(_plus_one, torch.ones(3)), "torch.jit.script(fn)"),
    "compile(module)": (lambda: torch.compile(_linear()), "torch.compile(model)"),
    "compile(fn)": (lambda: torch.compile(_plus_one), "torch.compile(fn)"),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit's own
@pytest.mark.parametrize("made", [pytest.param(m, marks=[pytest.mark.slow] * m.startswith("compile"))
                                  for m in MADE_BY_TORCH])  # (torch.compile imports torch._dynamo)
def test_objects_made_by_torch_jit_or_compile_get_a_clear_type_error(made):
    make, call = MADE_BY_TORCH[made]
    obj = make()
    forward = getattr(obj, "forward", None)
    with pytest.raises(TypeError) as error:
        specularch.optimize(obj)
    message = str(error.value)
    assert message.startswith("specularch.optimize cannot optimize a ")
    assert f"Pass the original {'nn.Module' if 'module' in made else 'Python function'} " \
        "instead" in message
    assert f"not specularch.optimize({call})" in message, message
    assert getattr(obj, "forward", None) == forward  # left as it was


def test_the_originals_of_those_objects_optimize_and_match_eager():
    model, x = _linear(), torch.randn(4, 3)
    expected = model(x)
    optimized = specularch.optimize(model)
    torch.testing.assert_close(optimized(x), expected)
    torch.testing.assert_close(specularch.optimize(_plus_one)(x), _plus_one(x))


# --- KeyboardInterrupt anywhere in a call puts the process state back ------------------------

def _state():
    return {"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "dtype": torch.get_default_dtype(), "autocast": torch.is_autocast_enabled("cpu"),
            "hook": frames.is_active(), "profile_calls": config.profile_calls}


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


OUTER = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad,
         "inference_mode": torch.inference_mode, "float64": lambda: _default_dtype(torch.float64),
         "hook_active": frames.hook_active}


class _InterruptAfterNoGrad(torch.fx.Interpreter):
    """Runs a graph and stops, as Ctrl-C would, right after it switched grad mode off."""

    def run_node(self, n):
        out = super().run_node(n)
        if n.target is torch.set_grad_enabled and n.args == (False,) and IN_BACKEND[0]:
            raise KeyboardInterrupt("in the graph")
        return out


def _interrupting_backend(gm, example_inputs):
    return lambda *args: _InterruptAfterNoGrad(gm).run(*args)


def _backend_interrupted_at_compile(gm, example_inputs):
    if IN_BACKEND[0]:
        raise KeyboardInterrupt("while compiling")
    return gm.forward


ARMED = [False]       # read by the optimized code (so guarded): arming it recaptures
IN_BACKEND = [False]  # read only by the test backends: a graph that was run before runs again


def _helper(y):
    if ARMED[0]:
        raise KeyboardInterrupt("in a user function")
    return y * 3


def _step(x):
    with torch.no_grad():
        y = _helper(x * 2)
    return x * y + 1


class _Key(str):
    def __eq__(self, other):
        if ARMED[0]:
            raise KeyboardInterrupt("in __eq__")
        return str.__eq__(self, other)

    __hash__ = str.__hash__


_TABLE = {_Key("scale"): 2.0}


def _step_reading_table(x):
    with torch.no_grad():
        y = x * _TABLE["scale"]
    return x * y


# point -> (function, backend, profile_calls, calls before arming, flag armed)
POINTS = {
    "graph run by a backend": (_step, "test_interrupt_graph", 0, 1, IN_BACKEND),
    "backend compiling": (_step, "test_interrupt_compile", 0, 0, IN_BACKEND),
    "user function, profiled call": (_step, "fx", 1, 0, ARMED),
    "user function, capture and fallback": (_step, "fx", 0, 0, ARMED),
    "user function, after a graph": (_step, "fx", 0, 2, ARMED),
    "user __eq__ at guard time": (_step_reading_table, "fx", 0, 2, ARMED),
}


@pytest.fixture
def interrupt_backends():
    specularch.register_backend("test_interrupt_graph", _interrupting_backend,
                                help="test: KeyboardInterrupt inside the graph", replace=True)
    specularch.register_backend("test_interrupt_compile", _backend_interrupted_at_compile,
                                help="test: KeyboardInterrupt while compiling", replace=True)
    grad = torch.is_grad_enabled()
    yield
    ARMED[0] = IN_BACKEND[0] = False
    torch.set_grad_enabled(grad)  # a failing test must not fail the ones after it


@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("point", list(POINTS))
def test_keyboard_interrupt_puts_the_process_state_back(point, outer, interrupt_backends):
    fn, backend, profile_calls, warm_calls, armed = POINTS[point]
    optimized = specularch.optimize(fn, backend=backend)
    x = torch.randn(3, requires_grad=True)
    with config.patch(profile_calls=profile_calls, warn_fallbacks=False), OUTER[outer]():
        for _ in range(warm_calls):
            optimized(x)
        before = _state()
        armed[0] = True
        with pytest.raises(KeyboardInterrupt):
            optimized(x)
        armed[0] = False
        assert _state() == before
        torch.testing.assert_close(optimized(x), fn(x))  # and the cache still works
        assert _state() == before


def test_ctrl_c_during_the_hook_self_test_propagates(monkeypatch):
    """It would otherwise be swallowed and turn the hook off for the whole process."""
    selftest = importlib.import_module("specularch.frames.selftest")

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(selftest, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        selftest.run()
