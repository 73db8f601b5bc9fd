"""No copy tax (issue 14): an in-place update of a tensor that exists before the call, whose
new value nothing in the graph reads, is applied by the commit itself with the op eager runs
(``symbolic/commit_inplace.py``), instead of computed on a copy and copied back.

Differential: eager and optimized training steps on identical models, several steps, the
parameters, ``.grad``, optimizer state, buffers and autograd version counters bit for bit
equal; the entry's source and the graph say which updates were replayed and which stayed a
copy (a value read after the update, a ``batch_norm`` running statistic)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of
from tests.differential import A, T, check, expect_graph, mse_train_step

STEPS = 8


def _batches(n, shape=(8, 6), classes=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g), torch.randn(shape[0], classes, generator=g))
            for _ in range(n)]


def _model(batchnorm=False, wide=False):
    """6 -> 16 -> 3; ``wide``: a 512 x 512 layer in the middle (1 MiB of weights: the commit
    runs the replayed ops of so large a tensor in program order, shadow_heap/replay.py)."""
    torch.manual_seed(0)
    hidden = 512 if wide else 16
    layers = [nn.Linear(6, hidden)] + ([nn.BatchNorm1d(hidden)] if batchnorm else []) + \
        [nn.Tanh()] + ([nn.Linear(hidden, hidden), nn.Tanh()] if wide else []) + [nn.Linear(hidden, 3)]
    return nn.Sequential(*layers)


def _same(m1, o1, m2, o2):
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
        s1, s2 = o1.state[p], o2.state[q]
        assert s1.keys() == s2.keys(), name
        for k in s1:
            assert torch.equal(torch.as_tensor(s1[k]), torch.as_tensor(s2[k])), (name, k)
    for (name, b), c in zip(m1.named_buffers(), m2.buffers()):
        assert torch.equal(b, c), name


def _versions(model, opt) -> list:
    """Every parameter's, buffer's and optimizer state tensor's autograd version counter."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for p in model.parameters() for v in opt.state[p].values()
                if isinstance(v, torch.Tensor)]
    return [t._version for t in tensors]


class _Bumps:
    """The version increments of each call, compared with eager's (increments: a deep copy
    starts its tensors at version 0, the original's parameters are at 1 after their init)."""

    def __init__(self, fast_state, ref_state):
        self.states = fast_state, ref_state
        self.last = [_versions(*state) for state in self.states]

    def step(self):
        now = [_versions(*state) for state in self.states]
        fast, ref = ([a - b for a, b in zip(n, last)] for n, last in zip(now, self.last))
        assert fast == ref, f"version bumps: optimized {fast}, eager {ref}"
        self.last = now


def _train(make_opt, *, batchnorm=False, after=None, steps=STEPS, wide=False):
    model = _model(batchnorm, wide)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref_model.parameters())
    fast = specularch.optimize(mse_train_step(model, opt, after))
    ref = mse_train_step(ref_model, ref_opt, after)
    bumps = _Bumps((model, opt), (ref_model, ref_opt))
    for i, (x, y) in enumerate(_batches(steps)):
        assert fast(x, y) == ref(x, y)
        _same(model, opt, ref_model, ref_opt)
        bumps.step()
    e = specularch.explain(fast)
    assert e.fallbacks == [] and e.stats.graph_hits >= steps - 4, str(e)
    entry = _state_of(fast).entries[0]
    return entry.entry_source, entry.capture.graph_module.code, entry.graph_fn.__self__.code


# (an explicit foreach=True is not captured yet: an unsupported_call fallback)
@pytest.mark.parametrize("foreach", [None, False], ids=["default", "for-loop"])
def test_sgd_updates_parameters_in_place_with_no_clone_or_copy(foreach):
    source, captured, ran = _train(lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=foreach))
    for code in (captured, ran):
        assert ".clone()" not in code and "_foreach_add" not in code and "add_" not in code, code
        assert "_foreach_copy" not in code
    assert "COPY_ALL" not in source, source
    assert source.count("FOREACH_ADD_((") == 1, source  # one foreach call, as eager's default


