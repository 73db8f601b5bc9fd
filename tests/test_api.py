"""API-level behaviour of ``specularch.optimize`` / ``explain`` / ``reset`` / ``config``.

What a user relies on without reading the internals: a cache hit runs no original bytecode,
the list of unhandled opcodes is honest, nested optimized calls compose, several threads can
share one cache, ``torch.compile`` keeps working in the same process, ``explain()`` says what
happened, bad input gives clear errors, strict mode raises, parameters are read on every call,
and gradients flow through the graphs. Every test is fast and deterministic.
"""
import concurrent.futures
import dis
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import specularch
import specularch.dispatch.misses
import specularch.frames
from differential import (A, T, assert_uses_opcode, check_module, expect_fallback, expect_graph,
                          marker_line)

pytestmark = pytest.mark.usefixtures("no_profiling")


@pytest.fixture(autouse=True)
def _not_strict():
    """These tests are about silent fallbacks and recompiles (strict mode is tested on its own),
    so they do not change under SPECULARCH_STRICT=1."""
    with specularch.config.patch(strict=False):
        yield


# --------------------------------------------------------------------------- helpers

def affine(x, w):
    return torch.tanh(x @ w) + 1


def _raises_if_run(x, w):  # same argument layout as ``affine``
    raise AssertionError("original bytecode ran")


def make_scaled(k):
    def scaled(x, w):  # a closure: the original runs with the caller's cells
        return torch.tanh(x @ w) * k
    return scaled


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=16, d_out=4):
        super().__init__()
        self.fc = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc(x)))


class _Spies:
    """Counts calls of ``Target.call_original`` (the original bytecode of this file's targets;
    the frame hook's one-time self-test uses it too) and of the dispatcher's ``capture``, while
    still running them."""

    def __init__(self, monkeypatch):
        self.original_runs = 0
        self.captures = 0
        call_original = specularch.frames.Target.call_original
        capture = specularch.dispatch.misses.capture

        def spy_call_original(target, *args, **kwargs):
            self.original_runs += target.filename == __file__
            return call_original(target, *args, **kwargs)

        def spy_capture(*args, **kwargs):
            self.captures += 1
            return capture(*args, **kwargs)

        monkeypatch.setattr(specularch.frames.Target, "call_original", spy_call_original)
        monkeypatch.setattr(specularch.dispatch.misses, "capture", spy_capture)


# --------------------------------------------------------------------------- 1. cache hits

@pytest.mark.parametrize("kind", ["function", "module"])
def test_cache_hit_runs_neither_capture_nor_the_original(monkeypatch, kind):
    spies = _Spies(monkeypatch)
    if kind == "function":
        opt, eager, args = specularch.optimize(affine), affine, (torch.randn(3, 4), torch.randn(4, 2))
    else:
        opt = specularch.optimize(MLP())
        eager, args = (lambda x: MLP.forward(opt, x)), (torch.randn(5, 8),)
    expected = eager(*args)
    assert spies.original_runs == 0 and spies.captures == 0
    assert torch.equal(opt(*args), expected)  # first call: capture, run the fresh graph
    assert spies.captures == 1, "the first call should capture exactly once"
    assert spies.original_runs == 0, "with profile_calls=0 the first call runs the graph"
    hits = specularch.explain(opt).stats.graph_hits
    for i in range(1, 6):
        assert torch.equal(opt(*args), expected)
        assert specularch.explain(opt).stats.graph_hits == hits + i
    assert (spies.captures, spies.original_runs) == (1, 0), "a cache hit captured or ran the original"
    e = specularch.explain(opt)
    # (a graph's own ``hits`` also counts the run right after its capture)
    assert e.stats.calls == 6 and e.stats.fallback_calls == 0 and e.graphs[0].hits == 6

    # The spy does see the original when it runs: a call that has to fall back.
    def falls_back(x):
        return x * int(x.sum())

    fb = specularch.optimize(falls_back)
    assert torch.equal(fb(torch.ones(2)), torch.ones(2) * 2)
    assert spies.original_runs == 1


@pytest.mark.parametrize("make", [lambda: affine, lambda: make_scaled(3.0)],
                         ids=["function", "closure"])
