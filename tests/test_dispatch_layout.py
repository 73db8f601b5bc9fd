"""The dispatcher package's public seams: the run wrapper (what the pytest plugin's compare
mode uses), the state listing, the distributed hook points, and the layering they allow
(the dispatcher never imports ``specularch.distributed``; no other module reads its private
registries)."""
import ast
import gc
import pathlib

import pytest
import torch
from torch import nn

import specularch
from specularch import dispatch
from specularch.dispatch import hooks
from differential import T, assert_same

PACKAGE = pathlib.Path(specularch.__file__).resolve().parent
COUNT = 0


def bump(x, n):
    global COUNT
    COUNT += n
    return x * 2 + n


def fails_on_negative(x):
    if x.sum().item() < 0:
        raise ValueError("negative input")
    return x + 1


@pytest.fixture
def wrapper_calls():
    """A run wrapper that records each call's target name and runs the call itself."""
    calls = []

    def wrapper(state, slots, cells, run):
        calls.append(state.target.name)
        return run(state, slots, cells)
    previous = dispatch.set_run_wrapper(wrapper)
    yield calls
    assert dispatch.set_run_wrapper(previous) is wrapper


def test_run_wrapper_takes_every_optimized_call_and_results_match_eager(wrapper_calls):
    global COUNT
    COUNT = 0
    expected = [bump(T(3, seed=i), i) for i in range(8)]
    eager_count, COUNT = COUNT, 0
    opt = specularch.optimize(bump)
    got = [opt(T(3, seed=i), i) for i in range(8)]
    assert_same(expected, got)
    assert COUNT == eager_count  # the heap: each call's write happened once
    assert wrapper_calls == ["bump"] * 8
    assert specularch.explain(opt).stats.graph_hits >= 1  # the wrapper ran graphs, not only eager


def test_run_wrapper_sees_module_calls_and_exceptions(wrapper_calls):
    model = nn.Linear(3, 2)
    x = T(4, 3, seed=1)
    expected = model(x)
    opt = specularch.optimize(model)
    for _ in range(4):
        assert_same(expected, opt(x))
    guarded = specularch.optimize(fails_on_negative)
    with pytest.raises(ValueError, match="negative input") as raised:
        guarded(-torch.ones(2))
    with pytest.raises(ValueError) as eager_raised:
        fails_on_negative(-torch.ones(2))
    assert str(raised.value) == str(eager_raised.value)
    assert wrapper_calls == ["Linear.forward"] * 4 + ["fails_on_negative"]


def test_without_a_run_wrapper_calls_are_not_wrapped(wrapper_calls):
    opt = specularch.optimize(bump)
    opt(T(2, seed=0), 0)
    previous = dispatch.set_run_wrapper(None)
    try:
        assert dispatch.run_wrapper() is None
        opt(T(2, seed=0), 0)
    finally:
        dispatch.set_run_wrapper(previous)
    assert dispatch.run_wrapper() is previous
    assert wrapper_calls == ["bump"]


def test_all_states_lists_optimized_objects_while_they_live():
    def square(x):
        return x * x

    opt = specularch.optimize(square)
    x = T(3, seed=2)
    assert_same(square(x), opt(x))
    state = opt.__specularch_state__
    assert any(s is state for s in dispatch.all_states())
    assert state.stats.calls == 1
    del opt, state
    gc.collect()
    assert not any(s.target.name.endswith("square") for s in dispatch.all_states())


def test_distributed_installs_its_hooks_and_the_dispatcher_consults_them(monkeypatch):
    from specularch.distributed.steps import DistributedSteps
    assert type(hooks.distributed) is DistributedSteps

    seen = []

    class Recording(DistributedSteps):
        def start_capture(self):
            seen.append("start_capture")
            super().start_capture()

    monkeypatch.setattr(hooks, "distributed", Recording())
    x = T(3, seed=3)
    with specularch.config.patch(profile_calls=0):
        opt = specularch.optimize(bump)
        global COUNT
        COUNT = 0
        expected = [bump(x, 1) for _ in range(5)]
        eager_count, COUNT = COUNT, 0
        assert_same(expected, [opt(x, 1) for _ in range(5)])
    assert COUNT == eager_count
    stats = specularch.explain(opt).stats
    assert stats.graph_hits >= 2
    assert seen == ["start_capture"] * stats.captures  # asked at captures, not at cache hits


def _imports(path: pathlib.Path) -> list[str]:
    """The absolute module names ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_the_dispatcher_does_not_import_distributed():
    files = sorted((PACKAGE / "dispatch").glob("*.py"))
    assert files
    for path in files:
        bad = [n for n in _imports(path) if n.startswith("specularch.distributed")]
        assert not bad, f"{path.name} imports {bad}: use the hook points in dispatch/hooks.py"


def test_no_module_outside_the_dispatcher_reads_its_private_registries():
    private = {"_STATES", "_OWNED", "_PER_INSTANCE", "_PER_CALL_SITE", "_WRAPPER"}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "dispatch" and path.parent.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text())
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and "dispatch" in (n.module or "") for a in n.names}
        assert not (attrs | imported) & private, f"{path} reads {(attrs | imported) & private}"


def test_frames_is_wired_into_the_layers_below_it():
    """frames/ sits above the dispatcher and the eager path; ``api.py`` wires them together so
    that neither imports frames/: the hook reaches the dispatcher, eager runs turn the hook on."""
    from specularch import eager_run, frames
    from specularch.frames import interceptor
    assert interceptor._dispatcher is dispatch.dispatch  # noqa: SLF001
    assert eager_run.FRAME_HOOK.active is frames.hook_active
    assert eager_run.FRAME_HOOK.auto_targeting is frames.auto_targeting

