"""specularch.frames: interception of chosen code objects through torch's C frame hook.

The dispatcher used here records each call and returns ``("dispatched", original result)``,
so a test can see both that a call was intercepted and that the original body ran right.
"""
from __future__ import annotations

import builtins
import functools
import math
import pathlib
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from specularch import frames
from specularch.frames import _torch_hook, interceptor
from specularch.frames.trampoline import GLUE_NAME, call_with_slots

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not frames.HOOK_AVAILABLE,
                                reason=f"frame hook unavailable: {frames.hook_unavailable_reason()}")


class Recorder:
    """Dispatcher that records ``(qualname, slots)`` and wraps the original's result."""

    def __init__(self):
        self.calls = []

    def __call__(self, target, slots, cells):
        self.calls.append((target.name, slots))
        return ("dispatched", target.call_original(slots, cells))

    def names(self):
        return [name for name, _ in self.calls]


@pytest.fixture(autouse=True)
def rec():
    frames.reset()
    recorder = Recorder()
    before = interceptor._dispatcher  # specularch's own, restored for the tests after these
    frames.set_dispatcher(recorder)
    callback, region = _torch_hook.get_callback(), _torch_hook.get_region()
    yield recorder
    frames.disable_globally()
    frames.set_dispatcher(before)
    frames.reset()
    assert _torch_hook.get_callback() is callback, "a test left a frame callback behind"
    assert _torch_hook.get_region() == region, "a test left the region changed"


# ------------------------------------------------------------------ user functions ----

def plain(x, y):
    return x * 10 + y


def not_a_target(x):
    return x + 1


def calls_plain(x):
    return not_a_target(plain(x, 2))


def with_defaults(a, b=2, *, c=3):
    return (a, b, c)


def posonly(a, b=5, /, c=6):
    return (a, b, c)


def varargs(a, *rest):
    return (a, rest)


def kwonly(a, *, k, m=7):
    return (a, k, m)


def varkw(a, **extra):
    return (a, sorted(extra.items()))


def everything(a, b=1, /, c=2, *args, d, e=4, **kw):
    return (a, b, c, args, d, e, sorted(kw.items()))


SIGNATURE_CASES = [
    (with_defaults, [((1,), {}), ((1, 5), {}), ((1,), {"c": 9}), ((), {"a": 1, "b": 2})]),
    (posonly, [((1,), {}), ((1, 2), {}), ((1, 2, 3), {}), ((1,), {"c": 0})]),
    (varargs, [((1,), {}), ((1, 2, 3), {}), ((), {"a": 4})]),
    (kwonly, [((1,), {"k": 2}), ((1,), {"k": 2, "m": 3}), ((), {"a": 0, "k": 0})]),
    (varkw, [((1,), {}), ((1,), {"z": 2, "y": 3}), ((), {"a": 1, "b": 2})]),
    (everything, [((1,), {"d": 0}), ((1, 2, 3, 4, 5), {"d": 6, "e": 7, "f": 8}),
                  ((1,), {"a": "kw-a", "b": "kw-b", "d": 0})]),  # pos-only names into **kw
]


# ------------------------------------------------------------------- basic dispatch ----

def test_hook_is_available_on_supported_versions():
    assert sys.version_info[:2] == (3, 11) and torch.__version__.startswith("2.13")
    assert frames.HOOK_AVAILABLE is True
    assert frames.hook_unavailable_reason() is None
    assert interceptor.self_test() == (True, "ok")


