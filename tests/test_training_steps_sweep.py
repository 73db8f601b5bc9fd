"""Adversarial differential sweep of whole training steps (docs/semantics.md "Training steps").

Each case builds two identical worlds (model, optimizer, maybe a scheduler, a log), makes the
same step function over each and optimizes ONE of them (``specularch.optimize``), runs both
on the same seeded batches for ~12 steps (calls 1-3 profile, 4 captures, later calls replay)
and compares after every step: what the step returns, every parameter, every ``.grad``
(None-ness, values, strides, which parameters share one gradient tensor, whether ``p.grad`` is
still the tensor it was before the step), buffers and train/eval flags, ``opt.state_dict()``
(state tensors with their ``step`` counters, param groups), which state tensors are still the
same objects, the scheduler's ``state_dict()`` and ``get_last_lr()``, the world's log, the
global RNG state; the results of every step again at the end. Most cases run with
``templates="exact"`` and compare bit for bit.

Swept: every torch.optim optimizer and its options (SGD momentum / dampening / nesterov /
weight decay / maximize, Adam / AdamW amsgrad / maximize / decoupled decay, RMSprop,
Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, SparseAdam, LBFGS with a closure),
``foreach`` / ``differentiable``; several param groups; frozen parameters (frozen before
optimize and toggled between steps); parameters without a gradient in some steps (an unused
branch chosen by a Python flag or by the data); ``zero_grad(set_to_none=False)``; gradient
accumulation over a varying number of micro-batches (a loop in the step, or across calls);
``clip_grad_norm_`` / ``clip_grad_value_`` (norm types, foreach, error_if_nonfinite);
schedulers stepped inside or outside the step (StepLR, CosineAnnealingLR, OneCycleLR,
LambdaLR, ReduceLROnPlateau fed ``loss.item()``); ``loss.item()`` used in Python; NaN / inf
losses skipped in Python; ``torch.autograd.grad`` written into ``.grad``; ``retain_graph``
and two backward calls; ``.detach()``ed parts of the loss; BatchNorm / Dropout in train
mode; ``eval()`` steps under ``no_grad`` interleaved with training; ``load_state_dict`` and
param-group writes between steps; weight tying; ``autocast('cpu', bfloat16)``.

Falling back to eager is fine; a wrong answer, a crash or an ``internal_error`` record is a
bug (those cases are ``xfail(strict=True)`` with what goes wrong).

Found by this sweep and fixed: bf16/fp16 ``t.mul_(number)`` updates batched into a foreach
op that rounds the number to the dtype first (momentum buffers off by ULPs); a gradient
released before the graph although the step's Python read it (``if p.grad is not None``)
and the eager re-run after a graph that raised took the other branch; numpy
hyperparameters an ``internal_error``; ``clip_grad_value_(foreach=False)`` one version bump
too many; in-place ops on zero-element tensors run on the caller's tensor during capture.
"""
from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from differential import assert_same

O = torch.optim
LS = torch.optim.lr_scheduler
STEPS = 12


# --------------------------------------------------------------------------- harness


def batch(i, n=6, d=5, k=3):
    """The step's batch (own generator): inputs, regression targets, class labels."""
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, d, generator=g), torch.randn(n, k, generator=g), torch.randint(0, k, (n,), generator=g)


def mlp(d=5, h=8, k=3):
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, k))


def _dense(t):
    return t.to_dense() if t is not None and t.layout != torch.strided else t


def _grad_layout(params):
    """Per parameter: None, or (requires_grad, strides, index of the first parameter whose
    .grad is the same tensor, index of the first whose .grad shares its memory, whether the
    grad shares memory with any parameter)."""
    grads = [p.grad for p in params]
    if any(g is not None and g.layout != torch.strided for g in grads):
        return [None if g is None else (g.layout, g.shape) for g in grads]
    ptrs = [None if g is None else g.untyped_storage().data_ptr() for g in grads]
    pptrs = {p.untyped_storage().data_ptr() for p in params}
    out = []
    for i, g in enumerate(grads):
        if g is None:
            out.append(None)
            continue
        same = next(j for j, h in enumerate(grads) if h is g)
        shared = next(j for j, q in enumerate(ptrs) if q == ptrs[i])
        out.append((g.requires_grad, g.stride(), same, shared, ptrs[i] in pptrs))
    return out