def test_sgd_momentum_buffers_and_parameters_are_replayed_in_program_order():
    """The momentum buffer's new value is read only by the parameter's update, which the
    commit replays too: the commit runs ``buf.mul_(m); buf.add_(g); p.add_(buf, alpha=-lr)``
    per parameter, as eager, and the graph computes only the gradients."""
    source, captured, _ = _train(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    assert "COPY_ALL(" not in source and ".clone()" not in captured, (source, captured)
    assert source.count("FOREACH_MUL_(") == 1 and source.count("FOREACH_ADD_(") == 2, source


def test_sgd_nesterov_weight_decay_dampening():
    for make_opt in (
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3, maximize=True)):
        source, _, _ = _train(make_opt)
        assert "with NO_GRAD():" in source


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3, amsgrad=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
], ids=["adam", "adam-amsgrad", "adamw", "rmsprop", "adagrad"])
def test_adaptive_optimizers_replay_the_parameter_update(make_opt):
    source, captured, _ = _train(make_opt)
    assert "with NO_GRAD():" in source


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3, maximize=True),
], ids=["adam", "adamw", "adam-decay-maximize"])
def test_adam_state_and_parameters_are_all_replayed(make_opt):
    """Adam's step counts, ``exp_avg``, ``exp_avg_sq`` and parameters are updated in place
    by the commit; its denominator ``(exp_avg_sq.sqrt() / c).add_(eps)``, read only by the
    parameter's update, is a scratch tensor the commit computes between them: the graph
    computes the gradients only, nothing is copied back."""
    source, captured, _ = _train(make_opt)
    for op in (".clone()", ".addcdiv_(", ".lerp_(", ".sqrt()", ".addcmul_("):
        assert op not in captured, (op, captured)
    assert "FOREACH_ADDCDIV_(" in source and "FOREACH_LERP_(" in source, source
    assert "COPY_ALL(" not in source and source.count(".sqrt()") == 4, source


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
], ids=["adam", "adamw", "momentum"])
def test_large_tensors_are_updated_in_program_order(make_opt):
    """With a 1 MiB weight the commit runs each parameter's ops in eager's order, one op at
    a time (no foreach call), and frees each scratch tensor after its last use."""
    source, captured, _ = _train(make_opt, wide=True)
    assert "FOREACH_" not in source and "COPY_ALL(" not in source and ".clone()" not in captured
    replay = next(line for line in source.splitlines() if "with NO_GRAD():" in line)
    per_param = replay.split(".lerp_(" if "lerp_" in replay else ".mul_(")
    assert len(per_param) == 7, replay  # 6 parameters, one after the other
    if "sqrt" in replay:
        assert replay.count("del D") == 12, replay  # 6 x (the square root, the denominator)


def test_batchnorm_running_stats_stay_copies_and_match_eager():
    """``batch_norm`` writes its running statistics inside the op the graph reads: they stay
    copies; ``num_batches_tracked += 1`` is read by nothing: replayed."""
    source, captured, _ = _train(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), batchnorm=True)
    assert "COPY_ALL(" in source
    assert "num_batches_tracked.clone()" not in captured and "running_mean.clone()" in captured


def test_parameter_read_after_the_step_stays_functional():
    def after(model, loss):
        return (model[0].weight.sum() + loss).item()  # the updated weight, read in the graph
    source, captured, _ = _train(lambda ps: torch.optim.SGD(ps, lr=0.1), after=after)
    assert captured.count(".clone()") == 1, captured  # the weight read after the update
    assert "COPY_ALL(" in source and source.count(".add_(R[") + source.count("FOREACH_ADD_") >= 1


_UPDATES = [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
]
_UPDATE_IDS = ["momentum", "adam", "adamw"]


def _replays_everything(fast, make_opt):
    """The entry's commit runs every update (Adam's scratch denominators included)."""
    source = _state_of(fast).entries[0].entry_source
    assert "with NO_GRAD():" in source and "COPY_ALL(" not in source, source
    adam = isinstance(make_opt([nn.Parameter(torch.ones(1))]), torch.optim.Adam)
    assert ("D0 = " in source) is adam, source


