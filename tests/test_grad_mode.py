"""Grad mode inside optimized functions: ``with torch.set_grad_enabled(flag):`` (an argument,
``self.training``, a global; the ``torch.autograd`` alias; as a decorator), a bare
``torch.set_grad_enabled(b)`` call, ``torch.is_grad_enabled()``, ``torch.inference_mode()``
(inference tensors returned, stored, aliased, misused afterwards; a caller in inference mode)
and ``Tensor.requires_grad_()``. Each is compared with eager: values, gradients,
``requires_grad``, ``is_inference()``, grad mode after the call and the heap."""
import pytest
import torch
from torch import nn

import specularch
from differential import A, T, check, check_module, expect_graph

pytestmark = pytest.mark.usefixtures("no_profiling")

TRAIN_GRAD = True


# ------------------------------------------------------------------ set_grad_enabled

def grad_by_argument(x, w, flag):
    with torch.set_grad_enabled(flag):
        frozen = x * w
        inside = torch.is_grad_enabled()
    return frozen + x * w, frozen.requires_grad, inside, torch.is_grad_enabled()


def grad_by_global(x, w):
    with torch.autograd.set_grad_enabled(TRAIN_GRAD):
        y = (x * w).sin()
    return y + w, y.requires_grad


def constructed_before_the_block(x, w):
    ctx = torch.set_grad_enabled(False)  # switches at once, like eager
    a = x * w
    with ctx:
        b = x * w
    return a + b + x * w, a.requires_grad, b.requires_grad


def bare_calls_that_restore(x, w):
    torch.set_grad_enabled(False)
    a = x * w
    torch.set_grad_enabled(True)
    return a + x * w, a.requires_grad


@torch.set_grad_enabled(False)
def _frozen(x, w):
    return x * w


def set_grad_enabled_decorator(x, w):
    a = _frozen(x, w)
    return a + x * w, a.requires_grad


@pytest.mark.parametrize("fn, make_args, calls", [
    (grad_by_argument, lambda i: A(T(3), T(3, requires_grad=True), [False, True, False, True][i]), 4),
    (grad_by_global, lambda: A(T(3), T(3, requires_grad=True)), 3),
    (constructed_before_the_block, lambda: A(T(3), T(3, requires_grad=True)), 3),
    (bare_calls_that_restore, lambda: A(T(3), T(3, requires_grad=True)), 3),
    (set_grad_enabled_decorator, lambda: A(T(3), T(3, requires_grad=True)), 3),
], ids=["argument", "global_alias", "constructed_before", "bare_pair", "decorator"])
def test_set_grad_enabled_is_captured(fn, make_args, calls):
    explanation = check(fn, make_args, calls=calls, grad=True, expect="graph")
    if fn is grad_by_argument:  # one graph per flag value, then hits
        assert len(explanation.graphs) == 2 and explanation.stats.graph_hits == 2


def test_set_grad_enabled_by_a_changed_global_recaptures():
    global TRAIN_GRAD
    try:
        for flag in (True, False, True):
            TRAIN_GRAD = flag
            check(grad_by_global, lambda: A(T(3), T(3, requires_grad=True)), calls=2, grad=True,
                  expect="graph")
    finally:
        TRAIN_GRAD = True


class Switch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        with torch.set_grad_enabled(self.training):
            h = self.fc(x).relu()
        return h * 2, h.requires_grad


def test_set_grad_enabled_by_self_training():
    check_module(Switch, lambda: A(T(2, 4)), calls=4, expect="graph",
                 between=lambda m, i: m.train(i % 2 == 0))


def bare_call_left_off(x, w):
    torch.set_grad_enabled(False)  # changes grad mode for the caller too
    return x * w


def test_bare_set_grad_enabled_that_outlives_the_call_falls_back():
    """The harness compares grad mode after the call: eager leaves it off."""
    check(bare_call_left_off, lambda: A(T(3), T(3, requires_grad=True)), expect="fallback",
          fallback_kind="unsupported_call")
    # the same call whose mode is restored before returning is a graph
    check(bare_calls_that_restore, lambda: A(T(3), T(3, requires_grad=True)), grad=True,
          expect="graph")


# ------------------------------------------------------------------ inference_mode

def _inference_flags(value):
    if isinstance(value, torch.Tensor):
        return [value.is_inference()]
    if isinstance(value, (tuple, list)):
        return [f for v in value for f in _inference_flags(v)]
    return []