def _state_ids(opt):
    """The optimizer's state tensors (the objects: held, so their ids are not reused)."""
    return {i: {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            for i, p in enumerate(_params_of(opt)) if p in opt.state}


def _params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _kept(before, after):
    """Which tensors of ``after`` are still the objects recorded in ``before``."""
    return {i: {k: v is before.get(i, {}).get(k) for k, v in d.items()} for i, d in after.items()}


class World:
    """model, opt, sched (optional), log (a list the step may append to), anything else."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _params(w):
    seen, out = set(), []
    for m in _modules(w):
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    for p in getattr(w, "extra_params", []):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _modules(w):
    return [w.model] if isinstance(getattr(w, "model", None), nn.Module) else []


def compare(we, wo, where, rtol, atol):
    for me, mo in zip(_modules(we), _modules(wo)):
        assert_same(me, mo, f"{where}: model", rtol=rtol, atol=atol)
        for (a, b) in zip(me.state_dict().values(), mo.state_dict().values()):
            assert_same(a, b, f"{where}: model.state_dict", rtol=rtol, atol=atol)
    pe, po = _params(we), _params(wo)
    for k, (a, b) in enumerate(zip(pe, po)):
        assert (a.grad is None) == (b.grad is None), \
            f"{where}: param {k}.grad: eager {'None' if a.grad is None else 'a tensor'}, " \
            f"optimized {'None' if b.grad is None else 'a tensor'}"
        if a.grad is not None:
            assert_same(_dense(a.grad), _dense(b.grad), f"{where}: param {k}.grad", rtol=rtol, atol=atol)
        assert_same(a, b, f"{where}: param {k}", rtol=rtol, atol=atol)
        assert a.requires_grad == b.requires_grad
    ve, vo = _versions(we), _versions(wo)
    assert ve == vo, f"{where}: version counters differ: eager {ve}, optimized {vo}"
    assert _grad_layout(pe) == _grad_layout(po), \
        f"{where}: gradient layout/aliasing differs: eager {_grad_layout(pe)}, optimized {_grad_layout(po)}"
    for oe, oo in zip(_opts(we), _opts(wo)):
        assert_same(oe.state_dict(), oo.state_dict(), f"{where}: optimizer.state_dict()", rtol=rtol, atol=atol)
    for se, so in zip(_scheds(we), _scheds(wo)):
        assert_same(_sched_state(se), _sched_state(so), f"{where}: scheduler.state_dict()", rtol=rtol, atol=atol)
        if hasattr(se, "get_last_lr"):
            assert_same(se.get_last_lr(), so.get_last_lr(), f"{where}: get_last_lr()", rtol=rtol, atol=atol)
    assert_same(getattr(we, "log", None), getattr(wo, "log", None), f"{where}: log", rtol=rtol, atol=atol)


def _versions(w):
    """The version counters of the parameters, their gradients and the optimizers' state."""
    out = [(p._version, None if p.grad is None or p.grad.layout != torch.strided else p.grad._version)
           for p in _params(w)]
    for o in _opts(w):
        out.append({i: {k: v._version for k, v in d.items()} for i, d in _state_ids(o).items()})
    return out


def _sched_state(s):
    d = dict(s.state_dict())
    d.pop("lr_lambdas", None)
    d.pop("_schedulers", None)
    return d


def _opts(w):
    o = getattr(w, "opt", None)
    return [] if o is None else list(o) if isinstance(o, (list, tuple)) else [o]


def _scheds(w):
    s = getattr(w, "sched", None)
    return [] if s is None else list(s) if isinstance(s, (list, tuple)) else [s]


def _grad_ids(w):
    """Every parameter's .grad (the objects: held, so their ids are not reused)."""
    return [p.grad for p in _params(w)]


def run(make_world, make_step, *, args=None, steps=STEPS, between=None, after=None, exact=True,
        rtol=None, atol=None, optimize_kw=None, report_of=None, context=None):
    """Train the eager world and the optimized world side by side; see the module docstring.
    ``args(i)`` -> the step's arguments (default ``batch(i)``); ``between(w, i)`` runs on both
    worlds before step ``i``, ``after(w, i, result)`` after it (outside the optimized call)."""
    rtol = (0.0 if exact else 1e-5) if rtol is None else rtol
    atol = (0.0 if exact else 1e-6) if atol is None else atol
    args = args or batch
    worlds = []
    for _ in range(2):
        torch.manual_seed(0)
        worlds.append(make_world())
    we, wo = worlds
    fe = make_step(we)
    fo = specularch.optimize(make_step(wo), **(optimize_kw or {}))
    kept = []
    patch = specularch.config.patch(templates="exact") if exact else specularch.config.patch()
    with patch:
        for i in range(steps):
            where = f"step {i}"
            results, rngs, errors, grad_kept, state_kept = [], [], [], [], []
            for w, fn in ((we, fe), (wo, fo)):
                if between is not None:
                    between(w, i)
                gids, sids = _grad_ids(w), [_state_ids(o) for o in _opts(w)]
                step_args = args(i, w) if args.__code__.co_argcount == 2 else args(i)
                torch.manual_seed(1000 + i)
                try:
                    with (context(i) if context is not None else contextlib.nullcontext()):
                        results.append(fn(*step_args))
                    errors.append(None)
                except Exception as exc:  # noqa: BLE001 - part of what is compared
                    results.append(None)
                    errors.append(exc)
                rngs.append(torch.get_rng_state())
                grad_kept.append([a is not None and a is b for a, b in zip(gids, _grad_ids(w))])
                state_kept.append([_kept(s, _state_ids(o)) for s, o in zip(sids, _opts(w))])
                del gids, sids, step_args
                if after is not None and errors[-1] is None:
                    after(w, i, results[-1])
            if errors[0] is not None or errors[1] is not None:
                assert errors[1] is not None, f"{where}: eager raised {errors[0]!r}, optimized returned"
                assert errors[0] is not None, f"{where}: optimized raised {errors[1]!r}, eager returned"
                assert (type(errors[0]), str(errors[0])) == (type(errors[1]), str(errors[1])), \
                    f"{where}: exceptions differ: {errors[0]!r} vs {errors[1]!r}"
            assert_same(results[0], results[1], f"{where}: result", rtol=rtol, atol=atol)
            assert torch.equal(*rngs), f"{where}: the global RNG drew other numbers than eager"
            assert grad_kept[0] == grad_kept[1], \
                f"{where}: whether p.grad is still the same tensor object: eager {grad_kept[0]}, optimized {grad_kept[1]}"
            assert state_kept[0] == state_kept[1], \
                f"{where}: whether optimizer state tensors are the same objects: eager {state_kept[0]}, optimized {state_kept[1]}"
            compare(we, wo, where, rtol, atol)
            kept.append(results)
    for i, (a, b) in enumerate(kept):
        assert_same(a, b, f"step {i}: result, at the end", rtol=rtol, atol=atol)
    report = specularch.explain(fo if report_of is None else report_of(wo))
    bugs = [str(f) for f in report.fallbacks if f.kind == "internal_error"]
    assert not bugs, "internal error:\n" + "\n".join(bugs)
    kinds = sorted({f.kind for f in report.fallbacks})
    reasons = sorted({f.explanation[:90] for f in report.fallbacks})
    print(f"[sweep] graphs={len(report.graphs)} hits={report.stats.graph_hits} "
          f"captures={report.stats.captures} fallback_calls={report.stats.fallback_calls} "
          f"kinds={kinds} {reasons}", file=sys.stderr)
    return report


def world(model=mlp, opt=lambda ps: O.SGD(ps, lr=0.1), sched=None, **extra):
    def make():
        m = model()
        o = opt(m.parameters()) if not isinstance(opt, str) else None
        w = World(model=m, opt=o, log=[], **{k: v() if callable(v) else v for k, v in extra.items()})
        if sched is not None:
            w.sched = sched(o)
        return w
    return make


def mse_step(set_to_none=True, ret="item"):
    def make(w):
        model, opt = w.model, w.opt

        def train_step(x, y, labels):
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.item() if ret == "item" else loss.detach() if ret == "detached" else loss
        return train_step
    return make


def ce_step(w):
    model, opt = w.model, w.opt

    def train_step(x, y, labels):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


# --------------------------------------------------------------------------- optimizers


OPTIMIZERS = {
    "sgd": lambda ps: O.SGD(ps, lr=0.1),
    "sgd_momentum_dampening": lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3),
    "sgd_nesterov_wd": lambda ps: O.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-2),
    "sgd_maximize_wd": lambda ps: O.SGD(ps, lr=0.05, momentum=0.5, weight_decay=1e-2, maximize=True),
    "adam": lambda ps: O.Adam(ps, lr=1e-2),
    "adam_amsgrad_maximize_wd": lambda ps: O.Adam(ps, lr=1e-2, amsgrad=True, maximize=True, weight_decay=1e-2),
    "adam_decoupled": lambda ps: O.Adam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "adamw_amsgrad": lambda ps: O.AdamW(ps, lr=1e-2, amsgrad=True, betas=(0.8, 0.95)),
    "adamw_maximize": lambda ps: O.AdamW(ps, lr=1e-2, maximize=True, weight_decay=0.05),
    "rmsprop_centered_momentum": lambda ps: O.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-3),
    "rmsprop_maximize": lambda ps: O.RMSprop(ps, lr=1e-2, maximize=True, alpha=0.9),
    "adagrad": lambda ps: O.Adagrad(ps, lr=0.1, lr_decay=1e-2, initial_accumulator_value=0.1),
    "adadelta": lambda ps: O.Adadelta(ps, lr=1.0, weight_decay=1e-2),
    "adamax": lambda ps: O.Adamax(ps, lr=2e-2, maximize=True),
    "nadam": lambda ps: O.NAdam(ps, lr=2e-2, weight_decay=1e-2, decoupled_weight_decay=True),
    "radam": lambda ps: O.RAdam(ps, lr=1e-2, betas=(0.9, 0.9)),  # rho_t > 5 flips early
    "asgd": lambda ps: O.ASGD(ps, lr=1e-2, t0=3),
    "rprop": lambda ps: O.Rprop(ps, lr=1e-2),
}
FOREACH = [("sgd_momentum_dampening", True), ("adam", True), ("nadam", True), ("rprop", True),
           ("adamw_amsgrad", False), ("adagrad", False), ("radam", False), ("asgd", False)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer(name):
    """A plain MSE step with each optimizer."""
    run(world(opt=OPTIMIZERS[name]), mse_step())


@pytest.mark.parametrize("name, foreach", FOREACH, ids=[f"{n}-{f}" for n, f in FOREACH])
def test_optimizer_foreach(name, foreach):
    def make_opt(ps):
        o = OPTIMIZERS[name](ps)
        for g in o.param_groups:
            g["foreach"] = foreach
        o.defaults["foreach"] = foreach
        return o
    run(world(opt=make_opt), mse_step(), exact=not foreach)


@pytest.mark.parametrize("name", ["sgd_momentum_dampening", "adam"])
def test_optimizer_differentiable(name):
    def make_opt(ps):
        o = OPTIMIZERS[name](ps)
        for g in o.param_groups:
            g["differentiable"] = True
        return o
    run(world(opt=make_opt), mse_step())


# --------------------------------------------------------------------------- param groups


def two_groups(opt_cls, **kw):
    def make(ps):
        ps = list(ps)
        return opt_cls([{"params": ps[:2], "lr": 0.05, "weight_decay": 1e-2},
                        {"params": ps[2:], "lr": 0.01}], **kw)
    return make


@pytest.mark.parametrize("opt_cls, kw", [
    (O.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (O.Adam, dict(lr=1e-2, amsgrad=True)),
    (O.RMSprop, dict(lr=1e-2, momentum=0.5)),
], ids=["sgd", "adam", "rmsprop"])
def test_param_groups_with_different_lr(opt_cls, kw):
    run(world(opt=two_groups(opt_cls, **kw)), mse_step())


LRS = [0.1, 0.1, 0.05, 0.05, 0.02, 0.2, 0.2, 0.01, 0.3, 0.3, 0.07, 0.07]


@pytest.mark.parametrize("opt_name", ["sgd_nesterov_wd", "adam", "radam"])
def test_lr_written_between_steps(opt_name):
    def between(w, i):
        w.opt.param_groups[0]["lr"] = LRS[i]
    run(world(opt=OPTIMIZERS[opt_name]), mse_step(), between=between)


def test_lr_becomes_an_int_between_steps():
    def between(w, i):
        w.opt.param_groups[0]["lr"] = 1 if i in (5, 6, 9) else 0.01
    run(world(opt=lambda ps: O.SGD(ps, lr=0.01, momentum=0.9)), mse_step(), between=between)


def test_momentum_switched_off_and_on_between_steps():
    def between(w, i):
        w.opt.param_groups[0]["momentum"] = 0.0 if i in (5, 6, 10) else 0.9
    run(world(opt=lambda ps: O.SGD(ps, lr=0.05, momentum=0.9)), mse_step(), between=between)


def test_betas_and_weight_decay_written_between_steps():
    def between(w, i):
        g = w.opt.param_groups[0]
        g["betas"] = (0.9, 0.999) if i % 3 else (0.5, 0.9)
        g["weight_decay"] = 0.0 if i < 7 else 0.1
        g["amsgrad"] = i >= 9
        if i == 9:
            for p in g["params"]:
                w.opt.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
    run(world(opt=lambda ps: O.Adam(ps, lr=1e-2)), mse_step(), between=between)


def test_param_group_added_between_steps():
    def make():
        m = nn.ModuleDict({"a": nn.Linear(5, 3), "b": nn.Linear(5, 3)})
        return World(model=m, opt=O.Adam(m["a"].parameters(), lr=1e-2), log=[])

    def between(w, i):
        if i == 6:
            w.opt.add_param_group({"params": list(w.model["b"].parameters()), "lr": 0.05})

    def make_step(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model["a"](x) + w.model["b"](x), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(make, make_step, between=between)


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening", "nadam"])
def test_optimizer_load_state_dict_between_steps(opt_name):
    """A checkpoint of the optimizer (and model) taken after step 3 is loaded before step 7."""
    import copy

    def between(w, i):
        if i == 4:
            w.ckpt = (copy.deepcopy(w.opt.state_dict()), copy.deepcopy(w.model.state_dict()))
        if i == 7:
            w.opt.load_state_dict(w.ckpt[0])
            w.model.load_state_dict(w.ckpt[1])
    run(world(opt=OPTIMIZERS[opt_name]), mse_step(), between=between)


def test_optimizer_replaced_between_steps():
    """The step reads ``w.opt`` each call; a fresh optimizer replaces it at step 6."""
    def between(w, i):
        if i == 6:
            w.opt = O.Adam(w.model.parameters(), lr=5e-3)

    def make_step(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=lambda ps: O.Adam(ps, lr=1e-2)), make_step, between=between)


def test_optimizer_state_cleared_between_steps():
    def between(w, i):
        if i == 6:
            w.opt.state.clear()
    run(world(opt=lambda ps: O.Adam(ps, lr=1e-2)), mse_step(), between=between)


# --------------------------------------------------------------------------- frozen parameters


def frozen_first_layer():
    m = mlp()
    m[0].weight.requires_grad_(False)
    return m


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening", "adam"])
def test_frozen_before_optimize(opt_name):
    run(world(model=frozen_first_layer, opt=OPTIMIZERS[opt_name]), mse_step())


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("opt_name", ["sgd_nesterov_wd", "adam"])
def test_frozen_toggled_between_steps(opt_name, set_to_none):
    """The first layer is frozen for steps 5-7 and 10: with set_to_none=False its gradient
    stays a zero tensor and the optimizer keeps moving it (momentum, Adam's moments)."""
    def between(w, i):
        w.model[0].requires_grad_(i not in (5, 6, 7, 10))
    run(world(opt=OPTIMIZERS[opt_name]), mse_step(set_to_none=set_to_none), between=between)


def test_frozen_toggled_inside_the_step():
    def make_step(w):
        def train_step(x, y, labels, freeze):
            w.model[0].weight.requires_grad_(not freeze)
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=lambda ps: O.Adam(ps, lr=1e-2)), make_step,
        args=lambda i: (*batch(i), i % 4 == 1))