@pytest.mark.parametrize("make_opt", _UPDATES, ids=_UPDATE_IDS)
def test_graph_that_raises_after_the_update_leaves_everything_untouched(make_opt):
    """The embedding lookup after ``opt.step()`` raises at run time on an index out of range
    (capture saw valid ones): the graph's update never reached the parameters; the eager
    re-run (which raises as eager does) applied it exactly once, as eager did."""
    def make(model, opt, table):
        def step(x, y, idx):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return (loss + nn.functional.embedding(idx, table).sum()).item()
        return step
    model, table = _model(), torch.randn(5, 2)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref_model.parameters())
    fast, ref = specularch.optimize(make(model, opt, table)), make(ref_model, ref_opt, table)
    ok, bad = torch.tensor([0, 4]), torch.tensor([1, 7])
    bumps = _Bumps((model, opt), (ref_model, ref_opt))
    for i, (x, y) in enumerate(_batches(STEPS + 1)):
        idx = bad if i == STEPS - 1 else ok
        if idx is bad:
            with pytest.raises(IndexError):
                ref(x, y, idx)
            with pytest.raises(IndexError):
                fast(x, y, idx)
        else:
            assert fast(x, y, idx) == ref(x, y, idx)
        _same(model, opt, ref_model, ref_opt)
        bumps.step()
    _replays_everything(fast, make_opt)
    assert specularch.explain(fast).stats.graph_hits >= STEPS - 5


class _Box:
    big = 0


@pytest.mark.parametrize("make_opt", _UPDATES + [lambda ps: torch.optim.SGD(ps, lr=0.1)],
                         ids=_UPDATE_IDS + ["sgd"])
def test_failed_assumption_after_the_update_commits_nothing(make_opt):
    """A branch on the loss after ``opt.step()`` (a Python write on one side: not mergeable)
    is speculated in the graph; when it goes the other way the entry returns before its
    commit and the call runs eagerly once: the update is applied once."""
    def make(model, opt, box):
        def step(x, y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if loss > 100.0:
                box.big += 1
            return loss.item()
        return step
    model = _model()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref_model.parameters())
    box, ref_box = _Box(), _Box()
    fast, ref = specularch.optimize(make(model, opt, box)), make(ref_model, ref_opt, ref_box)
    bumps = _Bumps((model, opt), (ref_model, ref_opt))
    for i, (x, y) in enumerate(_batches(10)):
        if i == 7:  # the graph replays the update in its commit
            _replays_everything(fast, make_opt)
        scale = 100.0 if i == 7 else 0.1  # the loss crosses 100 after capture
        assert fast(x * scale, y * scale) == ref(x * scale, y * scale)
        _same(model, opt, ref_model, ref_opt)
        assert box.big == ref_box.big
        bumps.step()
    e = specularch.explain(fast)
    assert e.stats.assumption_failures == 1, str(e)


# ---- the rules, on small functions (compared by the differential harness) -----------------

def chain_replayed(buf, x):
    with torch.no_grad():
        buf.mul_(0.9).add_(x, alpha=0.1)  # nothing reads buf after: two ops at commit
    return x.sum()


def operand_written_later(buf, x):
    t = x * 2
    with torch.no_grad():
        buf.add_(t)
        t.mul_(3)  # the commit must not read this t: buf stays a copy
    return t


def operand_written_between_ops(buf, x):
    t = x * 2
    with torch.no_grad():
        buf.add_(t)
        t.mul_(3)  # after the op that read t, before buf's last op: buf stays a copy
        buf.mul_(2)
    return t


def operand_is_another_written_tensor(a, b):
    with torch.no_grad():
        a.add_(b)  # reads b before b's update, which the commit copies: a stays a copy
        b.add_(1)
    return b.sum()  # b's new value read in the graph: a copy


def read_between_writes(a, b):
    with torch.no_grad():
        b.mul_(2)
        a.add_(b)  # b as its first op left it: the commit runs b's second op after this one
        b.add_(1)
    return None


def self_operand(buf):
    with torch.no_grad():
        buf.add_(1).mul_(buf)
    return None


