"""Forward graphs whose results need autograd, compiled as their forward and backward
(``fx_lower/_torch_joint.py``, ``fx_lower/split.py``) and glued as one autograd node
(``fx_lower/glue.py``), differential against eager: outputs, which outputs carry a gradient,
every input's gradient; views of inputs, outputs and intermediates made again from their bases;
the refusals (inputs updated in place, a view of an aliased output); and in the
tiered mode, such a graph compiled in the worker process (not on a thread beside the
program's steps), one AOT autograd must wrap compiled on the thread saying why."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch import tiering
from specularch.fx_lower import _torch_joint as joint
from specularch.fx_lower._torch_compilers import torchscript_without_autograd
from specularch.fx_lower.glue import Glued, Replay
from specularch.fx_lower.passes import example_inputs
from specularch.tiering import policy

from differential import assert_same

pytestmark = pytest.mark.usefixtures("no_profiling")


def _glued(fn, inputs, min_cut=False, replay=True, random=False):
    gm = torch.fx.symbolic_trace(fn)
    parts = joint.split(gm, inputs, min_cut=min_cut)
    compiled = [torchscript_without_autograd(g, example_inputs(g)) for g in (parts.forward, parts.backward)]
    return Glued(*compiled, parts.meta, Replay(replay if callable(replay) else gm.forward, random) if replay else None)


def _leaves(*shapes, grad=(True,)):
    torch.manual_seed(0)
    return [torch.randn(*s).requires_grad_(g) for s, g in zip(shapes, grad * len(shapes))]


def _compare(fn, inputs, backward, min_cut=False):
    """``fn`` and its glued form on copies of ``inputs``: outputs, requires_grad, gradients."""
    glued = _glued(fn, inputs, min_cut)
    copies = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    expected, got = fn(*inputs), glued(*copies)
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert_same(a, b, rtol=1e-5, atol=1e-6)
        assert a.requires_grad == b.requires_grad and a.dtype == b.dtype
    backward(expected)
    backward(got)
    for x, y in zip(inputs, copies):
        assert (x.grad is None) == (y.grad is None)
        if x.grad is not None:
            assert_same(x.grad, y.grad, rtol=1e-5, atol=1e-6)


def _mlp(w1, b1, w2, b2, x):
    return (F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2),)


@pytest.mark.parametrize("min_cut", [False, True])
def test_mlp_gradients_match_eager_through_an_expanded_gradient(min_cut):
    inputs = _leaves((32, 16), (32,), (4, 32), (4,), (8, 16), grad=(True, True, True, True, False))
    # sum().backward() hands the output an expanded gradient (strides 0): laid out as traced
    _compare(_mlp, inputs, lambda out: out[0].sum().backward(), min_cut)


def _several(w, x):
    h = torch.tanh(x @ w)
    return h, h.argmax(1), (x * 2).sum(1), h.sum(0), h.detach() * 3


def test_outputs_without_gradient_and_unused_outputs_match_eager():
    """An integer output, one from inputs that need no gradient, a detached one (none carries
    a gradient), and a differentiable output the loss does not use (its gradient is zeros)."""
    inputs = _leaves((6, 5), (4, 6), grad=(True, False))
    _compare(_several, inputs, lambda out: (out[0] * 2).sum().backward())


def test_backward_keeps_eager_in_place_check():
    """A saved input changed in place before the backward raises as in eager."""
    inputs = _leaves((32, 16), (32,), (4, 32), (4,), (8, 16), grad=(True, True, True, True, False))
    glued = _glued(_mlp, inputs)
    out = glued(*inputs)[0]
    with torch.no_grad():
        inputs[4].add_(1)  # x: saved for the first layer's weight gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _penalty(fn, inputs):
    """A gradient penalty: the output's gradient w.r.t. ``x`` (``create_graph``), squared,
    differentiated w.r.t. the weights."""
    out = fn(*inputs)[0]
    (gx,) = torch.autograd.grad(out.sum(), [inputs[4]], create_graph=True)
    (gx ** 2).sum().backward()


def _tanh_layer(w, b, x):
    return (torch.tanh(F.linear(x, w, b)),)


def test_an_output_the_backward_reads_changed_in_place_raises_as_in_eager():
    """``tanh``'s backward reads its output: changed by the program before the backward,
    eager raises; the glue saves that output itself (not the copy the compiled form makes
    of a tensor it returns twice), so it raises too."""
    inputs = _leaves((3, 4), (3,), (2, 4), grad=(True, True, False))
    for fn in (_tanh_layer, _glued(_tanh_layer, inputs)):
        (out,) = fn(*inputs)
        out.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_an_output_the_backward_reads_is_returned_once_by_the_forward_part():
    """The forward part does not return ``tanh``'s output a second time as a saved tensor
    (its compiled form would copy it every call, and the glue would not use the copy): the
    glue puts the output in, and the backward still gets what eager's gets."""
    inputs = _leaves((3, 4), (3,), (2, 4), grad=(True, True, False))
    parts = joint.split(torch.fx.symbolic_trace(_tanh_layer), inputs, min_cut=False)
    returned = [joint._undetached(v) for v in
                next(n for n in parts.forward.graph.nodes if n.op == "output").args[0]]
    assert len(returned) == len(set(returned)) and parts.meta["saved_outputs"]
    _compare(_tanh_layer, inputs, lambda out: (out[0] ** 2).sum().backward())