# --------------------------------------------------------------------------- parameters without a gradient


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.b(h) if use_b else self.a(h)


class DataHeads(TwoHeads):
    def forward(self, x, use_b=None):
        h = torch.tanh(self.body(x))
        if x.sum() > 0:
            return self.b(h)
        return self.a(h)


FLAGS = [False, False, False, False, True, False, True, True, False, True, False, False]


def heads_step(set_to_none=True):
    def make(w):
        def train_step(x, y, labels, use_b):
            w.opt.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(w.model(x, use_b), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    return make


@pytest.mark.parametrize("opt_name, set_to_none", [
    ("sgd_momentum_dampening", True), ("adam_amsgrad_maximize_wd", True), ("radam", True), ("adamax", True),
    ("adam_amsgrad_maximize_wd", False), ("rmsprop_centered_momentum", False)])
def test_unused_branch_by_flag(opt_name, set_to_none):
    """Head ``b`` gets its first gradient (and optimizer state) only after the capture."""
    run(world(model=TwoHeads, opt=OPTIMIZERS[opt_name]), heads_step(set_to_none),
        args=lambda i: (*batch(i), FLAGS[i]))


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening", "adam"])
def test_unused_branch_by_data(opt_name):
    def args(i):
        x, y, labels = batch(i)
        return x + (3.0 if FLAGS[i] else -3.0), y, labels, None
    run(world(model=DataHeads, opt=OPTIMIZERS[opt_name]), heads_step(), args=args)


def test_unused_branch_clipped():
    def make(w):
        def train_step(x, y, labels, use_b):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x, use_b), y)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(w.model.parameters(), 0.3)
            w.opt.step()
            return loss.item(), norm.item()
        return train_step
    run(world(model=TwoHeads, opt=OPTIMIZERS["adam"]), make, args=lambda i: (*batch(i), FLAGS[i]))


# --------------------------------------------------------------------------- zero_grad variants


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
def test_zero_grad_keep_tensors(opt_name):
    run(world(opt=OPTIMIZERS[opt_name]), mse_step(set_to_none=False))


def test_model_zero_grad():
    def make(w):
        def train_step(x, y, labels):
            w.model.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_zero_grad_at_the_end():
    def make(w):
        def train_step(x, y, labels):
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            w.opt.zero_grad()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"]), make)


def test_no_zero_grad_gradients_grow():
    run(world(opt=OPTIMIZERS["adam"]), lambda w: _no_zero(w))


def _no_zero(w):
    def train_step(x, y, labels):
        loss = F.mse_loss(w.model(x), y)
        loss.backward()
        w.opt.step()
        return loss.item()
    return train_step


def test_manual_grad_none():
    def make(w):
        def train_step(x, y, labels):
            for p in w.model.parameters():
                p.grad = None
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulation_across_calls(set_to_none):
    """Gradients accumulate over calls; every third call steps and zeroes them."""
    def make(w):
        def train_step(x, y, labels, do_step):
            loss = F.mse_loss(w.model(x), y) / 3
            loss.backward()
            if do_step:
                w.opt.step()
                w.opt.zero_grad(set_to_none=set_to_none)
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make, args=lambda i: (*batch(i), i % 3 == 2))


# --------------------------------------------------------------------------- accumulation in the step

MICRO = [2, 3, 2, 2, 3, 1, 2, 3, 3, 1, 2, 2]


def accum_step(w):
    def train_step(xs, ys):
        w.opt.zero_grad()
        total = 0.0
        for x, y in zip(xs, ys):
            loss = F.mse_loss(w.model(x), y) / len(xs)
            loss.backward()
            total += loss.item()
        w.opt.step()
        return total
    return train_step


def micro_args(i):
    x, y, _ = batch(i, n=6)
    k = MICRO[i]
    return list(x.chunk(k) if k != 1 else [x]), list(y.chunk(k) if k != 1 else [y])


@pytest.mark.parametrize("opt_name, exact", [("sgd_momentum_dampening", True), ("adam", True), ("adam", False)])
def test_accumulation_loop_in_the_step(opt_name, exact):
    run(world(opt=OPTIMIZERS[opt_name]), accum_step, args=micro_args, exact=exact)


def test_accumulation_range_loop_with_chunks():
    def make(w):
        def train_step(x, y, n):
            w.opt.zero_grad()
            for k in range(n):
                loss = F.mse_loss(w.model(x[k::n]), y[k::n]) / n
                loss.backward()
            nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make, args=lambda i: (*batch(i)[:2], MICRO[i]))


# --------------------------------------------------------------------------- gradient clipping