def test_frames_never_imports_torch_dynamo():
    code = ("import sys, specularch.frames as f\n"
            "with f.hook_active(): pass\n"
            "assert f.HOOK_AVAILABLE\n"
            "assert 'torch._dynamo' not in sys.modules, 'frames imported torch._dynamo'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_plain_function_is_dispatched_only_inside_hook(rec):
    target = frames.register(plain)
    assert plain(1, 2) == 12 and rec.calls == []
    with frames.hook_active():
        assert frames.is_active()
        assert plain(1, 2) == ("dispatched", 12)
        assert plain(3, y=4) == ("dispatched", 34)
    assert not frames.is_active()
    assert plain(1, 2) == 12
    assert rec.calls == [(target.name, (1, 2)), (target.name, (3, 4))]


def test_target_attributes():
    target = frames.register(everything)
    assert target.fn is everything and target.code is everything.__code__
    assert target.name == "everything" and target.filename == __file__
    assert target.firstlineno == everything.__code__.co_firstlineno
    assert target.globals is globals()
    assert target.argnames == ("a", "b", "c", "d", "e", "args", "kw")
    assert target.trampoline is not None and target.is_generator is False
    assert target.shadow_code == target.code and target.shadow_code is not target.code
    assert isinstance(target.key, int)
    assert frames.register(everything) is target


@pytest.mark.parametrize("fn,calls", SIGNATURE_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_slots_binder_and_round_trip(rec, fn, calls):
    target = frames.register(fn)
    binder = target.binder_for(fn)
    for args, kwargs in calls:
        expected = fn(*args, **kwargs)
        slots = binder(*args, **kwargs)
        assert len(slots) == len(target.argnames)
        assert call_with_slots(fn, slots) == expected
        assert target.call_original(slots, None) == expected
        rec.calls.clear()
        with frames.hook_active():
            assert fn(*args, **kwargs) == ("dispatched", expected)
        assert rec.calls == [(target.name, slots)]


BAD_CALLS = [
    (with_defaults, (), {}), (with_defaults, (1, 2, 3), {}), (with_defaults, (1,), {"z": 1}),
    (with_defaults, (1,), {"a": 2}), (posonly, (), {"a": 1}), (kwonly, (1,), {}),
    (kwonly, (1, 2), {"k": 1}), (varkw, (1, 2), {}), (everything, (1,), {}),
]


@pytest.mark.parametrize("fn,args,kwargs", BAD_CALLS)
def test_binder_raises_pythons_type_error(fn, args, kwargs):
    binder = frames.register(fn).binder_for(fn)
    with pytest.raises(TypeError) as direct:
        fn(*args, **kwargs)
    with pytest.raises(TypeError) as bound:
        binder(*args, **kwargs)
    assert str(bound.value) == str(direct.value)
    assert fn.__name__ in str(bound.value)


def test_binder_follows_the_functions_current_defaults():
    def f(a, b=1, *, c=2):
        return a
    binder = frames.register(f).binder_for(f)
    assert binder(0) == (0, 1, 2)
    f.__defaults__, f.__kwdefaults__ = (10,), {"c": 20}
    assert frames.register(f).binder_for(f)(0) == (0, 10, 20)
    with pytest.raises(TypeError):
        frames.register(f).binder_for(plain)


def test_call_with_slots_rejects_wrong_slot_count():
    with pytest.raises(TypeError, match="expected a tuple of 2 slots"):
        call_with_slots(plain, (1,))
    with pytest.raises(TypeError, match="expected 2 slots"):
        frames.register(plain).call_original((1, 2, 3), None)


# -------------------------------------------------------------- closures and cells ----

def make_counter(step0):
    n = 0

    def bump(step=step0):
        nonlocal n
        n += step
        return n
    return bump


def test_closures_write_the_users_cells(rec):
    c1, c2 = make_counter(1), make_counter(10)
    target = frames.register(c1)
    assert frames.register(c2) is target and target.fn is c1
    with frames.hook_active():
        got = [c1(), c1(), c2(), c1(5)]
    assert got == [("dispatched", 1), ("dispatched", 2), ("dispatched", 10), ("dispatched", 7)]
    assert c1() == 8 and c2() == 20   # the real cells were updated
    assert rec.names() == ["make_counter.<locals>.bump"] * 4
    with pytest.raises(TypeError, match="closure"):
        target.call_original((1,), None)


def test_argument_captured_by_inner_lambda(rec):
    def scaled(x, k=3):
        return (lambda: x * k)()
    def mixed(z, a, *rest):      # argument cells plus local cells, not in sorted order
        y, b = 2, 1
        return (lambda: (z, a, b, y, rest))()
    frames.register(scaled)
    frames.register(mixed)
    assert set(scaled.__code__.co_cellvars) == {"x", "k"}
    assert len(mixed.__code__.co_cellvars) == 5
    with frames.hook_active():
        assert scaled(2) == ("dispatched", 6)
        assert mixed(9, 8, 7) == ("dispatched", (9, 8, 1, 2, (7,)))
    assert [slots for _, slots in rec.calls] == [(2, 3), (9, 8, (7,))]


def test_lambda_target(rec):
    square = lambda v: v * v  # noqa: E731
    target = frames.register(square)
    assert target.name.endswith("<lambda>") and target.trampoline.co_name == "<lambda>"
    with frames.hook_active():
        assert square(7) == ("dispatched", 49)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Child(Base):
    def forward(self, x):
        scale = 2.0
        return (lambda: super(Child, self).forward(x) * scale)() + super().forward(x)


def test_super_in_module_forward(rec):
    net, x = Child(), torch.randn(2, 4)
    expected = net(x)
    assert "__class__" in Child.forward.__code__.co_freevars
    target = frames.register(net.forward)   # bound method: unwrapped to Child.forward
    assert target.fn is Child.forward
    with frames.hook_active():
        tag, out = net(x)
    assert tag == "dispatched" and torch.equal(out, expected)
    assert rec.names() == ["Child.forward"]   # Base.forward is not a target


# ------------------------------------------------------------ generators, skipping ----

def gen_target(n):
    for i in range(n):
        yield i * 2


def test_generator_targets_are_never_intercepted(rec):
    target = frames.register(gen_target)
    assert target.is_generator and target.trampoline is None
    started = gen_target(3)
    next(started)                               # a generator started outside the hook
    with frames.hook_active():
        assert list(gen_target(4)) == [0, 2, 4, 6]
        assert list(started) == [2, 4]          # resumed inside the hook
    assert rec.calls == []
    assert list(target.call_original((2,), None)) == [0, 2]


def test_non_target_frames_reach_the_callback_once(rec):
    frames.register(plain)
    with frames.hook_active():
        for _ in range(2):                        # first round: one callback per new code
            before = interceptor.stats()
            for i in range(5):
                not_a_target(i)
                plain(i, 0)
            after = interceptor.stats()
    assert after == before, "cached codes must not reach the Python callback again"
    assert before["skips"] >= 2 and before["trampolines_installed"] == 1


def test_custom_builtins_module_is_skipped_not_broken(rec):
    ns = {"__builtins__": {"len": len}}
    exec("def f(x):\n    return len(x)\n", ns)
    frames.register(ns["f"])
    with frames.hook_active():
        assert ns["f"]("abc") == 3
    assert rec.calls == [] and interceptor.stats()["skip_once"] == 1


def test_callback_errors_never_escape(monkeypatch, rec):
    frames.register(plain)

    def broken(frame):
        raise RuntimeError("probe")
    with frames.hook_active():
        monkeypatch.setattr(_torch_hook, "frame_facts", broken)
        assert plain(1, 2) == 12                  # skipped once, original ran
        monkeypatch.undo()
        assert frames.is_active()                 # an escaping error would have turned it off
        assert plain(1, 2) == ("dispatched", 12)
    assert interceptor.stats()["callback_errors"] >= 1


# ------------------------------------------------------------ nesting and recursion ----

def inner_target(x):
    return x + 1


def outer_target(x):
    return inner_target(x) * 2


def test_nested_targets_dispatch_from_inside_call_original():
    depth, events = [0], []

    def dispatcher(target, slots, cells):
        events.append((depth[0], target.name))
        depth[0] += 1
        try:
            return target.call_original(slots, cells) + 100
        finally:
            depth[0] -= 1
    frames.set_dispatcher(dispatcher)
    frames.register(outer_target)
    frames.register(inner_target)
    with frames.hook_active():
        assert outer_target(1) == ((1 + 1 + 100) * 2) + 100
    assert events == [(0, "outer_target"), (1, "inner_target")]


def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)


def test_call_original_does_not_redispatch_itself():
    seen = []

    def dispatcher(target, slots, cells):
        seen.append(slots[0])
        return target.call_original(slots, cells)
    frames.set_dispatcher(dispatcher)
    frames.register(fact)
    with frames.hook_active():
        assert fact(5) == 120
    assert seen == [5, 4, 3, 2, 1]   # one dispatch per recursion level, not a loop


def test_default_dispatch_runs_original():
    frames.set_dispatcher(None)
    frames.register(plain)
    with frames.hook_active():
        assert plain(1, 2) == 12


# --------------------------------------------------------- activation and threads ----

def test_hook_is_per_thread(rec):
    frames.register(plain)
    results, inside, release = {}, threading.Event(), threading.Event()

    def worker(use_hook):
        if use_hook:
            with frames.hook_active():
                results[use_hook] = (plain(1, 1), frames.is_active())
        else:
            results[use_hook] = (plain(1, 1), frames.is_active())

    with frames.hook_active():
        ours = _torch_hook.get_region()
        t = threading.Thread(target=worker, args=(False,))
        t.start()
        t.join()
        t = threading.Thread(target=worker, args=(True,))
        t.start()
        t.join()
        # the region is process-wide: the worker's exit must not end ours
        assert frames.is_active() and _torch_hook.get_region() == ours
    assert results == {False: (11, False), True: (("dispatched", 11), True)}

    def hold():  # hook on in another thread only: this thread is unaffected
        with frames.hook_active():
            inside.set()
            release.wait(5)
    t = threading.Thread(target=hold)
    t.start()
    inside.wait(5)
    assert plain(2, 2) == 22 and not frames.is_active()
    release.set()
    t.join()


def test_exception_in_body_propagates_and_hook_is_restored(rec):
    error = ValueError("boom")

    def raiser(x):
        raise error
    frames.register(raiser)
    outer_callback = _torch_hook.get_callback()
    with pytest.raises(ValueError) as info:
        with frames.hook_active():
            with pytest.raises(ValueError) as inner:
                raiser(1)
            assert inner.value is error and frames.is_active()
            raiser(2)
    assert info.value is error
    assert _torch_hook.get_callback() is outer_callback and not frames.is_active()
    assert [s for _, s in rec.calls] == [(1,), (2,)]


def test_exception_in_dispatcher_propagates(rec):
    def bad_dispatcher(target, slots, cells):
        raise KeyError("dispatcher")
    frames.set_dispatcher(bad_dispatcher)
    frames.register(plain)
    with frames.hook_active():
        with pytest.raises(KeyError, match="dispatcher"):
            plain(1, 2)
        assert frames.is_active()
    with pytest.raises(TypeError):
        frames.set_dispatcher(42)


def test_nested_and_reentered_hook_active_restore_state():
    region0 = _torch_hook.get_region()
    ctx = frames.hook_active()
    with ctx:
        ours = _torch_hook.get_region()
        assert ours != region0 and ours >= interceptor.REGION_BASE
        with ctx:
            with frames.hook_active():
                assert frames.is_active()
            assert frames.is_active() and _torch_hook.get_region() == ours
        assert frames.is_active() and _torch_hook.get_region() == ours
    assert not frames.is_active() and _torch_hook.get_region() == region0


def test_enable_and_disable_globally(rec):
    frames.register(plain)
    assert frames.enable_globally() is True
    frames.enable_globally()                      # idempotent
    assert frames.is_active() and plain(1, 0) == ("dispatched", 10)
    with frames.hook_active():
        assert frames.is_active()
    assert frames.is_active()
    frames.disable_globally()
    assert not frames.is_active() and plain(1, 0) == 10
    frames.disable_globally()                     # no-op


def test_enable_globally_inside_a_block_ends_with_it():
    with frames.hook_active():
        frames.enable_globally()
    assert not frames.is_active()
    frames.enable_globally()                      # really enables again
    assert frames.is_active()
    frames.disable_globally()
    assert not frames.is_active()


def test_disable_globally_inside_a_block_ends_the_block_too():
    region0 = _torch_hook.get_region()
    frames.enable_globally()
    with frames.hook_active():
        frames.disable_globally()
        assert not frames.is_active()
    assert not frames.is_active() and _torch_hook.get_region() == region0


def test_unsupported_versions_are_reported_not_raised(monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 12, 0, "final", 0))
    reason, _, _ = _torch_hook._probe()
    assert "3.11" in reason and "3.12" not in reason.split("this is")[0]
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    reason, _, _ = _torch_hook._probe()
    assert "2.13" in reason and "2.14.0" in reason
    monkeypatch.undo()
    assert _torch_hook._probe()[0] is None