def test_double_backward_runs_the_graph_again_and_matches_eager():
    inputs = _leaves((32, 16), (32,), (4, 32), (4,), (8, 16))
    glued = _glued(_mlp, inputs)
    copies = [x.detach().clone().requires_grad_() for x in inputs]
    _penalty(_mlp, inputs)
    _penalty(glued, copies)
    for x, y in zip(inputs, copies):
        assert_same(x.grad, y.grad, rtol=1e-5, atol=1e-6)


def test_double_backward_without_a_replay_says_what_to_do():
    inputs = _leaves((32, 16), (32,), (4, 32), (4,), (8, 16))
    with pytest.raises(RuntimeError, match='backend="fx"'):
        _penalty(_glued(_mlp, inputs, replay=False), inputs)


def _dropped(w1, b1, w2, b2, x):
    return (F.linear(F.dropout(torch.tanh(F.linear(x, w1, b1)), 0.5), w2, b2),)


def test_double_backward_of_a_graph_drawing_random_numbers_replays_the_forward_s_draws():
    """Dropout and a gradient penalty: the replay runs from the generator state the forward
    started with, so its mask is the forward's (gradients match eager's), and the program's
    generator is left where eager's is."""
    inputs = _leaves((32, 16), (32,), (4, 32), (4,), (8, 16))
    glued = _glued(_dropped, inputs, random=True)
    copies = [x.detach().clone().requires_grad_() for x in inputs]
    for fn, xs in ((_dropped, inputs), (glued, copies)):
        torch.manual_seed(7)
        _penalty(fn, xs)
        xs.append(torch.rand(3))  # (where the program's generator is afterwards)
    assert torch.equal(inputs[-1], copies[-1])
    for x, y in zip(inputs[:-1], copies[:-1]):
        assert_same(x.grad, y.grad, rtol=1e-5, atol=1e-6)


def test_a_replay_drawing_other_numbers_than_the_forward_raises():
    def draws_more(*args):
        torch.rand(1)
        return _dropped(*args)
    inputs = _leaves((32, 16), (32,), (4, 32), (4,), (8, 16))
    glued = _glued(_dropped, inputs, replay=draws_more, random=True)
    with pytest.raises(RuntimeError, match="did not draw the random numbers its compiled forward drew"):
        _penalty(glued, inputs)


def _batch_norm(x, w, b, mean, var):
    return (F.batch_norm(x, mean, var, w, b, training=True),)


def _views_of_intermediate(w, x):
    h = torch.tanh(x @ w)
    return (h[:, 0], h[:, 1])  # (views of a value no output returns)