CLIPS = {
    "norm": lambda ps: nn.utils.clip_grad_norm_(ps, 0.5),
    "norm_inf": lambda ps: nn.utils.clip_grad_norm_(ps, 0.2, norm_type=float("inf")),
    "norm_l1": lambda ps: nn.utils.clip_grad_norm_(ps, 1.0, norm_type=1),
    "norm_foreach": lambda ps: nn.utils.clip_grad_norm_(ps, 0.5, foreach=True),
    "norm_no_foreach": lambda ps: nn.utils.clip_grad_norm_(ps, 0.5, foreach=False),
    "norm_error_if_nonfinite": lambda ps: nn.utils.clip_grad_norm_(ps, 0.5, error_if_nonfinite=True),
    "norm_large": lambda ps: nn.utils.clip_grad_norm_(ps, 1e6),
    "value": lambda ps: nn.utils.clip_grad_value_(ps, 0.05),
    "value_foreach": lambda ps: nn.utils.clip_grad_value_(ps, 0.05, foreach=True),
    "value_no_foreach": lambda ps: nn.utils.clip_grad_value_(ps, 0.05, foreach=False),
}


def clip_step(clip, params=lambda m: m.parameters()):
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            norm = clip(params(w.model))
            w.opt.step()
            return loss.item(), None if norm is None else norm.item()
        return train_step
    return make




@pytest.mark.parametrize("name", list(CLIPS))
def test_clip(name):
    run(world(opt=OPTIMIZERS["adam"]), clip_step(CLIPS[name]))


def test_clip_subset_with_frozen_parameter():
    run(world(model=frozen_first_layer, opt=OPTIMIZERS["sgd_momentum_dampening"]),
        clip_step(CLIPS["norm"], params=lambda m: list(m[0].parameters()) + [m[2].weight]))


MAX_NORMS = [0.5, 0.5, 0.5, 0.5, 0.1, 0.5, 2.0, 0.05, 0.5, 0.3, 0.5, 1.0]


def test_clip_max_norm_varies_per_call():
    def make(w):
        def train_step(x, y, labels, max_norm):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(w.model.parameters(), max_norm)
            w.opt.step()
            return loss.item(), norm.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make, args=lambda i: (*batch(i), MAX_NORMS[i]))


def test_clip_norm_nonfinite_gradient_raises():
    """A NaN in the batch at step 7: error_if_nonfinite raises, eager's .grad stays set."""
    def args(i):
        x, y, labels = batch(i)
        if i == 7:
            x[0, 0] = float("nan")
        return x, y, labels
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"]), clip_step(CLIPS["norm_error_if_nonfinite"]), args=args)


def test_skip_step_when_clip_norm_too_large():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(w.model.parameters(), 10.0)
            if norm.item() > 1.2:
                w.log.append(("skipped", norm.item()))
                return None
            w.opt.step()
            return norm.item()
        return train_step

    def args(i):
        x, y, labels = batch(i)
        return x * (4.0 if FLAGS[i] else 1.0), y, labels
    run(world(opt=OPTIMIZERS["adam"]), make, args=args)


# --------------------------------------------------------------------------- schedulers


SCHEDULERS = {
    "step": lambda o: LS.StepLR(o, step_size=3, gamma=0.5),
    "cosine": lambda o: LS.CosineAnnealingLR(o, T_max=5),
    "onecycle": lambda o: LS.OneCycleLR(o, max_lr=0.05, total_steps=40),
    "lambda": lambda o: LS.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "exponential": lambda o: LS.ExponentialLR(o, gamma=0.9),
    "warmup_then_cosine": lambda o: LS.SequentialLR(o, [LS.LinearLR(o, 0.1, total_iters=4),
                                                         LS.CosineAnnealingLR(o, T_max=6)], milestones=[4]),
    "cyclic": lambda o: LS.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3),
}


def sched_step(where):
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            if where == "before":
                w.sched.step()
            loss.backward()
            w.opt.step()
            if where == "inside":
                w.sched.step()
            return loss.item()
        return train_step
    return make


def _sched_outside(w, i, result):
    w.sched.step()


@pytest.mark.parametrize("name, where", [(n, "outside") for n in SCHEDULERS] + [("onecycle", "inside"), ("step", "inside")])
def test_scheduler(name, where):
    opt = OPTIMIZERS["adam"] if name != "cyclic" else OPTIMIZERS["sgd_momentum_dampening"]
    run(world(opt=opt, sched=SCHEDULERS[name]), sched_step(where),
        after=_sched_outside if where == "outside" else None)


def test_scheduler_stepped_before_optimizer():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(world(opt=OPTIMIZERS["adam"], sched=SCHEDULERS["step"]), sched_step("before"))


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_reduce_lr_on_plateau(where):
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            if where == "inside":
                w.sched.step(loss.item())
            return loss.item()
        return train_step

    def after(w, i, result):
        if where == "outside":
            w.sched.step(result)
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"], sched=lambda o: LS.ReduceLROnPlateau(o, patience=1, factor=0.5)),
        make, after=after)


def test_manual_warmup_written_inside_the_step():
    def make(w):
        def train_step(x, y, labels, step):
            for g in w.opt.param_groups:
                g["lr"] = 0.01 * min(1.0, (step + 1) / 5)
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make, args=lambda i: (*batch(i), i))


def test_manual_decay_written_after_the_optimizer_step():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            for g in w.opt.param_groups:
                g["lr"] *= 0.9
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


# --------------------------------------------------------------------------- .item() in Python


def test_branch_on_loss_item():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            if loss.item() > 1.0:
                loss = loss * 0.5
                w.log.append("halved")
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step

    def args(i):
        x, y, labels = batch(i)
        return x, y * (3.0 if FLAGS[i] else 0.3), labels
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"]), make, args=args)


def nan_args(i):
    x, y, labels = batch(i)
    if i in (6, 9):
        y[1, 1] = float("nan") if i == 6 else float("inf")
    return x, y, labels


@pytest.mark.parametrize("opt_name", ["adam"])
def test_nan_loss_skipped_before_backward(opt_name):
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            if not math.isfinite(loss.item()):
                w.log.append("skip")
                return None
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS[opt_name]), make, args=nan_args)


def test_nonfinite_gradients_skip_the_step():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in w.model.parameters())
            if finite:
                w.opt.step()
            return loss.item(), finite
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make, args=nan_args)


def test_nan_raises_after_backward():
    """Raising after backward: eager leaves the new .grad set and the parameters unchanged."""
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            if torch.isnan(loss):
                raise FloatingPointError("nan loss")
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make, args=nan_args)


def test_stats_dict_returned():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            out = w.model(x)
            loss = F.cross_entropy(out, labels)
            loss.backward()
            w.opt.step()
            acc = (out.argmax(1) == labels).float().mean().item()
            return {"loss": loss.item(), "acc": acc, "lr": w.opt.param_groups[0]["lr"],
                    "gnorm": sum(p.grad.norm().item() ** 2 for p in w.model.parameters()) ** 0.5}
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


@pytest.mark.parametrize("ret", ["tensor", "detached"])
def test_loss_tensor_returned(ret):
    run(world(opt=OPTIMIZERS["adam"]), mse_step(ret=ret))


# --------------------------------------------------------------------------- autograd in the step


def test_autograd_grad_written_into_dot_grad():
    def make(w):
        def train_step(x, y, labels):
            params = list(w.model.parameters())
            loss = F.mse_loss(w.model(x), y)
            grads = torch.autograd.grad(loss, params)
            for p, g in zip(params, grads):
                p.grad = g
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_autograd_grad_allow_unused():
    def make(w):
        def train_step(x, y, labels, use_b):
            params = list(w.model.parameters())
            loss = F.mse_loss(w.model(x, use_b), y)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = g
            w.opt.step()
            return loss.item(), [g is None for g in grads]
        return train_step
    run(world(model=TwoHeads, opt=OPTIMIZERS["sgd_momentum_dampening"]), make, args=lambda i: (*batch(i), FLAGS[i]))


def test_retain_graph_and_second_backward():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            out = w.model(x)
            loss = F.mse_loss(out, y)
            loss.backward(retain_graph=True)
            (0.1 * out.abs().mean()).backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_two_backward_calls_two_forwards():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            l1 = F.mse_loss(w.model(x), y)
            l1.backward()
            l2 = F.cross_entropy(w.model(x * 0.5), labels)
            l2.backward()
            w.opt.step()
            return l1.item() + l2.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_loss_with_detached_parts():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            out = w.model(x)
            target = (0.5 * y + 0.5 * out.detach())          # bootstrapped target
            scale = out.detach().abs().mean()
            loss = F.mse_loss(out, target) / (1 + scale)
            loss.backward()
            w.opt.step()
            return loss.item(), scale.item()
        return train_step
    run(world(opt=OPTIMIZERS["sgd_nesterov_wd"]), make)


