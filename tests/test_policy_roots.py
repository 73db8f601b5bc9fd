"""The global switch's choice of roots (specularch/frames/policy.py): the outermost module call is
optimized whether its class is the user's or torch's (``nn.Sequential``, a bare
``nn.Linear``); modules called inside it, also through helper methods, are not separate
roots; modules called by torch's own code stay skipped. One ``forward`` code object is shared
by every instance of its class, so the same code is outermost at one call and nested at
another: the dispatcher decides per call."""
import contextlib
import copy
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from specularch import dispatch, frames
from specularch.frames import policy

# ---------------------------------------------------------------- the decision itself ----


class Probe(nn.Module):
    """Records, at each call, whether the policy sees it as the outermost module call."""

    def __init__(self, seen):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.seen = seen

    def forward(self, x):
        self.seen.append(policy.is_outermost_call(sys._getframe(1)))
        return self.fc(x)


class Holder(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.inner = Probe(seen)

    def forward(self, x):
        return self.inner(x)

    def forward_once(self, x):  # a helper method: inside forward it is still nested
        return self.inner(x)

    def twice(self, x):
        return self.forward_once(x), self.forward_once(x)


class ViaHelper(Holder):
    def forward(self, x):
        return self.twice(x)


class ViaFunction(Holder):
    def forward(self, x):
        return _call_it(self.inner, x)


class DirectForward(Holder):
    def forward(self, x):
        return self.inner.forward(x)


class NoGradForward(Probe):
    @torch.no_grad()  # a torch decorator between Module.__call__ and forward
    def forward(self, x):
        self.seen.append(policy.is_outermost_call(sys._getframe(2)))
        return self.fc(x)


def _call_it(module, x):
    return module(x)


@pytest.mark.parametrize("call, expected", [
    (lambda seen, x: Probe(seen)(x), [True]),
    (lambda seen, x: Probe(seen).forward(x), [True]),
    (lambda seen, x: NoGradForward(seen)(x), [True]),
    (lambda seen, x: Holder(seen)(x), [False]),
    (lambda seen, x: ViaHelper(seen)(x), [False, False]),
    (lambda seen, x: ViaFunction(seen)(x), [False]),
    (lambda seen, x: DirectForward(seen)(x), [False]),
    (lambda seen, x: nn.Sequential(Probe(seen))(x), [False]),
    # helper methods called from outside any module call: their module call is outermost
    (lambda seen, x: Holder(seen).twice(x), [True, True]),
    (lambda seen, x: _call_it(Probe(seen), x), [True]),
    # torch's wrappers are not module calls of their own: the model they wrap is outermost
    (lambda seen, x: nn.DataParallel(Probe(seen))(x), [True]),
], ids=["call", "direct-forward", "no-grad-forward", "nested", "helper-method",
        "helper-function", "nested-direct-forward", "in-sequential", "helper-from-outside",
        "function-from-outside", "data-parallel"])
def test_outermost_module_call(call, expected):
    seen = []
    call(seen, torch.randn(3, 2))
    assert seen == expected


# ------------------------------------------------------- the switch, in this process ----

def _switched(fn, *args):
    """``fn(*args)`` with the global switch's hook and policy on (in this thread only)."""
    frames.reset()  # a fresh region: no skip marks left by earlier tests
    frames.set_dispatcher(dispatch.dispatch)  # (test_frames leaves None behind)
    frames.set_auto_target(policy.choose)
    try:
        with frames.hook_active():
            return fn(*args)
    finally:
        frames.set_auto_target(None)


@pytest.fixture(autouse=True)
def _forget_targets():
    yield
    frames.set_auto_target(None)
    frames.reset()


def _roots():
    """``{qualname: calls}`` of the code objects the switch ran as roots."""
    return {s.target.name: s.stats.calls for s in dispatch.states().values() if s.stats.calls}


def _state(name):
    return next(s for s in dispatch.states().values()
                if s.target.name == name and s.stats.calls)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = Encoder()

    def forward_once(self, x):
        return self.net(x)

    def forward(self, a, b):
        return self.forward_once(a), self.forward_once(b)


CALLS = 6  # more than config.profile_calls: the last calls run the graph


def _inputs(n, *shape):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _siamese_steps(model, xs, ys):
    outs = [model(a, b) for a, b in zip(xs, ys)]
    sum((o1 - o2).square().sum() for o1, o2 in outs).backward()
    return outs, [p.grad for p in model.parameters()]


def test_helper_method_does_not_make_the_submodule_a_root():
    model = Siamese()
    twin = copy.deepcopy(model)
    xs, ys = _inputs(CALLS, 3, 4), _inputs(CALLS, 3, 4)
    expected, expected_grads = _siamese_steps(model, xs, ys)
    got, grads = _switched(_siamese_steps, twin, xs, ys)
    for (e1, e2), (g1, g2) in zip(expected, got):
        torch.testing.assert_close(g1, e1, rtol=0, atol=0)
        torch.testing.assert_close(g2, e2, rtol=0, atol=0)
    for e, g in zip(expected_grads, grads):
        torch.testing.assert_close(g, e)
    assert _roots() == {"Siamese.forward": CALLS}
    assert _state("Siamese.forward").stats.graph_hits > 0


class WithSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])
        self.named = nn.ModuleDict({"out": nn.Linear(2, 2)})

    def forward(self, x):
        h = self.body(x)
        return self.named["out"](sum(head(h) for head in self.heads))