def _view_of_an_aliased_output(w, x):
    h = torch.tanh(x @ w)
    first = h[:, 0]
    return (first, first.detach(), h[:, 1])  # (the second a view of the first, itself a view)


def _views(w, x):
    h = torch.tanh(x @ w)
    return (h, h[:, 1:], w.t(), x.t(), w.detach())  # (views of an output, of inputs)


@pytest.mark.parametrize("min_cut", [False, True])
def test_outputs_that_are_views_alias_what_eager_s_alias_and_match_its_gradients(min_cut):
    inputs = _leaves((3, 3), (2, 3), grad=(True, False))
    _compare(_views, inputs, lambda out: (out[0].sum() + 2 * out[1].sum() + out[2].pow(2).sum()).backward(),
             min_cut)
    got = _glued(_views, inputs, min_cut)(*inputs)
    same = [a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            for a, b in ((got[1], got[0]), (got[2], inputs[0]), (got[3], inputs[1]), (got[4], inputs[0]))]
    assert same == [True] * 4 and [t.requires_grad for t in got] == [True, True, True, False, False]
    assert got[1].data_ptr() == got[0].data_ptr() + got[0].element_size()  # (h[:, 1:])
    got[0].detach().mul_(0)  # (eager's aliasing: the view sees a write to its base)
    assert not got[1].any()


def test_a_graph_updating_an_input_in_place_is_refused():
    """AOT autograd's wrappers would copy the update back into the input: refused."""
    inputs = _leaves((4, 3), (3,), (3,), (3,), (3,), grad=(True, True, True, False, False))
    with pytest.raises(joint.NotSplit, match="updates an input in place"):
        joint.split(torch.fx.symbolic_trace(_batch_norm), inputs, min_cut=False)


@pytest.mark.parametrize("min_cut", [False, True])
@pytest.mark.parametrize("fn", [_views_of_intermediate, _view_of_an_aliased_output])
def test_views_of_an_intermediate_no_output_returns_are_made_from_it_and_match_eager(fn, min_cut):
    """AOT autograd's *intermediate bases*: the forward returns ``h`` after the outputs, the
    glue makes ``h[:, 0]`` and ``h[:, 1]`` from it (one storage, as eager's; a ``detach()``
    of the first from the first) and drops it; gradients flow through it, also under
    ``create_graph`` (the replay finds ``h`` as the views' base)."""
    inputs = _leaves((3, 3), (2, 3), grad=(True, False))
    _compare(fn, inputs, lambda out: (out[0].pow(2).sum() + 3 * out[-1].sum()).backward(), min_cut)
    glued = _glued(fn, inputs, min_cut)
    got = glued(*inputs)
    assert glued.bases == 1 and [t.requires_grad for t in got] == [t.requires_grad for t in fn(*inputs)]
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1
    assert got[-1].data_ptr() == got[0].data_ptr() + got[0].element_size()
    assert got[0]._base is not None and got[0]._base is got[-1]._base and got[0]._base.shape == (2, 3)
    leaves = _leaves((3, 3), (2, 3))
    copies = [x.detach().clone().requires_grad_() for x in leaves]
    glued = _glued(fn, leaves, min_cut)  # (x requires grad too)
    for call, xs in ((fn, leaves), (glued, copies)):
        first, second = call(*xs)[0], call(*xs)[-1]
        (gx,) = torch.autograd.grad((first * second).sum(), [xs[1]], create_graph=True)
        gx.pow(2).sum().backward()
    assert_same(leaves[0].grad, copies[0].grad, rtol=1e-5, atol=1e-6)


def _twins(make_model):
    """``make_model()`` and an eager twin with its state, the model optimized, an Adam for
    each (the twin's first)."""
    torch.manual_seed(0)
    model, twin = make_model(), make_model()
    twin.load_state_dict(model.state_dict())
    opt = specularch.optimize(model)
    return model, twin, opt, [torch.optim.Adam(m.parameters(), lr=0.01) for m in (twin, model)]