def test_poisoned_original_is_not_run_on_a_cache_hit(make):
    fn = make()
    opt = specularch.optimize(fn)
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    expected = fn(x, w)
    assert torch.equal(opt(x, w), expected)
    assert specularch.explain(opt).graphs
    target = opt.__specularch_target__
    shadow, shadow_fn = target.shadow_code, target._shadow_fn
    poison = _raises_if_run.__code__.replace(co_freevars=target.shadow_code.co_freevars) \
        if target.shadow_code.co_freevars else _raises_if_run.__code__
    target.shadow_code = poison
    target._shadow_fn = None if poison.co_freevars else target._shadow_function(None)
    try:
        # The poison works: running "the original" now raises.
        with pytest.raises(AssertionError, match="original bytecode ran"):
            target.call_original((x, w), fn.__closure__)
        for _ in range(3):
            assert torch.equal(opt(x, w), expected)  # the graph's result, not the poison
    finally:
        target.shadow_code, target._shadow_fn = shadow, shadow_fn
    assert specularch.explain(opt).stats.graph_hits == 3
    assert torch.equal(target.call_original((x, w), fn.__closure__), expected)  # restored


# --------------------------------------------------------------------------- 2. opcodes

ORDINARY_OPCODES = {
    "LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_CONST", "LOAD_GLOBAL", "STORE_GLOBAL",
    "LOAD_ATTR", "STORE_ATTR", "LOAD_METHOD", "LOAD_DEREF", "STORE_DEREF", "LOAD_CLOSURE",
    "MAKE_CELL", "COPY_FREE_VARS", "RESUME", "PRECALL", "CALL", "KW_NAMES", "CALL_FUNCTION_EX",
    "PUSH_NULL", "BINARY_OP", "UNARY_NEGATIVE", "UNARY_NOT", "COMPARE_OP", "IS_OP", "CONTAINS_OP",
    "BINARY_SUBSCR", "STORE_SUBSCR", "BUILD_TUPLE", "BUILD_LIST", "BUILD_MAP",
    "BUILD_CONST_KEY_MAP", "BUILD_SLICE", "LIST_APPEND", "LIST_EXTEND", "MAP_ADD",
    "UNPACK_SEQUENCE", "UNPACK_EX", "GET_ITER", "FOR_ITER", "JUMP_FORWARD", "JUMP_BACKWARD",
    "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE", "POP_TOP", "COPY", "SWAP",
    "RETURN_VALUE", "MAKE_FUNCTION", "BEFORE_WITH", "FORMAT_VALUE", "BUILD_STRING",
}


def match_class(x, spec):
    match spec:
        case complex(real=r):  # unhandled
            return x * r
        case _:
            return x


def test_unhandled_opcodes_are_real_names_and_fall_back(capsys):
    names = specularch.unhandled_opcodes()
    with capsys.disabled():
        print(f"\n3.11 opcodes not handled by the symbolic executor ({len(names)}): {names}")
    assert isinstance(names, list) and names == sorted(names) and len(set(names)) == len(names)
    assert all(n in dis.opmap for n in names), [n for n in names if n not in dis.opmap]
    assert ORDINARY_OPCODES <= set(dis.opmap)  # the list above is of real 3.11 names
    assert not ORDINARY_OPCODES & set(names), sorted(ORDINARY_OPCODES & set(names))
    assert "MATCH_CLASS" in names
    refused = specularch.fallback_opcodes()
    with capsys.disabled():
        print(f"3.11 opcodes recognised only to fall back ({len(refused)}): {refused}")
    assert {"CHECK_EG_MATCH", "PREP_RERAISE_STAR", "SEND"} <= set(refused)
    assert not {"PUSH_EXC_INFO", "CHECK_EXC_MATCH", "RAISE_VARARGS"} & set(refused + names)
    assert not set(refused) & set(names) and not set(refused) & ORDINARY_OPCODES

    assert_uses_opcode(match_class, "MATCH_CLASS")
    opt = specularch.optimize(match_class)
    x = torch.arange(3.0)
    for spec in (2 + 0j, "not complex"):
        assert torch.equal(opt(x, spec), match_class(x, spec))
    e = specularch.explain(opt)
    assert {f.kind for f in e.fallbacks} == {"unsupported_opcode"}, str(e)
    expect_fallback(e, "unsupported_opcode", filename=__file__,
                    lineno=marker_line(match_class, "unhandled"))
    assert "MATCH_CLASS" in e.fallbacks[0].explanation
    assert not e.graphs and e.stats.fallback_calls == 2