def _check_inference(fn, make_args, **kw):
    """check() plus is_inference() of every returned tensor (the harness does not compare it)."""
    explanation = check(fn, make_args, **kw)
    if kw.get("expect") == "fallback":
        return None, None, explanation  # eager ran (or raised) for both; compared by check()
    torch.manual_seed(7)
    args, _ = make_args()
    eager = fn(*args)
    opt = specularch.optimize(fn)(*args)
    assert _inference_flags(eager) == _inference_flags(opt)
    return eager, opt, explanation


def inference_block(x, w):
    with torch.inference_mode():
        y = (x @ w).relu()
        row = y[0]             # a view of an inference tensor: an inference tensor too
        inside = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    z = y * 2                  # a normal tensor again
    return y, row, z, z + x @ w, inside, torch.is_inference_mode_enabled()


def inference_mode_false(x, w):
    with torch.no_grad():
        with torch.inference_mode(False):  # enables grad, like enable_grad()
            y = x @ w
    return y, y.requires_grad


@torch.inference_mode()
def _infer(x, w):
    return (x @ w).tanh()


def inference_decorator(x, w):
    y = _infer(x, w)
    return y, y.sum(), y.requires_grad


def test_inference_mode_results_are_inference_tensors_like_eager():
    eager, opt, _ = _check_inference(inference_block, lambda: A(T(2, 3), T(3, 3, requires_grad=True)),
                                     grad=True, expect="graph")
    assert _inference_flags(opt)[:4] == [True, True, False, False]
    assert opt[1].untyped_storage().data_ptr() == opt[0].untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        opt[0].add_(1)  # as with eager's


@pytest.mark.parametrize("fn", [inference_mode_false, inference_decorator])
def test_inference_mode_variants(fn):
    _check_inference(fn, lambda: A(T(2, 3), T(3, 3, requires_grad=True)), expect="graph",
                     grad=fn is inference_mode_false)


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.last = None

    def forward(self, x):
        with torch.inference_mode():
            y = self.fc(x)
            self.last = y
        return y


def test_inference_tensor_stored_on_self_is_one_inference_tensor():
    check_module(Cached, lambda: A(T(2, 3)), expect="graph")
    m = specularch.optimize(Cached())
    y = m(T(2, 3))
    assert y.is_inference() and m.last is y