def _step_both(model, twin, opt, adams, steps, loss):
    """``steps`` Adam steps of the eager ``twin`` and of ``opt`` on ``loss(net, step)``, every
    parameter compared after each; the graph's one candidate (TorchScript) kept, compiled
    in the worker process."""
    for step in range(steps):
        for net, adam in ((twin, adams[0]), (opt, adams[1])):
            adam.zero_grad()
            loss(net, step).backward()
            adam.step()
        for p, q in zip(twin.parameters(), model.parameters()):
            assert_same(p, q, rtol=1e-4, atol=1e-6)
        tiering.wait(timeout=120)
    graph = specularch.explain(opt).graphs[-1]
    (event,) = graph.tier.events
    assert (event.decision, event.compiled_in, graph.backend) == ("kept", "worker process", "torchscript"), event


def _train_both(make_model, batches, rounds, rtol):
    model, twin, opt, adams = _twins(make_model)
    for _ in range(rounds):
        for x, y in batches:
            for m, call, adam in ((twin, twin, adams[0]), (model, opt, adams[1])):
                adam.zero_grad()
                F.mse_loss(call(x), y).backward()
                adam.step()
            for (name, p), q in zip(twin.state_dict().items(), model.state_dict().values()):
                assert_same(p, q, f"{name}", rtol=rtol, atol=rtol * 1e-2)
        tiering.wait(timeout=120)
    return opt


def _small_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("backend", ["torchscript", pytest.param("inductor", marks=pytest.mark.slow)])
def test_forward_graph_compiles_in_the_worker_process_as_forward_and_backward(hot_at_once, monkeypatch, backend):
    hot_at_once(backend)
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)  # keep it
    torch.manual_seed(1)
    batches = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(3)]
    opt = _train_both(_small_mlp, batches, 20, rtol=1e-4)
    graph = specularch.explain(opt).graphs[-1]
    (event,) = graph.tier.events
    assert (event.candidate, event.decision, event.compiled_in) == (backend, "kept", "worker process")
    assert graph.backend == backend


class _Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 2), nn.BatchNorm1d(2)

    def forward(self, x):
        return self.norm(self.fc(x))


def test_batch_norm_forward_graph_compiles_in_the_worker_process(hot_at_once, monkeypatch):
    """BatchNorm's graph returns its running statistics updated in place (on fresh copies),
    and ``num_batches_tracked`` as it came in (the commit advances it): the glue returns that
    input itself, the graph compiles in the worker, and the buffers follow eager's."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(1)
    batches = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(3)]
    opt = _train_both(_Normed, batches, 20, rtol=1e-4)
    (event,) = specularch.explain(opt).graphs[-1].tier.events
    assert (event.decision, event.compiled_in) == ("kept", "worker process"), event
    assert opt.norm.num_batches_tracked.item() == 60  # (every buffer compared with eager's)


def test_a_second_run_loads_both_parts_from_the_compile_cache(hot_at_once, monkeypatch, cache_dir):
    """The worker saves the forward and the backward under the graph's key (``.forward``,
    ``.backward``; the glue in the forward's metadata): a second run (specularch reset, same
    cache) loads them without a worker, and trains as eager does."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(1)
    batches = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(3)]
    wheres = []
    for _ in range(2):
        specularch.reset()
        opt = _train_both(_small_mlp, batches, 20, rtol=1e-4)
        (event,) = specularch.explain(opt).graphs[-1].tier.events
        assert event.decision == "kept", event
        wheres.append(event.compiled_in)
    assert wheres == ["worker process", "from the compile cache"]
    saved = sorted(p.name.split(".", 1)[1] for p in (cache_dir / "torchscript").iterdir())
    assert saved == ["backward.pt", "forward.pt"], saved