# --------------------------------------------------------------------------- 3. nesting

def inner(x):
    return x * 3


INNER = specularch.optimize(inner)
LIN = specularch.optimize(nn.Linear(4, 4))


def outer(x):
    return LIN(INNER(x)) + 1


def outer_branch(x):
    y = INNER(x)
    if y.sum() > 0:  # a branch on a tensor value: speculated, then falls back when it flips
        return LIN(y)
    return y - 1


def test_nested_optimized_calls_are_inlined():
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = nn.functional.linear(x * 3, LIN.weight, LIN.bias) + 1
    opt = specularch.optimize(outer)
    for _ in range(3):
        torch.testing.assert_close(opt(x), expected, rtol=0, atol=0)
    e = specularch.explain(opt)
    expect_graph(e, "outer")
    assert len(e.graphs) == 1 and e.stats.graph_hits == 2
    code = e.graphs[0].code
    assert "linear" in code and ("mul" in code or "* 3" in code), code
    assert "L['self']" not in " ".join(e.graphs[0].inputs)
    assert any("weight" in s for s in e.graphs[0].inputs), e.graphs[0].inputs
    # inlined: the nested optimized objects were never dispatched themselves
    assert specularch.explain(INNER).stats.calls == 0
    assert specularch.explain(LIN).stats.calls == 0


def test_nested_optimized_calls_dispatch_when_outer_falls_back():
    opt = specularch.optimize(outer_branch)
    pos, neg = torch.ones(2, 4), -torch.ones(2, 4)
    torch.testing.assert_close(opt(pos), outer_branch(pos), rtol=0, atol=0)  # speculated graph
    assert specularch.explain(opt).graphs
    reference_inner, reference_lin = (specularch.explain(INNER).stats.calls,
                                      specularch.explain(LIN).stats.calls)
    assert (reference_inner, reference_lin) == (1, 1)  # the eager reference call above
    for i in range(1, 4):  # flips: assumption_failed, then data_dependent_branch (eager)
        torch.testing.assert_close(opt(neg), outer_branch(neg), rtol=0, atol=0)
        # each optimized call ran once inside opt's eager fallback and once in the reference
        assert specularch.explain(INNER).stats.calls == reference_inner + 2 * i
    e = specularch.explain(opt)
    assert {f.kind for f in e.fallbacks} >= {"assumption_failed"}, str(e)
    assert all(f.kind in specularch.FALLBACK_KINDS for f in e.fallbacks)
    assert e.stats.fallback_calls == 3
    inner_e = specularch.explain(INNER)
    assert inner_e.graphs and inner_e.stats.graph_hits >= 1 and not inner_e.fallbacks, str(inner_e)
    torch.testing.assert_close(opt(pos), outer_branch(pos), rtol=0, atol=0)
    lin_e = specularch.explain(LIN)
    assert lin_e.stats.calls >= 2 and lin_e.graphs, str(lin_e)


class Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w + 1


OPT_LEAF = specularch.optimize(Leaf())
PLAIN_LEAF = Leaf()


def falls_back_around_two_leaves(x):
    n = int(x.sum() > 0)  # falls back: the leaves run inside the eager call, hook on
    return PLAIN_LEAF(x) + OPT_LEAF(x) + n


def test_only_the_optimized_instance_of_a_module_class_is_optimized():
    opt = specularch.optimize(falls_back_around_two_leaves)
    calls_before = specularch.explain(OPT_LEAF).stats.calls
    for _ in range(4):
        x = torch.randn(3)
        assert torch.equal(opt(x), falls_back_around_two_leaves(x))
    assert specularch.explain(opt).fallbacks
    # the optimized instance kept its own cache, reached through the hook ...
    assert specularch.explain(OPT_LEAF).stats.calls == calls_before + 4 + 4  # (+ the eager twin)
    # ... and the other instance of the same class was left alone
    with pytest.raises(TypeError, match="never optimized"):
        specularch.explain(PLAIN_LEAF)