def scratch_replayed(v, p, g):
    with torch.no_grad():  # Adam's shape: a denominator made from v, read by p's update only
        v.mul_(0.9).addcmul_(g, g, value=0.1)
        p.addcdiv_(g, (v.sqrt() / 3).add_(1e-8), value=-0.1)
    return g.sum()


def scratch_read_in_graph(v, p, g):
    with torch.no_grad():
        v.mul_(0.9)
        d = v.sqrt()
        p.add_(d)  # replayed, reading the graph's d
    return d.sum()  # the graph reads d: v's update stays a copy


def chain_of_reads(a, b, c):
    with torch.no_grad():
        c.mul_(2)
        b.add_(c)  # reads c's new value
        a.add_(b)  # reads b's new value
        s = a * 1  # a's new value read in the graph: a, then b, then c stay copies
    return s


@pytest.mark.parametrize("fn, make_args", [
    (scratch_replayed, lambda: A(T(3, 4, low=0), T(3, 4), T(3, 4))),
    (scratch_read_in_graph, lambda: A(T(3, 4, low=0), T(3, 4), T(3, 4))),
    (chain_of_reads, lambda: A(T(3, 4), T(3, 4), T(3, 4))),
    (chain_replayed, lambda: A(T(3, 4), T(3, 4))),
    (operand_written_later, lambda: A(T(3, 4), T(3, 4))),
    (operand_written_between_ops, lambda: A(T(3, 4), T(3, 4))),
    (operand_is_another_written_tensor, lambda: A(T(3, 4), T(3, 4))),
    (self_operand, lambda: A(T(3, 4))),
    (read_between_writes, lambda: A(T(3, 4), T(3, 4))),
], ids=lambda v: getattr(v, "__name__", ""))
def test_replay_rules_match_eager(fn, make_args):
    expect_graph(check(fn, make_args, calls=6, expect="graph"))
    opt = specularch.optimize(fn)
    args = [make_args()[0] for _ in range(5)]
    versions = []
    for a in args:
        before = [t._version for t in a]
        opt(*a)
        versions.append([t._version - v for t, v in zip(a, before)])
    ref = make_args()[0]
    before = [t._version for t in ref]
    fn(*ref)
    assert versions[-1] == [t._version - v for t, v in zip(ref, before)]  # eager's bumps
    source = _state_of(opt).entries[0].entry_source
    replayed, copied = {chain_replayed: (True, False), operand_written_later: (False, True),
                        operand_is_another_written_tensor: (False, True),
                        self_operand: (True, False), read_between_writes: (True, False),
                        operand_written_between_ops: (False, True),
                        scratch_replayed: (True, False), scratch_read_in_graph: (True, True),
                        chain_of_reads: (False, True)}[fn]
    assert ("with NO_GRAD():" in source) is replayed, source
    assert ("COPY_ALL(" in source) is copied, source
    assert ("D0 = " in source) is (fn is scratch_replayed), source


def test_dropping_a_long_chain_of_updates_checks_each_a_few_times(monkeypatch):
    """``b[i].add_(b[i + 1])`` for i = n-2 .. 0, then ``b[0]`` read in the graph: b[0] stays
    a copy, so b[1]'s new value is read by an op not replayed, and so on down the chain.
    The worklist rechecks only the neighbours of a dropped update (a fixpoint over all
    updates would check them n times each: quadratic in the graph's size)."""
    from specularch.symbolic import commit_inplace
    calls = []
    ok = commit_inplace.Graph._ok
    monkeypatch.setattr(commit_inplace.Graph, "_ok", lambda *a: calls.append(1) or ok(*a))
    n = 40

    def chain(*bufs):
        with torch.no_grad():
            bufs[-1].mul_(2)
            for i in reversed(range(n - 1)):
                bufs[i].add_(bufs[i + 1])
        return bufs[0] * 1
    expect_graph(check(chain, lambda: A(*(T(2, 3, seed=i) for i in range(n))), calls=5,
                       expect="graph"))
    assert n <= len(calls) <= 4 * n, len(calls)  # every update checked, each a few times