def test_unavailable_hook_degrades_to_noop(monkeypatch, rec):
    monkeypatch.setattr(frames, "_reason", "pretend torch 9.9")
    monkeypatch.setattr(frames, "_checked", True)
    assert frames.HOOK_AVAILABLE is False
    assert frames.hook_unavailable_reason() == "pretend torch 9.9"
    frames.register(plain)
    with frames.hook_active():
        assert plain(1, 2) == 12 and not frames.is_active()
    assert frames.enable_globally() is False and not frames.is_active()


# ------------------------------------------------------------- registry management ----

@pytest.mark.parametrize("obj", [len, math.sin, int, Base(), functools.partial(plain, 1), 3])
def test_register_rejects_non_functions(obj):
    with pytest.raises(TypeError, match="only Python functions"):
        frames.register(obj)


def test_reset_stops_interception(rec):
    frames.register(plain)
    with frames.hook_active():
        assert plain(1, 2) == ("dispatched", 12)
        frames.reset()
        assert plain(1, 2) == 12
        frames.register(plain)
        assert plain(1, 2) == ("dispatched", 12)
    frames.reset()
    with frames.hook_active():
        assert plain(1, 2) == 12
    assert interceptor.stats()["skips"] >= 1


def test_register_after_code_was_skip_marked(rec):
    def late(x):
        return -x
    with frames.hook_active():
        assert late(1) == -1                      # skip-marked as a non-target
        frames.register(late)
        assert late(1) == ("dispatched", -1)