# --------------------------------------------------------------------------- 4. threads

def flagged(x, w, flag):
    y = torch.tanh(x @ w)
    return y + 1 if flag else y - 1


def test_threads_share_one_cache():
    opt = specularch.optimize(flagged)
    w = torch.randn(4, 2)
    jobs = [(torch.randn(3, 4), i % 2 == 0) for i in range(40)]
    start = threading.Barrier(4)

    def worker(chunk):
        start.wait(timeout=30)  # all threads hit the empty cache at once
        out = []
        with specularch.config.patch(profile_calls=0, strict=False):  # (patches are per thread)
            for x, flag in chunk:
                out.append((opt(x, w, flag), flagged(x, w, flag), threading.get_ident()))
        return out

    chunks = [jobs[i::4] for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = [r for rs in pool.map(worker, chunks) for r in rs]
    assert len({ident for *_, ident in results}) == 4, "expected 4 distinct threads"
    for got, expected, _ in results:
        assert torch.equal(got, expected)
    e = specularch.explain(opt)
    guard_sets = [tuple(g.guards) for g in e.graphs]
    assert len(guard_sets) == 2 and len(set(guard_sets)) == 2, str(e)  # flag True / False
    assert e.stats.calls == 40, str(e.stats)
    assert e.stats.captures == 2, f"more than one capture per guard set:\n{e}"
    assert e.stats.fallback_calls == 0 and e.stats.graph_hits == 38, str(e.stats)


# --------------------------------------------------------------------------- 5. torch.compile

@pytest.fixture
def dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


def sin2(x):
    return x.sin() * 2


def cos3(x):
    return x.cos() * 3


def calls_plain_helper(x):
    n = int(x.sum())  # falls back: the hook is on while cos3 runs eagerly
    return cos3(x) + n


def test_torch_compile_compiles_before_and_after_specularch(dynamo):
    compiled = []

    def counting_backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    x = torch.randn(5)
    cg = torch.compile(sin2, backend=counting_backend)
    assert torch.equal(cg(x), sin2(x)) and len(compiled) == 1

    opt = specularch.optimize(affine)  # a graph ...
    args = (torch.randn(3, 4), torch.randn(4, 2))
    for _ in range(2):
        assert torch.equal(opt(*args), affine(*args))
    assert specularch.explain(opt).stats.graph_hits == 1
    fb = specularch.optimize(calls_plain_helper)  # ... and a fallback with the hook on
    ones = torch.ones(3)
    assert torch.equal(fb(ones), calls_plain_helper(ones))
    assert specularch.explain(fb).fallbacks

    assert torch.equal(cg(x), sin2(x)) and len(compiled) == 1  # still cached, still right
    y = torch.randn(2, 3)
    assert torch.equal(cg(y), sin2(y)) and len(compiled) >= 2  # new rank: torch recompiles
    # cos3 ran under specularch's hook (skip-marked in its own region): torch.compile still sees it
    cc = torch.compile(cos3, backend=counting_backend)
    before = len(compiled)
    assert torch.equal(cc(x), cos3(x)) and len(compiled) == before + 1


def test_torch_compiled_function_inside_an_optimized_function(dynamo):
    compiled = []

    def counting_backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    cg = torch.compile(sin2, backend=counting_backend)

    def uses_compiled(x):
        return cg(x) + 1

    opt = specularch.optimize(uses_compiled)
    for _ in range(3):
        x = torch.randn(4)
        assert torch.equal(opt(x), sin2(x) + 1)
    e = specularch.explain(opt)
    assert e.graphs or e.fallbacks, str(e)
    for record in e.fallbacks:
        assert record.kind in specularch.FALLBACK_KINDS and record.explanation, str(record)
        assert record.kind != "internal_error", str(record)
    if e.fallbacks:  # (today: unsupported_call) the eager run, with specularch's hook on,
        assert compiled, "torch.compile did not compile inside specularch's eager fallback"


@pytest.mark.slow
def test_a_torch_compiled_function_calling_optimized_code(dynamo):
    """torch.compile tracing into specularch's wrappers graph-breaks around them (no crash)."""
    opt_fn = specularch.optimize(sin2)
    opt_mod = specularch.optimize(nn.Linear(3, 3))

    @torch.compile(backend="eager")
    def outer(x):
        return opt_fn(x) + opt_mod(x)

    x = torch.randn(2, 3)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo explains its graph breaks at length
        for _ in range(3):
            torch.testing.assert_close(outer(x), sin2(x) + opt_mod(x), rtol=0, atol=0)


def test_an_optimized_module_pickles_deep_copies_and_keeps_its_signature():
    import copy
    import inspect
    import io
    m = specularch.optimize(MLP())
    x = torch.randn(2, 8)
    for _ in range(2):
        m(x)
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # the plain module (test_real_program_crashes)
    twin = copy.deepcopy(m)
    for other in (loaded, twin):
        assert other is not m and other.forward.__self__ is other
        for _ in range(2):
            torch.testing.assert_close(other(x), m(x), rtol=0, atol=0)
    e = specularch.explain(twin)  # a deep copy is optimized too, with a cache of its own
    assert e.stats.calls == 2 and e.graphs, str(e)
    assert "forward" not in loaded.__dict__
    assert str(inspect.signature(m.forward)) == "(x)"


# --------------------------------------------------------------------------- 6. explain / reset

def test_explain_report_of_an_mlp():
    m = specularch.optimize(MLP())
    x = torch.randn(4, 8)
    m(x)
    m(x)
    e = specularch.explain(m)
    text, full = str(e), str(specularch.explain(m, verbose=True))
    assert "specularch report for MLP.forward" in text and "specularch report for MLP.forward" in full
    assert "linear" in full and "relu" in full  # the graph code: verbose only
    assert "linear" not in text and "guards=" in text
    assert "fallbacks: 0" in text and "recompiles: 0" in text
    guards = e.graphs[0].guards
    assert any(g.startswith("L['x']") and "shape=(4, 8)" in g for g in guards), guards
    assert any("L['self'].fc.weight" in g for g in guards), guards
    x_guard = next(g for g in guards if g.startswith("L['x']"))
    assert x_guard.endswith(f"{__file__}:{MLP.forward.__code__.co_firstlineno}"), x_guard
    assert e.stats.calls == 2 and e.stats.graph_hits == 1 and e.stats.captures == 1

    m(torch.randn(3, 8))  # shape change: recompile, with a reason naming the tensor
    e = specularch.explain(m)
    assert len(e.recompiles) == 1 and e.stats.recompiles == 1
    reason = str(e.recompiles[0])
    assert "L['x']" in reason and "expected 4, got 3" in reason, reason
    assert f"recompiles: 1\n  {reason}" in str(e)


def test_explain_of_something_never_optimized_is_a_type_error():
    for obj in (42, "model", len, nn.Linear(2, 2), MLP(), sin2):
        with pytest.raises(TypeError, match="optimize"):
            specularch.explain(obj)
    with pytest.raises(TypeError, match="never optimized"):
        specularch.explain(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="sin2 is not an optimized function"):
        specularch.explain(sin2)
    specularch.explain(specularch.optimize(sin2))  # what optimize() returned: fine


def test_reset_clears_records_but_objects_stay_optimized():
    m = specularch.optimize(MLP())
    f = specularch.optimize(affine)
    x, args = torch.randn(2, 8), (torch.randn(3, 4), torch.randn(4, 2))
    for _ in range(2):
        m(x)
        f(*args)
    assert specularch.explain(m).graphs and specularch.explain(f).stats.graph_hits == 1
    specularch.reset()
    for obj in (m, f):
        e = specularch.explain(obj)
        assert not e.graphs and e.stats.calls == 0 and e.stats.captures == 0, str(e)
    assert isinstance(m, MLP) and "forward" in vars(m)  # still optimized in place
    m(x)
    f(*args)
    for obj in (m, f):
        e = specularch.explain(obj)
        assert e.stats.captures == 1 and len(e.graphs) == 1 and e.stats.calls == 1, str(e)


# --------------------------------------------------------------------------- 7. bad input

def test_optimize_rejects_what_it_cannot_optimize():
    for bad in (42, len, "text", torch.relu):
        with pytest.raises(TypeError, match="nn.Module, a Python function or a bound method") as info:
            specularch.optimize(bad)
        assert type(bad).__qualname__ in str(info.value)


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(specularch.fx_lower.UnknownBackendError) as info:
        specularch.optimize(affine, backend="nope")
    message = str(info.value)
    assert "'nope'" in message and "available" in message
    for name in specularch.list_backends():
        assert repr(name) in message, message
    with pytest.raises(specularch.fx_lower.UnknownBackendError):
        specularch.optimize(MLP(), backend="nope")
    assert isinstance(info.value, ValueError)


def test_bad_environment_value_names_the_variable_and_the_form():
    env = {**os.environ, "SPECULARCH_CACHE_LIMIT": "lots"}
    out = subprocess.run(
        [sys.executable, "-c", "import specularch; print(specularch.config.cache_limit)"],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout
    assert "ConfigError" in out.stderr, out.stderr
    assert "SPECULARCH_CACHE_LIMIT='lots'" in out.stderr, out.stderr
    assert "expected a positive integer" in out.stderr, out.stderr


# --------------------------------------------------------------------------- 8. strict mode

def reads_a_value(x):
    n = int(x.sum())  # falls back
    return x * n


def test_strict_mode_raises_instead_of_falling_back():
    opt = specularch.optimize(reads_a_value)
    x = torch.ones(3)
    line = marker_line(reads_a_value, "falls back")
    with specularch.config.patch(strict=True):
        with pytest.raises(specularch.SpecularchStrictError) as info:
            opt(x)
    message = str(info.value)
    assert "data_dependent_value" in message, message
    assert f"{__file__}:{line}" in message, message
    assert isinstance(info.value, RuntimeError)
    # Without strict, the very same call returns eager's result.
    with specularch.config.patch(strict=False):
        assert torch.equal(opt(x), reads_a_value(x))
        assert torch.equal(opt(x * 2), reads_a_value(x * 2))
    expect_fallback(specularch.explain(opt), "data_dependent_value", filename=__file__, lineno=line)


def test_strict_mode_raises_instead_of_recompiling():
    opt = specularch.optimize(flagged)
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    with specularch.config.patch(strict=True):
        assert torch.equal(opt(x, w, True), flagged(x, w, True))  # a graph: no error
        with pytest.raises(specularch.SpecularchStrictError, match="recompile"):
            opt(x, w, False)


# --------------------------------------------------------------------------- 9. parameters

def test_parameters_are_graph_inputs_not_constants():
    m = specularch.optimize(MLP())
    x = torch.randn(4, 8)
    first = m(x)
    torch.testing.assert_close(first, MLP.forward(m, x), rtol=0, atol=0)
    e = specularch.explain(m)
    inputs = e.graphs[0].inputs
    for name in ("fc.weight", "fc.bias", "fc2.weight", "fc2.bias"):
        assert f"L['self'].{name}" in inputs, inputs
    with torch.no_grad():
        m.fc.weight.mul_(2)
        m.fc2.bias.add_(1)
    second = m(x)
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, MLP.forward(m, x), rtol=0, atol=0)
    e = specularch.explain(m)
    assert e.stats.captures == 1 and e.stats.recompiles == 0 and e.stats.graph_hits == 1, str(e)
    assert len(e.graphs) == 1 and e.graphs[0].hits == 2  # (runs, the capture's included)
    assert "fc.weight" not in e.graphs[0].code.split("def forward", 1)[0]  # no baked-in constant
    assert not any(n.op == "get_attr" for n in _graph_nodes(m)), "parameters baked into the graph"


def _graph_nodes(m):
    state = specularch.api._state_of(m)
    return list(state.entries[0].capture.graph_module.graph.nodes)


# --------------------------------------------------------------------------- 10. gradients

def test_gradients_through_the_fx_backend_match_eager():
    e = check_module(lambda: MLP(), lambda: A(T(4, 8, requires_grad=True)), calls=3, grad=True,
                     expect="graph", backend="fx")
    assert e.stats.graph_hits == 2


def test_loss_backward_after_an_optimized_forward():
    torch.manual_seed(0)
    eager = MLP()
    torch.manual_seed(0)
    opt = specularch.optimize(MLP())
    x, target = torch.randn(6, 8), torch.randn(6, 4)
    for _ in range(3):
        for model in (eager, opt):
            model.zero_grad()
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
        for (name, pe), po in zip(eager.named_parameters(), opt.parameters()):
            assert po.grad is not None, name
            torch.testing.assert_close(po.grad, pe.grad, rtol=0, atol=0, msg=name)
    e = specularch.explain(opt)
    expect_graph(e, "MLP")
    assert e.stats.graph_hits == 2


# --------------------------------------------------------------------------- logging

def test_logging_topics(caplog):
    opt = specularch.optimize(flagged)
    x, w = torch.ones(2, 4), torch.ones(4, 2)
    with caplog.at_level("INFO", logger="specularch"), \
            specularch.config.patch(log=frozenset({"graphs", "recompiles", "fallbacks"})):
        opt(x, w, True)
        opt(x, w, False)
    text = caplog.text
    assert "[graphs]" in text and "def forward" in text
    assert "[recompiles]" in text and "L['flag'] expected True, got False" in text
    caplog.clear()
    opt(x, w, True)  # logging off: nothing
    assert caplog.text == ""


def prints_its_input(x):
    y = x * 2
    print(y)  # a tensor printed: the call runs eagerly
    return y + 1


def raises_on_negative(x):
    if x.sum() < 0:
        raise ValueError("negative")
    return x + 1


def test_fallbacks_are_warned_about_once_per_site(caplog, capsys):
    """With no logging chosen, the first call that returns from the original Python for a
    reason at a line logs one WARNING naming the function, kind, line and hint; calls that
    raise and expected assumption failures do not, and ``warn_fallbacks=False`` silences it."""
    warnings = lambda: [r for r in caplog.records
                        if r.name == "specularch" and r.levelname == "WARNING"]
    opt = specularch.optimize(prints_its_input)
    for _ in range(3):
        opt(torch.ones(2))
    (only,) = warnings()
    line = prints_its_input.__code__.co_firstlineno + 2
    assert (f"prints_its_input runs eagerly [data_dependent_value] at {__file__}:{line}"
            in only.getMessage()), only.getMessage()
    assert "hint:" in only.getMessage() and "SPECULARCH_WARN_FALLBACKS=0" in only.getMessage()

    caplog.clear()
    checked = specularch.optimize(raises_on_negative)
    checked(torch.ones(2))  # captured: the branch is speculated False
    for _ in range(2):
        with pytest.raises(ValueError):
            checked(-torch.ones(2))  # the assumption fails, then the path raises
    assert warnings() == []
    before = specularch.explain(checked).stats
    checked(torch.ones(2))  # a side that only raises stays an in-graph check: graphs again
    checked(torch.ones(2))
    after = specularch.explain(checked).stats
    assert warnings() == [] and after.fallback_calls == before.fallback_calls
    assert after.graph_hits + after.captures == before.graph_hits + before.captures + 2

    caplog.clear()
    specularch.reset()
    with specularch.config.patch(warn_fallbacks=False):
        opt(torch.ones(2))
    assert warnings() == []
    capsys.readouterr()


def test_fallback_warnings_go_to_logging_the_program_sets_up_later(caplog, capsys):
    """Before the program sets up logging, the warning has specularch's own stderr handler;
    once it has (``basicConfig`` after the first warning), later warnings reach the program's
    handlers instead of staying on stderr."""
    import logging
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []  # a program that has not set up logging (pytest's handlers removed)
    try:
        opt = specularch.optimize(prints_its_input)
        opt(torch.ones(2))
        assert "prints_its_input runs eagerly" in capsys.readouterr().err
    finally:
        root.handlers = saved  # the program sets up logging (here: pytest's capture again)
    specularch.reset()  # warn again
    opt(torch.ones(2))
    assert [r.getMessage().split(" [")[0] for r in caplog.records if r.name == "specularch"] \
        == ["prints_its_input runs eagerly"]
    assert "runs eagerly" not in capsys.readouterr().err
    assert specularch.log.logger.propagate and not specularch.log.logger.handlers


def test_demo_shows_what_the_readme_says(capsys):
    """`python -m specularch.demo` (the README's first command): every result equals eager, the
    block's report has graph code, guards and a recompile, the tensor branch shows its
    fallback and then the torch.where graph that replaced it, and the TreeLSTM step runs 40
    new trees with one graph, its parameters eager's within rounding."""
    from specularch import demo
    torch_threads = torch.get_num_threads()
    try:
        demo.main()
    finally:
        torch.set_num_threads(torch_threads)
    out = capsys.readouterr().out
    assert "results equal eager: True" in out and "graphs=1" in out, out
    assert "equal eager on every call: True" in out, out
    assert "  code:" in out and "  guards:" in out and "recompiled Block.forward" in out, out
    assert "fallback [assumption_failed] noisy" in out, out
    assert "torch.where(" in out.split("fallback [assumption_failed]")[1], out
    trees = out.split("TreeLSTM training step on a new random tree every step")[1]
    graphs = int(trees.split(" graph(s) for 40 trees")[0].rsplit(" ", 1)[1])
    assert graphs <= 2 and "within rtol 1e-4: True" in trees, out  # (the first step's .grad is None)


def test_torch_compile_runs_while_specularch_traces_on_its_background_thread(dynamo):
    """``torch.fx``'s "is tracing" flag is a process-wide global that a trace on specularch's
    background compile thread sets: a ``torch.compile``'d function the program calls
    meanwhile raised "Detected that you are using FX to symbolically trace a
    dynamo-optimized function" (found by the benchmark running both side by side). It is
    answered per thread now (``fx_lower/_torch_background.py``)."""
    import threading

    from torch.fx import _symbolic_trace
    from torch.fx.experimental.proxy_tensor import make_fx

    from specularch.fx_lower._torch_background import background_tracing

    cg = torch.compile(sin2, backend="eager")
    x = torch.randn(4)
    assert torch.equal(cg(x), sin2(x))
    tracing, done = threading.Event(), threading.Event()

    def traced(t):
        tracing.set()
        done.wait(10)
        return t + 1

    def background():
        with background_tracing():
            make_fx(traced)(torch.ones(2))

    thread = threading.Thread(target=background)
    thread.start()
    try:
        assert tracing.wait(10)
        assert not _symbolic_trace.is_fx_symbolic_tracing()
        assert torch.equal(cg(x), sin2(x))
    finally:
        done.set()
        thread.join()
    seen = []
    make_fx(lambda t: seen.append(_symbolic_trace.is_fx_tracing()) or t * 2)(torch.ones(2))
    assert seen == [True] and not _symbolic_trace.is_fx_tracing()  # this thread's own trace


class _Base(nn.Module):
    def forward(self, x):
        return x.tanh()


class _Sub(_Base):
    def forward(self, x):
        return super().forward(x) * 2  # zero-argument super(): forward is a closure (__class__)


class _Explicit(_Base):
    def forward(self, x):
        return _Base.forward(self, x) * 2


@pytest.mark.parametrize("sub", [_Sub, _Explicit])
def test_a_subclass_calling_its_optimized_base_class_forward_is_eager_s(sub):
    """Once an instance of the base class is optimized, its forward's code is intercepted;
    a call of it from an optimized subclass instance (``super().forward(x)``,
    ``Base.forward(self, x)``) found the subclass instance's cache, which is for the
    subclass's own forward: it raised (a closure without its cells) or ran the subclass's
    forward again (tanh(x) * 16 for tanh(x) * 2, a silent wrong answer; found by a helper's
    sweep). It is the base's own call now."""
    with specularch.config.patch(profile_calls=3):  # (the bug was in the eager calls)
        specularch.optimize(_Base())(torch.ones(2))
        opt = specularch.optimize(sub())
        for i in range(6):
            x = torch.randn(3)
            assert torch.equal(opt(x), x.tanh() * 2), i
    assert specularch.explain(opt).stats.graph_hits >= 1