def test_gradient_penalty_create_graph():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            x = x.requires_grad_(True)
            out = w.model(x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = F.mse_loss(out, y) + 0.1 * gx.pow(2).sum(1).mean()
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_adversarial_example_from_input_grad():
    """FGSM: a first backward for the input's gradient, zero_grad, a second on the perturbed batch."""
    def make(w):
        def train_step(x, y, labels):
            x = x.clone().requires_grad_(True)
            w.opt.zero_grad()
            F.cross_entropy(w.model(x), labels).backward()
            x_adv = (x + 0.1 * x.grad.sign()).detach()
            w.opt.zero_grad()
            loss = F.cross_entropy(w.model(x_adv), labels)
            loss.backward()
            w.opt.step()
            return loss.item(), x_adv
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_backward_with_inputs_argument():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward(inputs=list(w.model[2].parameters()))
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_gradient_edited_before_step():
    """Gradients scaled, noised (RNG), replaced and dropped by hand between backward and step."""
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            m = w.model
            m[0].weight.grad /= 2
            m[0].bias.grad.add_(torch.randn_like(m[0].bias.grad) * 0.01)
            m[2].weight.grad = m[2].weight.grad * 3
            m[2].bias.grad = None
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_old_gradient_read_in_the_step():
    """The step keeps last step's gradient (dropped by zero_grad) and compares it with the new one."""
    def make(w):
        def train_step(x, y, labels):
            old = w.model[0].weight.grad
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            cos = None if old is None else F.cosine_similarity(old.flatten(), w.model[0].weight.grad.flatten(), 0).item()
            w.opt.step()
            return loss.item(), cos
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_kept_across_steps(set_to_none):
    """Each step stores p.grad itself in the log (with set_to_none=False it is the same tensor,
    zeroed and re-accumulated in place by every later step)."""
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            w.log.append(w.model[2].weight.grad)
            return w.model[0].bias.grad
        return train_step
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"]), make)


@pytest.mark.parametrize("opt_name", ["adam"])
def test_optimizer_state_tensor_returned(opt_name):
    """The step returns live state tensors (updated in place by every later step in eager)."""
    key = {"adam": "exp_avg", "sgd_momentum_dampening": "momentum_buffer", "rmsprop_centered_momentum": "grad_avg"}[opt_name]

    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            st = w.opt.state[w.model[0].weight]
            return st[key], st.get("step"), w.model[2].bias
        return train_step
    run(world(opt=OPTIMIZERS[opt_name]), make)


def test_grad_of_non_contiguous_and_expanded_parameters():
    """A transposed parameter and one used only through .sum() (autograd's expanded ones)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.wt = nn.Parameter(torch.randn(3, 5).t())     # (5, 3), strides (1, 5)
            self.s = nn.Parameter(torch.randn(4, 3))
            self.b = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return x @ self.wt + self.b + 0.01 * self.s.sum()
    run(world(model=M, opt=OPTIMIZERS["adam"]), mse_step())
    run(world(model=M, opt=OPTIMIZERS["sgd"]), mse_step(set_to_none=False))


def test_two_parameters_one_gradient():
    """``a + b``: autograd hands one tensor to both; each .grad must be its own tensor."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3))
            self.b = nn.Parameter(torch.randn(3))
            self.lin = nn.Linear(5, 3)

        def forward(self, x):
            return self.lin(x) + (self.a + self.b)

    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(w.model.parameters(), 0.1)
            w.opt.step()
            return loss.item()
        return train_step
    run(world(model=M, opt=OPTIMIZERS["sgd_momentum_dampening"]), make)


# --------------------------------------------------------------------------- modules in the step


def bn_dropout():
    return nn.Sequential(nn.Linear(5, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.3), nn.Linear(12, 3))


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening"])
def test_batchnorm_dropout_train_mode(opt_name):
    run(world(model=bn_dropout, opt=OPTIMIZERS[opt_name]), mse_step())


MODES = ["train", "train", "train", "train", "eval", "train", "eval", "eval", "train", "train", "eval", "train"]


def train_or_eval_step(w):
    def step(x, y, labels, mode):
        if mode == "eval":
            w.model.eval()
            with torch.no_grad():
                out = w.model(x)
                loss = F.mse_loss(out, y)
            w.model.train()
            return loss.item(), out
        w.opt.zero_grad()
        loss = F.mse_loss(w.model(x), y)
        loss.backward()
        w.opt.step()
        return loss.item(), None
    return step


def test_eval_steps_interleaved_same_function():
    run(world(model=bn_dropout, opt=OPTIMIZERS["adam"]), train_or_eval_step,
        args=lambda i: (*batch(i), MODES[i]))


def test_eval_steps_interleaved_separate_optimized_function():
    """An optimized eval function (model.eval() / no_grad inside) called between training steps
    (outside the optimized training step; the eager world's eval function stays eager)."""
    made = []

    def make_step(w):
        ev = train_or_eval_step(w)
        w.eval_fn = specularch.optimize(ev) if made else ev  # make_step(eager world) runs first
        made.append(w)
        return mse_step()(w)

    def after(w, i, result):
        w.log.append(w.eval_fn(*batch(50 + i), "eval"))
    run(world(model=bn_dropout, opt=OPTIMIZERS["adam"]), make_step, after=after)


def test_eval_mode_toggled_between_steps():
    def between(w, i):
        w.model.train(MODES[i] == "train")
    run(world(model=bn_dropout, opt=OPTIMIZERS["adam"]), mse_step(), between=between)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.emb(tokens))))


def token_batch(i):
    g = torch.Generator().manual_seed(200 + i)
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening", "nadam"])
def test_weight_tying(opt_name):
    def make(w):
        def train_step(tokens, targets):
            w.opt.zero_grad()
            logits = w.model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
            w.opt.step()
            return loss.item()
        return train_step
    run(world(model=Tied, opt=OPTIMIZERS[opt_name]), make, args=token_batch)


def test_shared_module_applied_twice():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(5, 8)
            self.block = nn.Linear(8, 8)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            h = torch.tanh(self.block(h))
            h = torch.tanh(self.block(h))
            return self.out(h)
    run(world(model=M, opt=OPTIMIZERS["adam"]), mse_step())


@pytest.mark.parametrize("opt_name", ["adam"])
def test_autocast_bfloat16_forward(opt_name):
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = w.model(x)
                loss = F.mse_loss(out.float(), y)
            loss.backward()
            w.opt.step()
            return loss.item(), out.dtype
        return train_step
    run(world(opt=OPTIMIZERS[opt_name]), make)


def test_autocast_with_cross_entropy_and_batchnorm():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            with torch.amp.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(w.model(x), labels)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(model=bn_dropout, opt=OPTIMIZERS["adamw_amsgrad"]), make)


def test_ema_model_updated_in_the_step():
    import copy

    def make():
        m = mlp()
        return World(model=m, ema=copy.deepcopy(m).requires_grad_(False), opt=O.Adam(m.parameters(), lr=1e-2), log=[])

    def make_step(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            with torch.no_grad():
                for pe, p in zip(w.ema.parameters(), w.model.parameters()):
                    pe.mul_(0.9).add_(p, alpha=0.1)
            return loss.item()
        return train_step

    def after(w, i, result):
        w.log.append([p.clone() for p in w.ema.parameters()])
    run(make, make_step, after=after)


def test_weight_clamped_after_step():
    """WGAN-style weight clipping and max-norm renormalisation under no_grad after step()."""
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            with torch.no_grad():
                for p in w.model[0].parameters():
                    p.clamp_(-0.3, 0.3)
                w.model[2].weight.data = torch.renorm(w.model[2].weight.data, 2, 0, 0.5)
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["rmsprop_maximize"]), make)


def test_lstm_sequence_model():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(5, 7, batch_first=True)
            self.out = nn.Linear(7, 3)

        def forward(self, x):
            h, _ = self.lstm(x)
            return self.out(h[:, -1])

    def args(i):
        g = torch.Generator().manual_seed(300 + i)
        return torch.randn(4, 6, 5, generator=g), torch.randn(4, 3, generator=g), None
    run(world(model=M, opt=OPTIMIZERS["adam"]), clip_step(CLIPS["norm"]), args=args)


def test_small_cnn_channels_last():
    def model():
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).to(memory_format=torch.channels_last)

    def args(i):
        g = torch.Generator().manual_seed(400 + i)
        return torch.randn(3, 2, 6, 6, generator=g).to(memory_format=torch.channels_last), torch.randn(3, 3, generator=g), None
    run(world(model=model, opt=OPTIMIZERS["sgd_nesterov_wd"]), mse_step(set_to_none=False), args=args)