def test_stale_trampoline_key_is_loud():
    glue = getattr(builtins, GLUE_NAME)
    with pytest.raises(RuntimeError, match="unknown target key"):
        glue(-12345, (), None)


def test_run_code_refuses_objects_that_would_crash_torch():
    good = frames.register(plain)
    with pytest.raises(TypeError):
        _torch_hook.run_code(42, plain.__code__)
    with pytest.raises(TypeError):
        _torch_hook.run_code(not_a_target.__code__, plain.__code__)
    with pytest.raises(TypeError):
        _torch_hook.run_code(gen_target.__code__, gen_target.__code__)
    assert _torch_hook.run_code(good.trampoline, plain.__code__).apply_to_code is True


# --------------------------------------------------------------- torch.compile coexistence ----

def compiled_before(x):
    return x * 2 + 1


def compiled_after(x):
    return x * 3 - 1


def tensor_free(a, b):
    return a + b


def test_torch_compile_still_compiles_functions_we_touched(rec):
    import torch._dynamo  # tests only: production code never imports the tracer

    counts = {"n": 0}

    def counting_backend(gm, example_inputs):
        counts["n"] += 1
        return gm.forward

    x = torch.randn(3)
    opt_before = torch.compile(compiled_before, backend=counting_backend)
    assert torch.equal(opt_before(x), x * 2 + 1) and counts["n"] == 1
    with frames.hook_active():
        compiled_before(x), compiled_after(x)       # our hook skip-marks both codes
        assert torch.equal(opt_before(x), x * 2 + 1)  # compiled call inside our hook
        assert frames.is_active() and _torch_hook.get_region() >= interceptor.REGION_BASE
    opt_after = torch.compile(compiled_after, backend=counting_backend)
    assert torch.equal(opt_after(x), x * 3 - 1) and counts["n"] == 2

    frames.register(compiled_before)                # a target is still compiled by torch
    torch._dynamo.reset()
    assert torch.equal(torch.compile(compiled_before, backend=counting_backend)(x), x * 2 + 1)
    assert counts["n"] == 3

    # torch.compile marks a tensor-free frame SKIP in its global region; register undoes it.
    assert torch.compile(tensor_free, backend=counting_backend)(1, 2) == 3
    frames.register(tensor_free)
    with frames.hook_active():
        assert tensor_free(1, 2) == ("dispatched", 3)
    torch._dynamo.reset()


def test_a_freed_shadow_code_is_forgotten():
    """A target's shadow code is never offered to the global policy while it lives; once its
    target is dropped and it is freed, its address is free for a new code object, which must
    not be taken for a shadow (under pytest-xdist's test order a fresh function landed on
    such an address and the policy was never asked about it)."""
    import gc
    import weakref
    ns = {}
    exec(compile("def fresh(x):\n    return x - 1\n", "<fresh>", "exec"), ns)
    target = frames.register(ns["fresh"])
    shadow = weakref.ref(target.shadow_code)
    key = id(target.shadow_code)
    assert key in interceptor._shadow_ids
    frames.reset()
    del target, ns
    gc.collect()
    assert shadow() is None, "the shadow code outlived its target"
    assert key not in interceptor._shadow_ids