def _penalised_both(twin, model, opt, x, rtol, atol, seed=None):
    """One loss with a gradient penalty (``create_graph``) on the eager ``twin`` and on
    ``opt`` (the optimized ``model``), each from generator seed ``seed`` where given;
    their parameters' gradients compared."""
    for net in (twin, opt):
        if seed is not None:
            torch.manual_seed(seed)
        net.zero_grad()
        x_ = x.clone().requires_grad_()
        out = net(x_)
        (gx,) = torch.autograd.grad(out.sum(), [x_], create_graph=True)
        (out.pow(2).mean() + gx.pow(2).sum()).backward()
    for p, q in zip(twin.parameters(), model.parameters()):
        assert_same(p.grad, q.grad, rtol=rtol, atol=atol)


def test_gradient_penalty_through_a_promoted_forward_matches_eager(hot_at_once, monkeypatch):
    """``create_graph=True`` on a forward graph promoted to its glued form: the backward runs
    the captured graph's fx code again (``split.replay_of``) and matches eager's double
    backward."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(0)
    model, twin = _small_mlp(), _small_mlp()
    twin.load_state_dict(model.state_dict())
    opt = specularch.optimize(model)
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) for _ in range(3)]
    for _ in range(15):
        for x in xs:
            _penalised_both(twin, model, opt, x, rtol=1e-4, atol=1e-6)
        tiering.wait(timeout=120)
    graph = specularch.explain(opt).graphs[-1]
    assert graph.backend == "torchscript" and graph.tier.events[0].compiled_in == "worker process"


def _decoder(w, b, x):
    return (F.linear(x, w, b),)  # on a 3-d input: an ``_unsafe_view`` of the matmul's result


def test_an_unsafe_view_output_is_split_and_matches_eager():
    """AOT autograd calls ``linear``'s result on a 3-d input an alias (``unsafe_view_alias``)
    and treats it as a plain output: so does the split (an LSTM LM's decoder was refused)."""
    inputs = _leaves((5, 4), (5,), (3, 2, 4), grad=(True, True, False))
    _compare(_decoder, inputs, lambda out: out[0].pow(2).sum().backward())


def test_a_pinned_backend_compiles_a_forward_graph_split_and_differentiates_it_twice():
    """``backend="torchscript"`` pinned: the forward graph's parts compiled in the call and
    glued (AOT autograd's form raised under ``create_graph``), matching eager's gradients
    and double backward."""
    from specularch.api import _state_of
    torch.manual_seed(0)
    model, twin = _small_mlp(), _small_mlp()
    twin.load_state_dict(model.state_dict())
    opt = specularch.optimize(model, backend="torchscript")
    torch.manual_seed(1)
    for _ in range(4):
        _penalised_both(twin, model, opt, torch.randn(4, 8), rtol=1e-5, atol=1e-7)
    (entry,) = _state_of(opt).entries
    assert entry.backend == "torchscript" and isinstance(entry.graph_fn, Glued)


class _Tempered(nn.Module):
    """A forward taking a Python number that varies from call to call (a temperature): it
    becomes a graph input (``guards/relax.py``) that only feeds arithmetic."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x, temperature):
        return torch.tanh(self.fc(x)) / temperature


class _Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.out = nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.fc(x))))


def test_gradient_penalty_through_a_promoted_forward_drawing_random_numbers_matches_eager(
        hot_at_once, monkeypatch):
    """The default mode with dropout and a gradient penalty: once TorchScript's form is
    kept, ``create_graph`` replays the graph from the call's generator state (it raised
    "cannot be differentiated twice" before: a program that runs eagerly broke once tiered)."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    model, twin, opt, _ = _twins(_Dropped)
    x = torch.randn(4, 8)
    for step in range(30):
        _penalised_both(twin, model, opt, x, rtol=1e-5, atol=1e-7, seed=step)
        tiering.wait(timeout=120)
    graph = specularch.explain(opt).graphs[-1]
    assert graph.backend == "torchscript" and graph.tier.events[0].decision == "kept", graph.tier