def test_transformer_encoder_layer_with_dropout():
    def model():
        return nn.Sequential(nn.Linear(5, 8), nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True),
                             nn.Linear(8, 3))

    def args(i):
        g = torch.Generator().manual_seed(500 + i)
        return torch.randn(2, 4, 5, generator=g), torch.randn(2, 4, 3, generator=g), None
    run(world(model=model, opt=OPTIMIZERS["adamw_maximize"]), mse_step(), args=args)


def test_weight_norm_parametrization():
    def model():
        m = mlp()
        nn.utils.parametrizations.weight_norm(m[0])
        return m
    run(world(model=model, opt=OPTIMIZERS["adam"]), mse_step())


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            h = checkpoint(w.model[:2], x, use_reentrant=False)
            loss = F.mse_loss(w.model[2](h), y)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


def test_float64_model():
    def args(i):
        return tuple(t.double() if t.is_floating_point() else t for t in batch(i))
    run(world(model=lambda: mlp().double(), opt=OPTIMIZERS["nadam"]), mse_step(), args=args)


BATCH_SIZES = [6, 6, 6, 6, 4, 6, 9, 2, 6, 5, 6, 3]


@pytest.mark.parametrize("opt_name", ["adam"])
def test_varying_batch_size(opt_name):
    run(world(model=bn_dropout, opt=OPTIMIZERS[opt_name]), mse_step(), args=lambda i: batch(i, n=BATCH_SIZES[i]))


def test_batchnorm_batch_of_one_raises():
    run(world(model=bn_dropout, opt=OPTIMIZERS["adam"]), mse_step(),
        args=lambda i: batch(i, n=1 if i in (5, 8) else 6))


# --------------------------------------------------------------------------- more optimizer usage


def test_named_parameters_optimizer():
    run(world(opt=lambda ps: None, nopt=None), lambda w: _named(w))


def _named(w):
    if w.opt is None:
        w.opt = O.Adam(w.model.named_parameters(), lr=1e-2)
    return mse_step()(w)


def test_two_optimizers_gan_style():
    def make():
        m = nn.ModuleDict({"g": nn.Linear(4, 5), "d": nn.Sequential(nn.Linear(5, 6), nn.LeakyReLU(0.2), nn.Linear(6, 1))})
        return World(model=m, opt=[O.Adam(m["g"].parameters(), lr=1e-2, betas=(0.5, 0.9)),
                                   O.SGD(m["d"].parameters(), lr=0.05, momentum=0.9)], log=[])

    def make_step(w):
        og, od = w.opt
        G, D = w.model["g"], w.model["d"]

        def train_step(x, y, labels):
            z = y[:, :2].repeat(1, 2)
            od.zero_grad()
            fake = G(z)
            d_loss = F.softplus(D(fake.detach())).mean() + F.softplus(-D(x)).mean()
            d_loss.backward()
            od.step()
            og.zero_grad()
            g_loss = F.softplus(-D(fake)).mean()
            g_loss.backward()
            og.step()
            return d_loss.item(), g_loss.item()
        return train_step
    run(make, make_step)


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening"])
def test_two_optimizer_steps_in_one_call(opt_name):
    def make(w):
        def train_step(x, y, labels):
            for _ in range(2):
                w.opt.zero_grad()
                loss = F.mse_loss(w.model(x), y)
                loss.backward()
                w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS[opt_name]), make)


def test_optimizer_step_hook_registered_between_steps():
    def between(w, i):
        if i == 6:
            w.opt.register_step_post_hook(lambda o, a, k: w.log.append(o.param_groups[0]["lr"]))
    run(world(opt=OPTIMIZERS["adam"]), mse_step(), between=between)


def test_forward_hook_registered_between_steps():
    def between(w, i):
        if i == 6:
            w.model[1].register_forward_hook(lambda mod, inp, out: out * 0.5)
    run(world(opt=OPTIMIZERS["adam"]), mse_step(), between=between)


def test_tensor_learning_rate():
    run(world(opt=lambda ps: O.Adam(ps, lr=torch.tensor(0.01))), mse_step())


def test_sparse_embedding_sparse_adam():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6, sparse=True)

        def forward(self, tokens):
            return self.emb(tokens).sum(-1)

    def make():
        m = M()
        return World(model=m, opt=O.SparseAdam(list(m.parameters()), lr=1e-2), log=[])

    def make_step(w):
        def train_step(tokens, targets):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(tokens), targets.float())
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(make, make_step, args=token_batch)


def test_lbfgs_with_closure():
    def make(w):
        def train_step(x, y, labels):
            def closure():
                w.opt.zero_grad()
                loss = F.mse_loss(w.model(x), y)
                loss.backward()
                return loss
            return w.opt.step(closure).item()
        return train_step
    run(world(opt=lambda ps: O.LBFGS(ps, lr=0.5, max_iter=4, history_size=3)), make)


def test_lbfgs_optimized_closure():
    """Only the closure is optimized (one function reading the batch from the world); LBFGS.step
    runs eagerly and calls it several times per step."""
    made = []

    def make_world():
        w = world(opt=lambda ps: O.LBFGS(ps, lr=0.5, max_iter=4, history_size=3))()

        def closure():
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(w.x), w.y)
            loss.backward()
            return loss
        w.closure = specularch.optimize(closure) if made else closure  # the eager world is made first
        made.append(w)
        return w

    def make_step(w):
        def train_step(x, y, labels):
            w.x, w.y = x, y
            return w.opt.step(w.closure).item()
        return train_step
    report = run(make_world, make_step, report_of=lambda w: w.closure)
    assert report.stats.graph_hits > 0


