"""A differential sweep of whole training steps optimized as functions in the default
(tiered) mode with TorchScript's candidate forced kept: each case builds two identical
(model, optimizer[, scheduler]) pairs, optimizes ONE step function (``zero_grad``, forward,
loss, ``backward``, ``optimizer.step()``, Python numbers returned) and leaves the twin
eager, runs both on the same seeded batches and compares after every step what the step
returns (values and exact types), every parameter and ``.grad`` (``None``-ness too), the
buffers, ``optimizer.state_dict()`` (state tensors and param groups), the scheduler's
state and the global RNG state; at the end every graph runs on ``torchscript``, kept."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch

from promotion import StepTwins, assert_promoted

STEPS = 25
O = torch.optim


# --------------------------------------------------------------------------- models


def _mlp():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _dropout_mlp():
    return nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Dropout(0.3), nn.Linear(12, 3))


def _bn_mlp(bias=True):
    return nn.Sequential(nn.Linear(5, 8, bias=bias), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batch(step, n=6):
    """The step's batch: inputs, regression targets and class labels (own generator)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g), torch.randint(0, 3, (n,), generator=g)


def _mse_step(set_to_none=True):
    def make(model, opt):
        def train_step(x, y, labels):
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
        return train_step
    return make


def _check(twins, steps=STEPS, cold=0):
    twins.run([_batch(i) for i in range(steps)])
    assert_promoted(twins.steps[1], cold=cold)


# --------------------------------------------------------------------------- optimizers


OPTIMIZERS = {
    "sgd_nesterov_wd": lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda ps: O.Adam(ps, lr=1e-2),
    "adamw": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda ps: O.Adam(ps, lr=1e-2, amsgrad=True),
    "rmsprop_centered_momentum": lambda ps: O.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "adagrad": lambda ps: O.Adagrad(ps, lr=0.1),
    "adadelta": lambda ps: O.Adadelta(ps, lr=1.0),
    "nadam": lambda ps: O.NAdam(ps, lr=2e-2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_step(promoted, name):
    """A plain MSE step with each optimizer, one graph each, promoted."""
    _check(StepTwins(_mlp, OPTIMIZERS[name], _mse_step()))


def test_radam_rectification_branch_flips(promoted):
    """RAdam decides on the step count whether to rectify (``rho_t > 5``, true from step 6
    with beta2 0.999): a guard on it recompiles once, two graphs. The first (steps 1-5:
    3 profiled calls, then 2 runs) can never get hot (3 runs) and stays on ``fx``, "not hot
    enough to compile in the background" (documented: tiering/policy.py); the second is
    promoted. The values are eager's on both."""
    twins = StepTwins(_mlp, lambda ps: O.RAdam(ps, lr=1e-2), _mse_step())
    _check(twins, cold=1)
    report = specularch.explain(twins.steps[1])
    assert len(report.graphs) == 2 and report.graphs[0].hits == 2, report


SCHEDULERS = {
    # StepLR halves the learning rate every 5 steps
    "sgd_step_lr": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.5),
                    lambda o: O.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)),
    # OneCycleLR changes the learning rate and cycles Adam's betas[0] every step
    "adam_one_cycle": (lambda ps: O.Adam(ps, lr=1e-2),
                       lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=STEPS + 5)),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_stepped_between_calls(promoted, name):
    """A scheduler stepped between calls: the new lr (betas) is read, not the one compiled
    in, with no recompile; the scheduler's state and ``get_last_lr()`` are eager's."""
    make_opt, make_sched = SCHEDULERS[name]
    twins = StepTwins(_mlp, make_opt, _mse_step(), make_sched=make_sched)
    _check(twins)
    assert len(specularch.explain(twins.steps[1]).graphs) == 1


# --------------------------------------------------------------------------- step bodies


def test_gradient_clipping_returning_the_total_norm(promoted):
    """``clip_grad_norm_`` between ``backward`` and ``step`` (max_norm small enough to clip):
    the gradients after clipping and the total norm, a Python float, are eager's."""
    def make(model, opt):
        def train_step(x, y, labels):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
            return loss.item(), norm.item()
        return train_step
    _check(StepTwins(_mlp, lambda ps: O.Adam(ps, lr=1e-2), make))


def test_zero_grad_keeping_the_gradient_tensors(promoted):
    """``zero_grad(set_to_none=False)``: the gradients are zeroed in place, never None
    after the first step."""
    _check(StepTwins(_mlp, lambda ps: O.SGD(ps, lr=0.05, momentum=0.9), _mse_step(set_to_none=False)))


def test_two_backward_passes_accumulated_before_one_step(promoted):
    """Two half-batches, each with its own ``backward``, accumulated into ``.grad`` before
    one ``opt.step()``; the summed loss returned."""
    def make(model, opt):
        def train_step(x, y, labels):
            opt.zero_grad()
            total = 0.0
            for k in range(2):
                loss = F.mse_loss(model(x[3 * k:3 * k + 3]), y[3 * k:3 * k + 3]) / 2
                loss.backward()
                total += loss.item()
            opt.step()
            return total
        return train_step
    _check(StepTwins(_mlp, lambda ps: O.Adam(ps, lr=1e-2), make))


def test_dropout_training_then_validation_under_no_grad(promoted):
    """Dropout in training (each step seeded the same on both sides: the masks must be
    eager's exactly), then ``eval()`` and a validation loss under ``no_grad`` returned as a
    float, and ``train()`` again."""
    def make(model, opt):
        def train_step(x, y, labels):
            model.train()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), labels)
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                val = F.cross_entropy(model(x.flip(0)), labels.flip(0)).item()
            model.train()
            return loss.item(), val
        return train_step
    _check(StepTwins(_dropout_mlp, lambda ps: O.Adam(ps, lr=1e-2), make))


def test_batch_norm_running_statistics(promoted):
    """BatchNorm1d in training: ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` follow eager's after every step."""
    twins = StepTwins(_bn_mlp, lambda ps: O.SGD(ps, lr=0.05, momentum=0.9), _mse_step())
    _check(twins)
    assert twins.models[1][1].num_batches_tracked.item() == STEPS


def test_batch_norm_training_then_eval_validation(promoted):
    """BatchNorm1d trained with Adam, then ``eval()`` (running statistics used) and a
    validation loss under ``no_grad``, ``train()`` again, all in the step. The Linear before
    the BatchNorm has no bias: with one, that bias's true gradient is 0 (the BatchNorm
    subtracts the mean), its computed one rounding noise (~1e-8) which Adam scales up to
    updates of about lr, so a compiled candidate's different (allowed) rounding of Adam's
    ``exp_avg_sq`` (``v * b2 + g * g * (1 - b2)`` vs eager's ``addcmul_``) grows to 1e-3."""
    def make(model, opt):
        def train_step(x, y, labels):
            model.train()
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                val = F.mse_loss(model(x), y).item()
            model.train()
            return loss.item(), val
        return train_step
    _check(StepTwins(lambda: _bn_mlp(bias=False), lambda ps: O.Adam(ps, lr=1e-2), make))


def test_step_returning_several_python_values(promoted):
    """``loss.item()`` (float), the accuracy ``(pred == y).float().mean().item()`` (float)
    and the batch size ``x.size(0)`` (int), in a tuple."""
    def make(model, opt):
        def train_step(x, y, labels):
            opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, labels)
            loss.backward()
            opt.step()
            acc = (logits.argmax(1) == labels).float().mean().item()
            return loss.item(), acc, x.size(0)
        return train_step
    _check(StepTwins(_mlp, lambda ps: O.Adam(ps, lr=1e-2), make))