def test_a_number_input_is_a_tensor_to_the_split_and_compiles_in_the_worker(hot_at_once, monkeypatch):
    """The number becomes a 0-d tensor input of both parts (not a constant: each call's value
    is used), so the graph compiles in the worker; parameters follow eager's, and a gradient
    penalty (the replay, on the call's number) matches eager's."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    model, twin, opt, adams = _twins(_Tempered)
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    _step_both(model, twin, opt, adams, 40,
               lambda net, step: F.mse_loss(net(x, 1.0 + 0.25 * (step % 5)), y))
    for net in (twin, opt):
        net.zero_grad()
        x_ = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(net(x_, 1.75).sum(), [x_], create_graph=True)
        gx.pow(2).sum().backward()
    for p, q in zip(twin.parameters(), model.parameters()):
        assert_same(p.grad, q.grad, rtol=1e-4, atol=1e-6)


class _AliasOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        h = self.fc(x)
        return h[:, 0], h[:, 1]  # (views of a value no output returns)


class _AliasOfAlias(_AliasOut):
    def forward(self, x):
        h = self.fc(x)
        first = h[:, 0]
        return first, first.detach(), h[:, 1]  # (the second a view of the first, itself a view)


def _pinned_twins(make_model, x, backend="torchscript"):
    """``make_model()`` pinned to ``backend`` beside an eager twin: three calls of each, a
    loss of the first and last outputs, their gradients compared; returns the optimized
    model's last graph entry and report."""
    from specularch.api import _state_of
    torch.manual_seed(0)
    model, twin = make_model(), make_model()
    twin.load_state_dict(model.state_dict())
    opt = specularch.optimize(model, backend=backend)
    for _ in range(3):
        seen = []
        for net in (twin, opt):
            net.zero_grad()
            out = net(x)
            (out[0].sum() + 2 * out[-1].sum()).backward()
            seen.append([getattr(t, "requires_grad", t) for t in out])  # (numbers: themselves)
        assert seen[0] == seen[1]
        for p, q in zip(twin.parameters(), model.parameters()):
            assert_same(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    return _state_of(opt).entries[-1], specularch.explain(opt).graphs[-1]


def test_a_pinned_backend_says_when_the_split_refuses_a_forward_graph(monkeypatch):
    """Pinned, a forward graph the split refuses compiles through AOT autograd's wrappers,
    and ``explain()`` says so and why; results and gradients still match eager."""
    from specularch.fx_lower import split

    def refuse(*args, **kwargs):
        raise joint.NotSplit("(the refusal)")
    monkeypatch.setattr(split, "split", refuse)
    entry, graph = _pinned_twins(_AliasOut, torch.randn(4, 8))
    assert graph.backend == "torchscript" and not isinstance(entry.graph_fn, Glued), graph.note
    assert graph.note == "AOT autograd's form, not split: (the refusal)", graph


@pytest.mark.parametrize("make_model", [_AliasOut, _AliasOfAlias])
def test_a_pinned_backend_splits_views_of_a_value_the_forward_does_not_return(make_model):
    """Before, the split refused these (AOT autograd's intermediate bases), and AOT
    autograd's own form of ``_AliasOfAlias`` raised ``IndexError`` at run time (fx ran it)."""
    entry, graph = _pinned_twins(make_model, torch.randn(4, 8))
    assert graph.backend == "torchscript" and isinstance(entry.graph_fn, Glued), graph.note


def test_a_forward_part_returning_another_dtype_than_capture_is_refused():
    """Where a number made a 0-d tensor would promote a result (values right, dtype not),
    the split refuses the graph (it then compiles through AOT autograd, which checks the
    dtypes on its first call)."""
    from specularch.fx_lower.split import same_output_dtypes
    inputs = _leaves((5, 4), (3, 4), grad=(True, False))
    gm = torch.fx.symbolic_trace(_decoder_no_bias)
    parts = joint.split(gm, inputs, min_cut=False)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    (result,) = output.args[0]
    result.meta["example"] = torch.zeros(3, 5, dtype=torch.float32)
    same_output_dtypes(gm, parts)  # (as captured: no error)
    result.meta["example"] = torch.zeros(3, 5, dtype=torch.float64)
    with pytest.raises(joint.NotSplit, match="changed output 0's dtype from torch.float64 to torch.float32"):
        same_output_dtypes(gm, parts)


def _decoder_no_bias(w, x):
    return (F.linear(x, w),)


class _Pooled(nn.Module):
    """Returns its hidden states and a view of them (the first position, as a pooled
    output), as many encoders do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        hidden = torch.tanh(self.fc(x))
        return hidden, hidden[:, 0]


@pytest.mark.parametrize("make_model", [_Pooled, _AliasOut])
def test_a_forward_returning_views_compiles_in_the_worker(hot_at_once, monkeypatch, make_model):
    """A view of another output (an encoder's pooled output), or two views of one
    intermediate (mean and log-variance sliced from one layer's output: AOT autograd's
    intermediate base travels as a third result of the forward part; it compiled through
    AOT autograd on the thread before): compiled in the worker, aliasing as eager's."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    model, twin, opt, adams = _twins(make_model)
    torch.manual_seed(1)
    x = torch.randn(4, 8)

    def loss(net, step):
        first, second = net(x)
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        return first.pow(2).mean() + second.exp().sum()
    _step_both(model, twin, opt, adams, 30, loss)


class _Counted(nn.Module):
    """Counts its calls on ``self`` and returns the count and ``step`` arithmetic on it."""

    def __init__(self, step):
        super().__init__()
        self.fc, self.calls, self.step = nn.Linear(8, 2), 0, step

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.fc(x))
        return h, self.step(self.calls), h * 2


@pytest.mark.parametrize("step, compiled", [
    (lambda calls: calls + 1, True),
    # int64 0-d tensor times 0.5 is float32 in torch, float64 in Python: another number
    # than eager's, so the compiled form refuses it (the call's result comes from fx)
    (lambda calls: calls * 0.5, False),
])
def test_a_forward_returning_numbers_it_computes_is_split_with_numbers_out(step, compiled):
    """A count kept on the module is a number input and its new value a number output: the
    forward part returns it as a 0-d tensor and the glue makes it a number of eager's type
    again (refused before: "returns Python numbers computed inside the graph and results
    that need autograd"), or, where a tensor would compute another number, fx runs it."""
    entry, graph = _pinned_twins(lambda: _Counted(step), torch.randn(4, 8))
    assert isinstance(entry.graph_fn, Glued) == compiled, graph.note
    if not compiled:
        assert "a number output computed as a torch.float32 tensor, not torch.float64" in graph.note
    opt = specularch.optimize(_Counted(step), backend="torchscript")
    with specularch.config.patch(profile_calls=0):
        results = [opt(torch.randn(4, 8))[1] for _ in range(3)]
    assert results == [step(n) for n in (1, 2, 3)] and all(type(r) is type(step(1)) for r in results)


class _ReturnsBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc(x), x.size(0)


def test_a_pinned_backend_compiles_a_forward_returning_its_dynamic_batch_size():
    """Batches of 4, 3, 2, 5 make the batch dynamic; the graph returns it as a Python int
    beside a result that needs autograd. Pinned, it compiles for every size (refused before:
    "returns Python numbers computed inside the graph ... (it has dynamic sizes)"), the int
    and the gradients eager's."""
    torch.manual_seed(0)
    model, twin = _ReturnsBatch(), _ReturnsBatch()
    twin.load_state_dict(model.state_dict())
    opt = specularch.optimize(model, backend="torchscript")
    with specularch.config.patch(profile_calls=0):
        for n in [4, 4, 3, 4, 2, 5]:
            x = torch.randn(n, 6)
            for net in (twin, opt):
                net.zero_grad()
                out, batch = net(x)
                (out.sum() / batch).backward()
            assert batch == n and type(batch) is int
            for p, q in zip(twin.parameters(), model.parameters()):
                assert_same(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    graph = specularch.explain(opt).graphs[-1]
    assert graph.backend == "torchscript" and not graph.note, graph