def test_grad_scaler_cpu():
    def make():
        w = world(opt=OPTIMIZERS["sgd_momentum_dampening"])()
        w.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=3)
        return w

    def make_step(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            w.scaler.scale(loss).backward()
            w.scaler.unscale_(w.opt)
            nn.utils.clip_grad_norm_(w.model.parameters(), 1.0)
            w.scaler.step(w.opt)
            w.scaler.update()
            return loss.item(), w.scaler.get_scale()
        return train_step
    run(make, make_step, args=nan_args)


# --------------------------------------------------------------------------- reduced precision

LOWP = {
    "sgd": ("bf16", OPTIMIZERS["sgd"], None),
    "sgd_momentum": ("bf16", OPTIMIZERS["sgd_momentum_dampening"], None),
    "adam_default_betas": ("bf16", OPTIMIZERS["adam"], None),  # 0.999 rounds to 1.0: same bits by luck
    "adam_betas": ("bf16", lambda ps: O.Adam(ps, lr=1e-2, betas=(0.7, 0.9)), None),
    "adam_amsgrad_betas": ("bf16", lambda ps: O.Adam(ps, lr=1e-2, betas=(0.7, 0.9), amsgrad=True), None),
    "rmsprop": ("bf16", OPTIMIZERS["rmsprop_maximize"], None),
    "adadelta": ("bf16", OPTIMIZERS["adadelta"], None),
    "radam": ("bf16", OPTIMIZERS["radam"], None),
    "fp16_sgd_momentum": ("fp16", OPTIMIZERS["sgd_momentum_dampening"], None),
    "fp16_adam": ("fp16", OPTIMIZERS["adam"], None),
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _lowp_args(dtype):
    return lambda i: tuple(t.to(dtype) if t.is_floating_point() else t for t in batch(i))


@pytest.mark.parametrize("name", list(LOWP))
def test_reduced_precision_parameters(name):
    dt, opt, _ = LOWP[name]
    dtype = _DTYPES[dt]
    run(world(model=lambda: mlp().to(dtype), opt=opt), mse_step(), args=_lowp_args(dtype))


def test_bf16_hand_written_momentum():
    """SGD with momentum written by hand, buffers in a dict on the world."""
    def make(w):
        def train_step(x, y, labels):
            w.model.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            with torch.no_grad():
                for name, p in w.model.named_parameters():
                    if name not in w.bufs:
                        w.bufs[name] = p.grad.clone()
                    else:
                        w.bufs[name].mul_(0.9).add_(p.grad)
                    p.add_(w.bufs[name], alpha=-0.05)
            return loss.item()
        return train_step
    run(world(model=lambda: mlp().bfloat16(), opt="none", bufs=dict), make, args=_lowp_args(torch.bfloat16))


def test_bf16_ema_of_parameters():
    import copy

    def make_world():
        m = mlp().bfloat16()
        return World(model=m, ema=copy.deepcopy(m).requires_grad_(False), opt=O.SGD(m.parameters(), lr=0.1), log=[])

    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            with torch.no_grad():
                for pe, p in zip(w.ema.parameters(), w.model.parameters()):
                    pe.mul_(0.9).add_(p, alpha=0.1)
            return loss.item()
        return train_step

    def after(w, i, r):
        w.log.append([p.clone() for p in w.ema.parameters()])
    run(make_world, make, args=_lowp_args(torch.bfloat16), after=after)


def test_bf16_hand_written_sgd():
    def make(w):
        def train_step(x, y, labels, lr):
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in w.model.parameters():
                    p -= lr * p.grad
                    p.grad.zero_()
            return loss.item()
        return train_step
    lowp = _lowp_args(torch.bfloat16)
    run(world(model=lambda: mlp().bfloat16(), opt="none"), make, args=lambda i: (*lowp(i), 0.1 / (1 + i)))


# --------------------------------------------------------------------------- early release of old gradients



def _bad_token_args(i):
    t, y = token_batch(i)
    if i in (6, 9):
        t[0, 0] = 50
    return t, y


@pytest.mark.parametrize("check", ["is_not_none", "is_none"])
def test_grad_presence_read_before_zero_grad_then_graph_raises(check):
    def make(w):
        def train_step(tokens, targets):
            if check == "is_not_none":
                if w.model.mix.weight.grad is not None:
                    w.log.append("had grad")
            elif w.model.mix.weight.grad is None:
                w.log.append("first step")
            w.opt.zero_grad()
            loss = F.cross_entropy(w.model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(model=Tied, opt=OPTIMIZERS["sgd_momentum_dampening"]), make, args=_bad_token_args)


def test_graph_raises_in_forward_after_zero_grad():
    run(world(model=Tied, opt=OPTIMIZERS["sgd_momentum_dampening"]), _tokens_step, args=_bad_token_args)


def _tokens_step(w):
    def train_step(tokens, targets):
        w.opt.zero_grad()
        loss = F.cross_entropy(w.model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        w.opt.step()
        return loss.item()
    return train_step


BAD_INDEX = lambda i: torch.tensor([1, 99 if i in (6, 9) else 2])  # noqa: E731


@pytest.mark.parametrize("where", ["after_backward", "after_step"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_graph_raises_after_backward_or_step(where, set_to_none):
    """An index error after backward (eager keeps the new .grad) or after step() (eager keeps
    the update too)."""
    def make(w):
        def train_step(x, y, labels, idx):
            w.opt.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            if where == "after_backward":
                w.log.append(w.model[0].weight.grad.index_select(0, idx).sum().item())
            w.opt.step()
            if where == "after_step":
                w.log.append(loss.item())
                return w.model[0].weight.index_select(0, idx)
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make, args=lambda i: (*batch(i), BAD_INDEX(i)))


# --------------------------------------------------------------------------- numbers of other types



@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening", "adam"])
def test_numpy_learning_rate_between_steps(opt_name):
    import numpy as np
    lrs = np.linspace(0.001, 0.1, STEPS)

    def between(w, i):
        w.opt.param_groups[0]["lr"] = lrs[i]
    run(world(opt=OPTIMIZERS[opt_name]), mse_step(), between=between)


def test_numpy_betas():
    import numpy as np

    def between(w, i):
        w.opt.param_groups[0]["betas"] = (np.float32(0.9), np.float64(0.99)) if i >= 2 else (0.9, 0.99)
    run(world(opt=OPTIMIZERS["nadam"]), mse_step(), between=between)


def test_numpy_learning_rate_radam():
    import numpy as np

    def between(w, i):
        w.opt.param_groups[0]["lr"] = np.float32(0.01 * (1 + i % 3))
    run(world(opt=OPTIMIZERS["radam"]), mse_step(), between=between)


# --------------------------------------------------------------------------- objects changed between steps


class TwoSame(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.l1, self.l2, self.out = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.l2(torch.tanh(self.l1(torch.tanh(self.inp(x)))))))


def _swap_params(w, i):
    if i == 6:
        ps = w.opt.param_groups[0]["params"]
        ps[2], ps[4] = ps[4], ps[2]


def _group_param_replaced(w, i):
    if i == 6:  # a user bug: l1.weight is no longer optimized, l2.weight is listed twice
        w.opt.param_groups[0]["params"][2] = w.model.l2.weight


def _model_param_replaced(w, i):
    if i == 6:  # the optimizer keeps updating the old tensor
        w.model.l1.weight = nn.Parameter(torch.full((8, 8), 0.1))


def _data_replaced(w, i):
    if i == 6:
        w.model.l1.weight.data = torch.full((8, 8), 0.1)
    if i == 9:
        w.model.l1.weight.data = torch.randn(8, 8, generator=torch.Generator().manual_seed(5)).t()


def _state_replaced(w, i):
    if i == 6:
        for st in w.opt.state.values():
            st["exp_avg"] = torch.zeros_like(st["exp_avg"])
            st["step"] = torch.tensor(100.0)
    if i == 8:
        for st in w.opt.state.values():
            st["step"] = st["step"].double()


def _hyper_flips(w, i):
    g = w.opt.param_groups[0]
    if i == 5:
        g["eps"], g["weight_decay"] = 1e-3, 0.1
    if i == 8:
        g["maximize"], g["amsgrad"] = True, False


@pytest.mark.parametrize("change", [_swap_params, _group_param_replaced, _model_param_replaced, _data_replaced,
                                    _state_replaced, _hyper_flips], ids=lambda f: f.__name__.strip("_"))
def test_objects_changed_between_steps(change):
    opt = {_group_param_replaced: OPTIMIZERS["sgd"],
           _hyper_flips: lambda ps: O.Adam(ps, lr=1e-2, amsgrad=True)}.get(change, OPTIMIZERS["adam"])
    run(world(model=TwoSame, opt=opt), mse_step(), between=change)


@pytest.mark.parametrize("flip", [("sgd_nesterov_wd", "nesterov", False), ("rmsprop_centered_momentum", "alpha", 0.5),
                                  ("adadelta", "rho", 0.5), ("adagrad", "lr_decay", 0.5),
                                  ("nadam", "momentum_decay", 0.1), ("radam", "decoupled_weight_decay", True)],
                         ids=lambda f: f"{f[0]}-{f[1]}")
def test_hyperparameter_changed_between_steps(flip):
    name, key, value = flip

    def between(w, i):
        if i == 6:
            w.opt.param_groups[0][key] = value
    run(world(opt=OPTIMIZERS[name]), mse_step(), between=between)


@pytest.mark.parametrize("change", ["untie", "tie"])
def test_weight_tying_changed_between_steps(change):
    class Untied(Tied):
        def __init__(self):
            super().__init__()
            self.out.weight = nn.Parameter(self.emb.weight.detach().clone())

    def between(w, i):
        if i == 6 and change == "untie":
            w.model.out.weight = nn.Parameter(w.model.emb.weight.detach().clone())
            w.opt.add_param_group({"params": [w.model.out.weight]})
        if i == 6 and change == "tie":
            w.model.out.weight = w.model.emb.weight
    run(world(model=Tied if change == "untie" else Untied, opt=OPTIMIZERS["adam"]), _tokens_step,
        args=token_batch, between=between)


def test_gradient_set_by_hand_on_frozen_parameter():
    def between(w, i):
        if i == 6:
            w.model[0].weight.grad = torch.full_like(w.model[0].weight, 0.5)
    run(world(model=frozen_first_layer, opt=OPTIMIZERS["adam"]), lambda w: _no_zero(w), between=between)


def test_one_parameter_in_two_optimizers():
    def make():
        m = mlp()
        return World(model=m, opt=[O.SGD(m.parameters(), lr=0.05, momentum=0.9), O.Adam(m[2].parameters(), lr=1e-2)], log=[])

    def make_step(w):
        a, b = w.opt

        def train_step(x, y, labels):
            a.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            a.step()
            b.step()
            return loss.item()
        return train_step
    run(make, make_step)


# --------------------------------------------------------------------------- models and optimizers as arguments


PICK = [0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0]


@pytest.mark.parametrize("opt_cls", [O.Adam, O.SGD], ids=["adam", "sgd_momentum"])
def test_alternating_models_as_arguments(opt_cls):
    """One optimized step function trains two models in turn (the second's state is created
    after the capture)."""
    kw = dict(lr=1e-2) if opt_cls is O.Adam else dict(lr=0.05, momentum=0.9)

    def make():
        a, b = mlp(), mlp()
        return World(model=nn.ModuleList([a, b]), opt=[opt_cls(a.parameters(), **kw), opt_cls(b.parameters(), **kw)], log=[])

    def make_step(w):
        def train_step(model, opt, x, y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
        return train_step
    run(make, make_step, args=lambda i, w: (w.model[PICK[i]], w.opt[PICK[i]], *batch(i)[:2]))


def test_optimized_input_passed_as_argument():
    """Style-transfer like: the optimizer's parameter is the argument; calls 7 and 9 pass
    another leaf (which gets the gradient, while the optimizer's own has none)."""
    def make():
        m = mlp().requires_grad_(False)
        img = torch.randn(6, 5).requires_grad_(True)
        return World(model=m, img=img, other=torch.randn(6, 5).requires_grad_(True), opt=O.Adam([img], lr=0.05),
                     extra_params=[img], log=[])

    def make_step(w):
        def train_step(img, y):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(img), y)
            loss.backward()
            w.opt.step()
            return loss.item(), w.other.grad
        return train_step
    run(make, make_step, args=lambda i, w: ((w.other if i in (7, 9) else w.img), batch(i)[1]))


# --------------------------------------------------------------------------- flat buffers


def _flat_world(kind, opt):
    def make():
        m = mlp()
        flat = torch.zeros(sum(p.numel() for p in m.parameters()))
        off = 0
        for p in m.parameters():
            view = flat[off:off + p.numel()].view_as(p)
            if kind == "grads":
                p.grad = view
            else:
                view.copy_(p.detach())
                p.data = view
            off += p.numel()
        return World(model=m, flat=flat, opt=opt(m.parameters()), log=[])
    return make


@pytest.mark.parametrize("kind", ["grads", "params"])
def test_flat_buffer_views(kind):
    """Every .grad (or every parameter) is a view of one flat buffer, as gradient buckets do."""
    def make_step(w):
        def train_step(x, y, labels):
            w.opt.zero_grad(set_to_none=kind == "params")
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(w.model.parameters(), 0.5)
            w.opt.step()
            return loss.item(), w.flat.norm().item()
        return train_step

    def after(w, i, r):
        w.log.append(w.flat.clone())
    run(_flat_world(kind, OPTIMIZERS["adam"]), make_step, after=after)


# --------------------------------------------------------------------------- more steps


def test_custom_optimizer_subclass():
    class MySGD(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1, momentum=0.9):
            super().__init__(params, dict(lr=lr, momentum=momentum))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if "buf" not in st:
                        st["buf"] = p.grad.clone()
                    else:
                        st["buf"].mul_(g["momentum"]).add_(p.grad)
                    p.add_(st["buf"], alpha=-g["lr"])
    run(world(model=TwoHeads, opt=lambda ps: MySGD(ps, lr=0.05)), heads_step(), args=lambda i: (*batch(i), FLAGS[i]))


def test_validation_after_the_step():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            with torch.no_grad():
                val = F.mse_loss(w.model(x), y)
            return loss.item(), val.item(), w.model[0].weight.data, w.model[0].bias.grad[1:]
        return train_step
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"]), make)


def test_lr_from_loss_item_written_after_step():
    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.mse_loss(w.model(x), y)
            loss.backward()
            w.opt.step()
            for g in w.opt.param_groups:
                g["lr"] = 0.01 * min(1.0, loss.item())
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["adam"]), make)


@pytest.mark.parametrize("opt_name", ["radam"])
def test_large_parameters_replayed_in_program_order(opt_name):
    """Tensors of 1 MiB and more: the commit replays the update op by op."""
    def model():
        return nn.Sequential(nn.Linear(5, 600), nn.Tanh(), nn.Linear(600, 450), nn.Tanh(), nn.Linear(450, 3))
    run(world(model=model, opt=OPTIMIZERS[opt_name]), mse_step(), steps=6)


def test_batchnorm_cumulative_average_and_gru_dropout():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(5, 6, num_layers=2, dropout=0.3, batch_first=True)
            self.bn = nn.BatchNorm1d(6, momentum=None)
            self.out = nn.Linear(6, 3)

        def forward(self, x):
            return self.out(self.bn(self.rnn(x)[0][:, -1]))

    def args(i):
        g = torch.Generator().manual_seed(300 + i)
        return torch.randn(4, 3 + i % 3, 5, generator=g), torch.randn(4, 3, generator=g), None
    run(world(model=M, opt=OPTIMIZERS["adam"]), mse_step(), args=args)


def test_cross_entropy_all_targets_ignored():
    """Steps 5 and 8 ignore every target: the loss is NaN and so are the updates."""
    def args(i):
        x, y, labels = batch(i)
        return x, y, torch.full_like(labels, -100) if i in (5, 8) else labels

    def make(w):
        def train_step(x, y, labels):
            w.opt.zero_grad()
            loss = F.cross_entropy(w.model(x), labels, label_smoothing=0.1)
            loss.backward()
            w.opt.step()
            return loss.item()
        return train_step
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"]), make, args=args)


CONTEXTS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
            "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_called_inside_a_context(name):
    """Calls 5, 6 and 9 run inside no_grad / inference_mode (eager's backward raises) or autocast."""
    ctx = CONTEXTS[name]
    run(world(opt=OPTIMIZERS["adam"]), mse_step(), context=lambda i: ctx() if i in (5, 6, 9) else contextlib.nullcontext())


ITERS = [2, 3, 2, 2, 4, 1, 3, 5, 2, 3, 1, 4]


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening", "rmsprop_centered_momentum", "adam"])
def test_several_optimizer_steps_in_one_call(opt_name):
    """An inner loop of n full steps (n varies per call); Adam reads its step count: falls back."""
    def make(w):
        def train_inner(x, y, labels, n):
            for _ in range(n):
                w.opt.zero_grad()
                loss = F.mse_loss(w.model(x), y)
                loss.backward()
                w.opt.step()
            return loss.item()
        return train_inner
    run(world(opt=OPTIMIZERS[opt_name]), make, args=lambda i: (*batch(i), ITERS[i]))


def test_epoch_over_a_list_of_batches():
    def make(w):
        def train_epoch(batches):
            total = 0.0
            for x, y in batches:
                w.opt.zero_grad()
                loss = F.mse_loss(w.model(x), y)
                loss.backward()
                w.opt.step()
                total += loss.item()
            return total
        return train_epoch
    run(world(opt=OPTIMIZERS["sgd_nesterov_wd"]), make, args=lambda i: ([batch(10 * i + k)[:2] for k in range(ITERS[i])],))


def test_train_until_loss_below_threshold():
    def make(w):
        def train_inner(x, y, labels, thr):
            k = 0
            for k in range(6):
                w.opt.zero_grad()
                loss = F.mse_loss(w.model(x), y)
                loss.backward()
                w.opt.step()
                if loss.item() < thr:
                    break
            return k, loss.item()
        return train_inner
    run(world(opt=OPTIMIZERS["sgd_momentum_dampening"]), make, args=lambda i: (*batch(i), [1.0, 0.9, 1.2, 0.8][i % 4]))


_EMPTY_VERSION = ("the .grad of a zero-element parameter shares its version counter with the "
                  "parameter from the first graph call on (eager: the gradient's own counter, at 1); "
                  "values are right (every empty storage has data_ptr 0: something keyed by storage "
                  "takes one for the other)")


@pytest.mark.xfail(strict=True, reason=_EMPTY_VERSION)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_empty_parameter(opt_name):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Parameter(torch.zeros(0))
            self.a = nn.Linear(5, 3)

        def forward(self, x):
            return self.a(x) + self.e.sum()
    run(world(model=M, opt=OPTIMIZERS[opt_name]), mse_step())


def test_mixed_dtype_parameters():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 8)
            self.b = nn.Linear(8, 3).double()

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).double()).float()
    run(world(model=M, opt=OPTIMIZERS["rmsprop_centered_momentum"]), mse_step())


@pytest.mark.parametrize("opt_name", ["sgd_nesterov_wd", "adamw_amsgrad", "nadam"])
def test_optimize_exact_flag(opt_name):
    """``optimize(step, exact=True)`` (rather than ``templates="exact"``), with clipping."""
    run(world(opt=OPTIMIZERS[opt_name]), clip_step(CLIPS["norm"]), optimize_kw={"exact": True})