class NormalizedUnderInference(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        with torch.inference_mode():
            return self.bn(x)  # in train mode: updates the running stats in the block


def test_running_stats_updated_inside_inference_mode_are_updated_once():
    """Inside inference mode torch hands ``aten::batch_norm`` to the write check whole, and it
    does not declare its writes: the capture updated the real running stats, then the
    commit again (twice the momentum step)."""
    check_module(NormalizedUnderInference, lambda: A(T(4, 3)), calls=4, expect="graph")
    m = NormalizedUnderInference()
    opt = specularch.optimize(NormalizedUnderInference())
    opt.load_state_dict(m.state_dict())
    for _ in range(2):
        x = T(4, 3)
        with torch.inference_mode():
            assert torch.equal(m(x), opt(x))
        assert torch.equal(m.bn.running_mean, opt.bn.running_mean)


def inference_then_autograd(x, w):
    with torch.inference_mode():
        y = x * 2
    return (y * w).sum()  # eager: inference tensors cannot be saved for backward


def inference_view_of_input_escapes(x):
    with torch.inference_mode():
        v = x[0]  # a normal tensor's view: eager marks it, the graph could not
    return v


def enable_grad_inside_inference(x, w):
    with torch.inference_mode():
        with torch.enable_grad():
            y = x * w
    return y, y.requires_grad


@pytest.mark.parametrize("fn, make_args, kind", [
    (inference_then_autograd, lambda: A(T(3), T(3, requires_grad=True)), "exception_handling"),
    (inference_view_of_input_escapes, lambda: A(T(2, 3)), "unsupported_call"),
    (enable_grad_inside_inference, lambda: A(T(3), T(3, requires_grad=True)), "unsupported_call"),
], ids=["saved_for_backward", "view_of_input", "enable_grad_inside"])
def test_inference_mode_cases_eager_treats_differently_fall_back(fn, make_args, kind):
    _check_inference(fn, make_args, expect="fallback", fallback_kind=kind)
    # while the plain block around them is captured
    _check_inference(inference_block, lambda: A(T(2, 3), T(3, 3)), expect="graph")


def views_after_the_block(x, w):
    with torch.inference_mode():
        y = x @ w
    same = y.contiguous()  # `y` itself
    return y[0], y.t(), y.detach(), same, same is y


def test_views_of_block_tensors_taken_after_the_block_are_inference_tensors():
    """Eager's views of an inference tensor are inference tensors wherever they are taken;
    they were handed out as normal tensors (and `y.contiguous()` as a second object)."""
    eager, opt, _ = _check_inference(views_after_the_block,
                                     lambda: A(T(2, 3), T(3, 3, requires_grad=True)),
                                     expect="graph")
    assert _inference_flags(opt) == _inference_flags(eager) == [True] * 4
    assert opt[4] is True and opt[3].data_ptr() == opt[0].data_ptr()


def block_view_of_argument(x):
    with torch.inference_mode():
        y = x[0]  # an inference tensor exactly when x is one
    return y


def test_inference_flag_of_arguments_is_guarded():
    """A graph captured with an inference tensor argument handed out inference tensors for
    normal arguments too (the argument's flag was not guarded)."""
    opt = specularch.optimize(block_view_of_argument)
    with torch.inference_mode():
        inference_x = T(2, 3)
    for x in (inference_x, T(2, 3), inference_x, T(2, 3)):
        assert opt(x).is_inference() is block_view_of_argument(x).is_inference() is x.is_inference()


def leaf_made_in_the_block(x):
    with torch.inference_mode():
        y = torch.ones(3, requires_grad=True)
        z = (x * 2).requires_grad_()
    return y, z


def test_tensors_made_requiring_grad_in_the_block_fall_back():
    """Eager's are inference tensors that require grad; the graph's lost the flag."""
    check(leaf_made_in_the_block, lambda: A(T(3)), expect="fallback",
          fallback_kind="unsupported_call")


def global_state(x):
    return x * 2, torch.is_inference_mode_enabled(), torch.is_grad_enabled()


def test_caller_grad_and_inference_mode_are_guarded():
    """Read inside the function, ``torch.is_grad_enabled()`` and
    ``torch.is_inference_mode_enabled()`` are the caller's: a graph captured in the caller's
    inference mode is not used under no_grad (same grad mode, but eager's results are normal
    tensors there and the flag reads False)."""
    opt = specularch.optimize(global_state)
    x = T(3)
    modes = (torch.inference_mode, torch.no_grad, torch.enable_grad) * 2
    for mode in modes:
        with mode():
            out, inference, grad = opt(x)
            expected = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        assert (inference, grad) == expected and out.is_inference() is expected[0]
    explanation = specularch.explain(opt)
    expect_graph(explanation)
    assert len(explanation.graphs) == 3 and explanation.stats.graph_hits == 3


# ------------------------------------------------------------------ requires_grad_

def fresh_leaf(x):
    y = (x * 2).detach()
    y.requires_grad_()
    z = torch.zeros(3).requires_grad_(True).requires_grad_(False)
    return y, (y * x).sum(), y.is_leaf, z, z.requires_grad


def test_requires_grad_on_a_fresh_tensor_is_captured():
    check(fresh_leaf, lambda: A(T(3)), expect="graph")
    opt = specularch.optimize(fresh_leaf)
    x = T(3)
    for fn in (fresh_leaf, opt, opt):
        y, loss, *_ = fn(x)
        loss.backward()
        assert torch.equal(y.grad, x)


def requires_grad_on_argument(x, w):
    x.requires_grad_()
    return x * w


def test_requires_grad_on_an_argument():
    """Changing a caller's tensor's flag runs eagerly (the harness compares the flag after
    the call); leaving it as it is is captured."""
    check(requires_grad_on_argument, lambda: A(T(3), T(3)), expect="fallback",
          fallback_kind="unsupported_call")
    check(requires_grad_on_argument, lambda: A(T(3, requires_grad=True), T(3)), grad=True,
          expect="graph")


def test_requires_grad_on_a_fresh_tensor_runs_with_fx_under_a_compiling_backend():
    """AOT autograd cannot keep a leaf made inside the graph: the backend gives it to fx."""
    explanation = check(fresh_leaf, lambda: A(T(3)), expect="graph", backend="torchscript")
    assert [g.backend for g in explanation.graphs] == ["fx"]
    assert "requires_grad_()" in explanation.graphs[0].note