@pytest.mark.parametrize("bare_first", [False, True], ids=["user-model-first", "bare-first"])
@pytest.mark.parametrize("bare", ["sequential", "linear"])
def test_torch_class_is_a_root_outermost_and_inlined_nested(bare, bare_first):
    """The same torch forward code (Sequential's, Linear's) serves a bare model called from
    the program and the layers nested in a user model; in either order the bare model is a
    root of its own and the nested ones are not."""
    model = WithSequential()
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU()) if bare == "sequential" else nn.Linear(4, 4)
    xs = _inputs(CALLS, 3, 4)
    order = [other, model] if bare_first else [model, other]
    expected = [[m(x) for x in xs] for m in order]
    got = _switched(lambda: [[m(x) for x in xs] for m in order])
    for e, g in zip(expected, got):
        for ei, gi in zip(e, g):
            torch.testing.assert_close(gi, ei, rtol=0, atol=0)
    bare_name = type(other).__qualname__ + ".forward"
    assert _roots() == {"WithSequential.forward": CALLS, bare_name: CALLS}
    assert _state(bare_name).stats.graph_hits > 0
    assert _state("WithSequential.forward").stats.graph_hits > 0


def test_torch_internal_module_calls_stay_skipped():
    """nn.TransformerEncoder called from the program is the root; its layers, attention and
    Linears, called by torch's own code, are neither roots nor intercepted."""
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
    xs = _inputs(CALLS, 2, 3, 8)
    expected = [model(x) for x in xs]
    got = _switched(lambda: [model(x) for x in xs])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)
    assert _roots() == {"TransformerEncoder.forward": CALLS}
    targets = {t.name for t in frames.interceptor._by_code.values()}
    assert targets == {"TransformerEncoder.forward"}


def test_parameter_free_torch_module_alone_is_not_a_root():
    """A loss or activation module called from the program is one op: not worth a graph."""
    loss = nn.MSELoss()
    xs = _inputs(3, 4)
    _switched(lambda: [loss(x, x + 1) for x in xs])
    assert _roots() == {}


# ------------------------------------------------------ python -m specularch explain ----

SCRIPTS = {
    "sequential": """
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        run = lambda x: model(x)
    """,
    "linear": """
        model = nn.Linear(8, 2)
        run = lambda x: model(x)
    """,
    "siamese": """
        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                return torch.relu(self.fc(x))

        class Siamese(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = Encoder()

            def forward_once(self, x):
                return self.net(x)

            def forward(self, a, b):
                return self.forward_once(a) - self.forward_once(b)

        model = Siamese()
        run = lambda x: model(x, x.flip(0))
    """,
}
MAIN = """
    for i in range(8):
        out = run(torch.randn(4, 8))
    print(out.sum().item())
"""
ROOT_NAMES = {"sequential": "Sequential.forward", "linear": "Linear.forward",
              "siamese": "Siamese.forward"}


def _eager_stdout(source: str) -> str:
    """What the script prints run as it is (in this process: saves starting one)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, "prog.py", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_cli_explain_reports_the_outermost_module(tmp_path, kind):
    source = ("import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
              + textwrap.dedent(SCRIPTS[kind]) + textwrap.dedent(MAIN))
    script = tmp_path / "prog.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULARCH")}
    out = subprocess.run([sys.executable, "-m", "specularch", "explain", str(script)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    reports = [line for line in out.stderr.splitlines() if line.startswith("specularch report")]
    assert reports == [f"specularch report for {ROOT_NAMES[kind]}"], out.stderr
    assert "graphs: 1" in out.stderr and "fallbacks: 0" in out.stderr, out.stderr
    assert out.stdout == _eager_stdout(source)
