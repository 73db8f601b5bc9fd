"""Adversarial differential sweep of guards: the program's state changes *between* calls, and
a cached graph must not be reused when something it depends on changed (docs/semantics.md
"Execution model", "Grad mode, inference mode", "Relaxation", "Training steps").

Every case is differential: eager and ``specularch.optimize`` run side by side on identical
inputs over ~10 calls (calls 1-3 profile, call 4 captures, calls 5+ reuse the graph), and the
same change is made to both sides between two calls, usually before call 6 (the graph is
then hot) and undone before call 9. Compared after every call: values, gradients, the
modules (parameters, buffers, public attributes), arguments, globals, stdout, RNG state and
exceptions. What changes:

* hooks: forward / forward-pre / backward hooks on the optimized module or an inlined
  submodule, parameter tensor hooks, global ``register_module_*`` hooks, added or removed;
* ``train()`` / ``eval()`` (dropout, BatchNorm running stats, ``self.training`` branches),
  module hyperparameters (``Dropout.p``, ``BatchNorm.momentum``, ``LeakyReLU.negative_slope``);
* ``requires_grad_`` on parameters; a parameter / ``.data`` / buffer replaced (same or another
  shape, dtype, strides); ``register_buffer``; parametrizations and pruning added;
* a submodule replaced (another class, ``nn.Identity``), deleted, added, its class or
  ``forward`` swapped; ``ModuleList`` / ``Sequential`` / ``ModuleDict`` edited;
* Python attributes (bool / int / float / str / None / list item / dict value / numpy scalar,
  also of another type with an equal value: ``1``, ``True``, ``1.0``; ``0.0`` / ``-0.0``) used in
  branches and arithmetic; globals, closure cells, ``__defaults__``, ``__code__``, builtins
  shadowed by a global, module-level functions monkeypatched (``F.relu``, ``math.pi``);
* the caller's grad mode, inference mode, autocast, default dtype; generators;
* arguments: dtype / layout / strides / conjugation / requires_grad / aliasing, a tensor that
  becomes a number or None, kwargs given or omitted or reordered, lists growing, list vs
  tuple, objects of another class with the same attributes;
* optimized training steps: learning rate, momentum, weight decay, ``add_param_group``,
  optimizer state cleared, ``eval()``, freezing a parameter, schedulers.

Falling back to eager is fine (``expect=None``); a wrong answer, a crash or an
``internal_error`` record is a bug (those cases are ``xfail(strict=True)`` with the reason)."""
import builtins
import contextlib
import copy
import functools
import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import specularch
import differential
from differential import A, T, Pair, assert_same

CALLS = 10
RTOL, ATOL = 1e-5, 1e-6
CHANGE, UNDO = 5, 8  # the change is made before call index 5 (the 6th call), undone before 8


# Cases that fail (a wrong answer or an internal_error record), with what goes wrong; the
# reproductions and causes are in the report of this sweep.
XFAIL = {
    "instance __dict__ entry shadows a submodule":
        "wrong answer: submodules are read from _modules (attrs.py) with no guard that the "
        "instance __dict__ lacks the name; an entry there shadows it in eager",
    "instance __dict__ entry shadows a parameter":
        "wrong answer: parameters are read from _parameters (attrs.py) with no guard that the "
        "instance __dict__ lacks the name; an entry there shadows it in eager",
    "math.pi":
        "wrong answer (documented limitation): rebound attributes of other modules are not "
        "guarded; the graph keeps the old math.pi",
    "builtins.max":
        "wrong answer: a builtin rebound in the builtins module is not guarded (only its "
        "shadowing by a module global is); the graph keeps max(2, 3) == 3",
}


def cases(table):
    """The names of ``table`` as parameters, the failing ones marked xfail(strict)."""
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=XFAIL[name]))
            if name in XFAIL else name for name in table]


def _show(name, report):
    kinds = sorted({f.kind for f in report.fallbacks})
    print(f"[sweep] {name}: graphs={len(report.graphs)} captures={report.stats.captures} "
          f"hits={report.stats.graph_hits} fallback_calls={report.stats.fallback_calls} "
          f"kinds={kinds}", file=sys.stderr)


def drive(pair, make_args, *, calls=CALLS, between=None, once=None, ctx=None):
    """Call ``pair`` ``calls`` times; before call ``i``: ``between(m, i)`` on both modules,
    ``once(i)`` once (global changes), and the call runs inside ``ctx(i)``; ``once(None)``
    cleans up at the end, whatever happened."""
    try:
        for i in range(calls):
            if between is not None:
                # Seeded, so that modules made by the change are the same on both sides.
                pair.apply(lambda m: (torch.manual_seed(100 + i), between(m, i)))
            if once is not None:
                once(i)
            with (ctx(i) if ctx is not None else contextlib.nullcontext()):
                pair.step(make_args)
    finally:
        if once is not None:
            once(None)
    report = pair.explain()
    differential._judge(report, None, None, None, None, pair.name)
    _show(pair.name, report)
    return report


def run_module(make_module, make_args, *, grad=False, **kw):
    pair = Pair.of_module(make_module, atol=ATOL, rtol=RTOL, grad=grad)
    return drive(pair, make_args, **kw)


def run_fn(fn, make_args, *, grad=False, state=None, **kw):
    pair = Pair.of_function(fn, atol=ATOL, rtol=RTOL, grad=grad, state=state)
    return drive(pair, make_args, **kw)


def at(*changes):
    """``between`` that makes ``changes[k] = (index, fn)`` before call ``index``."""
    table = {}
    for index, fn in changes:
        table.setdefault(index, []).append(fn)

    def between(m, i):
        for fn in table.get(i, ()):
            fn(m)
    return between


def every(fn):
    """``between`` that calls ``fn(m, i)`` before every call."""
    return fn


SHIFTS = [0.0, 0.7, -0.7, 0.2, 1.0, -1.0, 0.5, -0.3, 0.9, 0.0, -0.6, 0.3]


def xs(i):
    """(3, 6) input whose values move from call to call (relu / branches go both ways)."""
    return A(T(3, 6) + SHIFTS[i % len(SHIFTS)])


def xs_grad(i):
    return A((T(3, 6) + SHIFTS[i % len(SHIFTS)]).requires_grad_(True))


def xs_rows(i):
    """Like ``xs`` but the batch size changes too (dynamic sizes in the graph)."""
    return A(T(2 + i % 3, 6) + SHIFTS[i % len(SHIFTS)])


def xs_double_after(k):
    def make(i):
        x = T(3, 6) + SHIFTS[i % len(SHIFTS)]
        return A(x.double() if i >= k else x)
    return make


# ====================================================================== modules


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.act(self.lin(x)))


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.lin(x))))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.bn(self.lin(x)))


class TrainBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        h = self.lin(x)
        if self.training:
            h = h * 2 + 1
        return h


class NormAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.act = nn.LeakyReLU(0.1)
        self.norm = nn.LayerNorm(4)
        self.soft = nn.Softmax(dim=1)

    def forward(self, x):
        return self.soft(self.norm(self.act(self.lin(x))))


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        return x * self.s + 1


class ViewParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).reshape(3, 2))

    def forward(self, x):
        return x + self.w.view(6)


class OptionalBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4, bias=False)
        self.bias = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.lin(x)
        if self.bias is not None:
            h = h + self.bias
        return h


class BufNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x):
        h = self.lin(x)
        if self.shift is not None:
            h = h + self.shift
        if hasattr(self, "extra"):
            h = h * self.extra
        return h


class TensorAttr(nn.Module):
    """A plain tensor attribute (neither parameter nor buffer)."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def forward(self, x):
        return self.lin(x) * self.scale


class Extra(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.extra = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if getattr(self, "extra", None) is not None:
            h = self.extra(h)
        return h


class Listed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Dicted(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(6, 2), "b": nn.Linear(6, 2)})

    def forward(self, x):
        return [head(x) for head in self.heads.values()]


class Helper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def helper(self, h):
        return h.relu()

    def forward(self, x):
        return self.helper(self.lin(x))


class MLP2(MLP):
    def forward(self, x):
        return self.out(torch.sigmoid(self.lin(x))) * 3


def _alt_forward(self, x):
    return self.lin(x).tanh()


def _alt_helper(self, h):
    return h.sigmoid() * 5


class Double(nn.Module):
    def forward(self, w):
        return w * 2


# ------------------------------------------------------------------ hooks


def _hook_on(path, kind, fn, **kw):
    """Register hook ``kind`` on submodule ``path`` of m (``""`` = m), handle kept on m."""
    def add(m):
        target = m.get_submodule(path)
        handles = m.__dict__.setdefault("_test_handles", [])
        handles.append(getattr(target, kind)(fn, **kw))
    return add


def _remove_hooks(m):
    for h in m.__dict__.pop("_test_handles", []):
        h.remove()


def _times(k):
    return lambda mod, args, out: out * k


def _record(mod, args, out):
    root = mod
    root.__dict__["seen"] = root.__dict__.get("seen", 0) + 1


def _pre_shift(mod, args):
    return (args[0] - 0.5,)


def _kw_hook(mod, args, kwargs, out):
    return out + 3


def _bwd_scale(mod, grad_in, grad_out):
    return tuple(None if g is None else g * 3 for g in grad_in)


def _bwd_pre_scale(mod, grad_out):
    return tuple(g * 0.5 for g in grad_out)


def _param_hook(m):
    handles = m.__dict__.setdefault("_test_handles", [])
    handles.append(m.lin.weight.register_hook(lambda g: g * 2))


def _post_acc_hook(m):
    def hook(p):
        with torch.no_grad():
            p.grad.mul_(0.25)
    handles = m.__dict__.setdefault("_test_handles", [])
    handles.append(m.lin.weight.register_post_accumulate_grad_hook(hook))


def _swap_hook(m):
    _remove_hooks(m)
    _hook_on("lin", "register_forward_hook", _times(3))(m)


HOOK_CASES = {
    "forward hook on the optimized module": at((CHANGE, _hook_on("", "register_forward_hook", _times(2))),
                                               (UNDO, _remove_hooks)),
    "forward hook on a submodule": at((CHANGE, _hook_on("lin", "register_forward_hook", _times(2))),
                                      (UNDO, _remove_hooks)),
    "forward pre-hook on a submodule": at((CHANGE, _hook_on("act", "register_forward_pre_hook", _pre_shift)),
                                          (UNDO, _remove_hooks)),
    "forward hook with kwargs on a submodule": at(
        (CHANGE, _hook_on("out", "register_forward_hook", _kw_hook, with_kwargs=True)), (UNDO, _remove_hooks)),
    "recording forward hook on a submodule": at((CHANGE, _hook_on("act", "register_forward_hook", _record)),
                                                (UNDO, _remove_hooks)),
    "hook swapped for another (same count)": at((CHANGE, _hook_on("lin", "register_forward_hook", _times(2))),
                                                (CHANGE + 2, _swap_hook), (UNDO + 1, _remove_hooks)),
    "hook added before capture, removed after": at((1, _hook_on("lin", "register_forward_hook", _times(2))),
                                                   (CHANGE, _remove_hooks)),
}


@pytest.mark.parametrize("name", cases(HOOK_CASES))
def test_module_hooks_added_and_removed(name):
    run_module(MLP, xs, between=HOOK_CASES[name])


GRAD_HOOK_CASES = {
    "full backward hook on a submodule": at(
        (CHANGE, _hook_on("lin", "register_full_backward_hook", _bwd_scale)), (UNDO, _remove_hooks)),
    "full backward pre-hook on a submodule": at(
        (CHANGE, _hook_on("out", "register_full_backward_pre_hook", _bwd_pre_scale)), (UNDO, _remove_hooks)),
    "tensor hook on a parameter": at((CHANGE, _param_hook), (UNDO, _remove_hooks)),
    "post-accumulate-grad hook on a parameter": at((CHANGE, _post_acc_hook), (UNDO, _remove_hooks)),
}


@pytest.mark.parametrize("name", cases(GRAD_HOOK_CASES))
def test_gradient_hooks_added_and_removed(name):
    run_module(MLP, xs_grad, grad=True, between=GRAD_HOOK_CASES[name])


def _global_hooks(kind, fn):
    handle = []

    def once(i):
        if i == CHANGE:
            handle.append(getattr(nn.modules.module, kind)(fn))
        if (i == UNDO or i is None) and handle:
            handle.pop().remove()
    return once


GLOBAL_HOOKS = {
    "register_module_forward_hook": ("register_module_forward_hook", _times(2), False),
    "register_module_forward_pre_hook": ("register_module_forward_pre_hook", _pre_shift, False),
    "register_module_full_backward_hook": ("register_module_full_backward_hook", _bwd_scale, True),
}


@pytest.mark.parametrize("name", cases(GLOBAL_HOOKS))
def test_global_module_hooks(name):
    kind, fn, grad = GLOBAL_HOOKS[name]
    run_module(MLP, xs_grad if grad else xs, grad=grad, once=_global_hooks(kind, fn))


# ------------------------------------------------------------------ train / eval and module settings


def _alternate_training(m, i):
    m.train(i % 2 == 0)


MODE_CASES = {
    "dropout: eval, then train again": (DropNet, at((CHANGE, lambda m: m.eval()), (UNDO, lambda m: m.train()))),
    "dropout: train/eval alternating": (DropNet, every(_alternate_training)),
    "dropout: p changed": (DropNet, at((CHANGE, lambda m: setattr(m.drop, "p", 0.0)),
                                       (CHANGE + 1, lambda m: setattr(m.drop, "p", 0.9)),
                                       (UNDO, lambda m: setattr(m.drop, "p", 0.2)))),
    "batchnorm: eval, then train again": (BNNet, at((CHANGE, lambda m: m.eval()), (UNDO, lambda m: m.train()))),
    "batchnorm: train/eval alternating": (BNNet, every(_alternate_training)),
    "batchnorm: track_running_stats off": (BNNet, at((CHANGE, lambda m: setattr(m.bn, "track_running_stats", False)),
                                                     (UNDO, lambda m: m.eval()))),
    "self.training branch: eval": (TrainBranch, at((CHANGE, lambda m: m.eval()), (UNDO, lambda m: m.train()))),
    "leaky relu slope changed": (NormAct, at((CHANGE, lambda m: setattr(m.act, "negative_slope", 0.5)),
                                             (UNDO, lambda m: setattr(m.act, "negative_slope", 2.0)))),
}


@pytest.mark.parametrize("name", cases(MODE_CASES))
def test_train_eval_and_module_settings(name):
    make, between = MODE_CASES[name]
    run_module(make, xs_rows, between=between)


# ------------------------------------------------------------------ requires_grad, parameters, buffers


def _freeze(path, flag):
    return lambda m: m.get_parameter(path).requires_grad_(flag)


def _new_param(path, make):
    def change(m):
        mod_path, _, name = path.rpartition(".")
        mod = m.get_submodule(mod_path)
        setattr(mod, name, nn.Parameter(make(getattr(mod, name))))
    return change


def _set_data(path, make):
    def change(m):
        p = m.get_parameter(path)
        p.data = make(p.data)
    return change


def _parametrize(m):
    torch.nn.utils.parametrize.register_parametrization(m.lin, "weight", Double())


def _weight_norm(m):
    m.lin = torch.nn.utils.parametrizations.weight_norm(m.lin)


def _prune(m):
    torch.nn.utils.prune.l1_unstructured(m.lin, "weight", amount=0.5)


GRAD_PARAM_CASES = {
    "requires_grad_(False) on a weight, then back": (MLP, at((CHANGE, _freeze("lin.weight", False)),
                                                             (UNDO, _freeze("lin.weight", True)))),
    "parameter replaced, same shape": (MLP, at((CHANGE, _new_param("lin.weight", lambda w: w.detach() * 2)))),
    "parameter replaced, other shape": (MLP, at(
        (CHANGE, _new_param("out.weight", lambda w: torch.ones(5, 4))),
        (CHANGE, _new_param("out.bias", lambda b: torch.zeros(5))))),
    "parameter replaced, float64": (Scale, at((CHANGE, _new_param("s", lambda s: s.detach().double() * 3)))),
    ".data replaced, float64": (Scale, at((CHANGE, _set_data("s", lambda d: d.double() * 2)))),
    "bias set to None": (OptionalBias, at((CHANGE, lambda m: setattr(m, "bias", None)),
                                          (UNDO, lambda m: setattr(m, "bias", nn.Parameter(torch.full((4,), 2.0)))))),
    "parametrization registered": (MLP, at((CHANGE, _parametrize))),
    "weight_norm applied": (MLP, at((CHANGE, _weight_norm))),
    "pruned (pre-hook, weight_orig)": (MLP, at((CHANGE, _prune))),
}


@pytest.mark.parametrize("name", cases(GRAD_PARAM_CASES))
def test_parameters_changed_grads(name):
    make, between = GRAD_PARAM_CASES[name]
    run_module(make, xs_grad, grad=True, between=between)


def _strided_view_param(m):
    m.w.data = m.w.data.t().contiguous().t()


PARAM_CASES = {
    "frozen module, result stops requiring grad": (MLP, xs, at((CHANGE, lambda m: m.requires_grad_(False)),
                                                               (UNDO, lambda m: m.requires_grad_(True)))),
    ".data given other strides, .view() of it": (ViewParam, xs, at((CHANGE, _strided_view_param))),
    "module .double() with float64 inputs": (MLP, xs_double_after(CHANGE), at((CHANGE, lambda m: m.double()))),
    "buffer replaced (same shape, broadcast shape, None)": (BufNet, xs, at(
        (CHANGE, lambda m: setattr(m, "shift", torch.ones(6))),
        (CHANGE + 1, lambda m: setattr(m, "shift", torch.full((1,), 3.0))),
        (UNDO, lambda m: setattr(m, "shift", None)))),
    "buffer updated in place": (BufNet, xs, every(lambda m, i: m.shift.add_(i))),
    "buffer registered": (BufNet, xs, at((CHANGE, lambda m: m.register_buffer("extra", torch.full((6,), 2.0))))),
    "plain tensor attribute replaced": (TensorAttr, xs, at(
        (CHANGE, lambda m: setattr(m, "scale", torch.tensor([4.0, 3.0, 2.0, 1.0]))),
        (CHANGE + 1, lambda m: setattr(m, "scale", torch.tensor(2.0, dtype=torch.float64))),
        (UNDO, lambda m: setattr(m, "scale", 3)))),
}


@pytest.mark.parametrize("name", cases(PARAM_CASES))
def test_parameters_and_buffers_changed(name):
    make, args, between = PARAM_CASES[name]
    run_module(make, args, between=between)


# ------------------------------------------------------------------ submodules


def _set(path, make):
    def change(m):
        mod_path, _, name = path.rpartition(".")
        setattr(m.get_submodule(mod_path), name, make())
    return change


def _patch_class_forward(m):
    cls = type(m.act)
    cls.forward = lambda self, x: x * 3


def _patch_instance_forward(m):
    m.act.forward = lambda x: x * 3 - 1


def _delete(name):
    def change(m):
        delattr(m, name)
    return change


SUB_CASES = {
    "activation replaced by another class": (MLP, at((CHANGE, _set("act", nn.Tanh)),
                                                     (CHANGE + 1, _set("act", nn.Identity)),
                                                     (UNDO, _set("act", nn.ReLU)))),
    "linear replaced by a Sequential": (MLP, at((CHANGE, _set("lin", lambda: nn.Sequential(nn.Linear(6, 4), nn.Tanh()))))),
    "linear replaced by Identity (shape change)": (MLP, at((CHANGE, _set("out", nn.Identity)))),
    "submodule deleted, added back": (Extra, at((CHANGE, _delete("extra")),
                                                (UNDO, _set("extra", lambda: nn.Linear(4, 4))))),
    "ModuleList appended": (Listed, at((CHANGE, lambda m: m.layers.append(nn.Linear(6, 6))))),
    "ModuleList shortened": (Listed, at((CHANGE, lambda m: m.layers.__delitem__(0)))),
    "ModuleDict key added": (Dicted, at((CHANGE, lambda m: m.heads.__setitem__("c", nn.Linear(6, 2))))),
    "forward patched on a submodule instance": (MLP, at((CHANGE, _patch_instance_forward))),
    "submodule's __class__ swapped": (MLP, at((CHANGE, lambda m: setattr(m.act, "__class__", nn.Tanh)))),
    "optimized module's __class__ swapped": (MLP, at((CHANGE, lambda m: setattr(m, "__class__", MLP2)))),
    "helper method rebound on the instance": (Helper, at((CHANGE, lambda m: setattr(
        m, "helper", types.MethodType(_alt_helper, m))))),
    "instance __dict__ entry shadows a submodule": (MLP, at((CHANGE, lambda m: m.__dict__.__setitem__(
        "lin", nn.Linear(6, 4))), (UNDO, lambda m: m.__dict__.pop("lin")))),
    "instance __dict__ entry shadows a parameter": (MLP, at((CHANGE, lambda m: m.lin.__dict__.__setitem__(
        "weight", torch.ones(4, 6))), (UNDO, lambda m: m.lin.__dict__.pop("weight")))),
    "optimized module's forward rebound": (MLP, at((CHANGE, lambda m: setattr(
        m, "forward", types.MethodType(_alt_forward, m))))),
}


@pytest.mark.parametrize("name", cases(SUB_CASES))
def test_submodules_changed(name):
    make, between = SUB_CASES[name]
    run_module(make, xs_rows, between=between)


def test_submodule_class_forward_patched():
    # A class of its own per module (make_module runs twice), patched on the class.
    def make():
        act = type("Act", (nn.Module,), {"forward": lambda self, x: x.relu()})
        m = MLP()
        m.act = act()
        return m
    run_module(make, xs_rows, between=at((CHANGE, _patch_class_forward)))


# ------------------------------------------------------------------ Python attributes of the module


class Attrs(nn.Module):
    """A small model whose forward reads the Python attributes a case changes."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.flag, self.k, self.alpha, self.mode, self.scale = True, 2, 0.5, "relu", None
        self.cfg, self.table = [1, 2], {"k": 2, "bias": 0.5}
        self.ns = types.SimpleNamespace(scale=2.0)
        self.pair, self.nested = (2, 3), [[1, 2], [3]]


def attr_case(forward):
    return type(f"Attrs_{forward.__name__}", (Attrs,), {"forward": forward})


def _bool_branch(self, x):
    h = self.lin(x)
    return h.relu() if self.flag else h.sigmoid()


def _int_arith(self, x):
    return self.lin(x) * self.k + self.k // 2


def _int_trip(self, x):
    h = self.lin(x)
    for _ in range(self.k):
        h = torch.tanh(h * 1.5)
    return h


def _float_arith(self, x):
    return self.lin(x) * self.alpha - self.alpha ** 2


def _full_dtype(self, x):
    """``torch.full`` / ``torch.tensor`` of the attribute: its *type* picks the dtype."""
    return self.lin(x), torch.full((2,), self.k), torch.tensor(self.k)


def _signed_zero(self, x):
    return self.lin(x) * math.copysign(1.0, self.alpha), 1.0 / torch.full((2,), self.alpha)


def _str_branch(self, x):
    h = self.lin(x)
    if self.mode == "relu":
        return h.relu()
    elif self.mode == "tanh":
        return h.tanh()
    return h


def _none_or_scale(self, x):
    h = self.lin(x)
    if self.scale is not None:
        h = h * self.scale
    return h


def _list_loop(self, x):
    h = self.lin(x)
    for c in self.cfg:
        h = h * 0.5 + c
    return h


def _dict_value(self, x):
    h = self.lin(x) * self.table["k"]
    if "bias" in self.table:
        h = h + self.table["bias"]
    return h


def _namespace(self, x):
    return self.lin(x) * self.ns.scale


def _set_attr(name, value):
    def change(m):
        setattr(m, name, copy.deepcopy(value))
    return change


def _series(name, values):
    """``between`` that sets ``name`` to ``values[i]`` before call i."""
    def between(m, i):
        setattr(m, name, copy.deepcopy(values[i % len(values)]))
    return between


ATTR_CASES = {
    "bool in a branch, alternating": (_bool_branch, _series("flag", [True, False])),
    "int in arithmetic, every call": (_int_arith, _series("k", [2, 3, 2, 2, 5, -1, 0, 7, 2, 1])),
    "int as a trip count": (_int_trip, _series("k", [2, 2, 2, 2, 2, 3, 1, 0, 4, 2])),
    "float in arithmetic, every call": (_float_arith, _series("alpha", [0.5, 0.25, 1.5, 0.5, 2.0, -1.0, 0.0, 3.5, 0.5, 1e-3])),
    "float replaced by int and bool (equal values)": (_float_arith, _series("alpha", [1.0, 1.0, 1.0, 1.0, 1.0, 1, True, 1.0, 1, 1.0])),
    "int/bool/float of equal value into torch.full": (_full_dtype, _series("k", [1, 1, 1, 1, 1, True, 1.0, 1, True, 1])),
    "numpy scalars of equal value into torch.full": (_full_dtype, _series(
        "k", [2.0, 2.0, 2.0, 2.0, 2.0, np.float64(2.0), np.float32(2.0), 2.0, np.int64(2), 2])),
    "0.0 then -0.0": (_signed_zero, _series("alpha", [0.0, 0.0, 0.0, 0.0, 0.0, -0.0, 0.0, -0.0, -0.0, 0.0])),
    "str in a branch": (_str_branch, _series("mode", ["relu"] * 5 + ["tanh", "other", "relu", "tanh", "relu"])),
    "None, then a float, then a tensor": (_none_or_scale, at((CHANGE, _set_attr("scale", 2.0)),
                                                             (CHANGE + 1, _set_attr("scale", torch.tensor([1.0, -1.0, 2.0, 0.5]))),
                                                             (UNDO, _set_attr("scale", None)))),
    "list grows": (_list_loop, at((CHANGE, lambda m: m.cfg.append(5)), (CHANGE + 2, lambda m: m.cfg.append(-2)))),
    "dict value changed": (_dict_value, every(lambda m, i: m.table.__setitem__("k", i % 3))),
    "namespace replaced by an object of another class": (_namespace, at(
        (CHANGE, lambda m: setattr(m, "ns", _Other(4.0))))),
}


class _Other:
    def __init__(self, scale):
        self.scale = scale


@pytest.mark.parametrize("name", cases(ATTR_CASES))
def test_python_attributes_changed(name):
    forward, between = ATTR_CASES[name]
    run_module(attr_case(forward), xs, between=between)


# ====================================================================== functions: globals, closures


G_SCALE = 2.0
G_FLAG = True
G_T = torch.ones(6)
G_LIST = [1.0, 2.0]
G_DICT = {"k": 1.0}
G_COUNT = 0
G_MOD = None


def _g_helper(h):
    return h.relu()


def _g_other_helper(h):
    return h.sigmoid() - 1


G_FN = _g_helper


def _globals_for(i, **series):
    """Set module globals to their values for call ``i`` (make_args runs before both sides'
    calls, and the functions only read them)."""
    for name, values in series.items():
        setattr(sys.modules[__name__], name, values[i % len(values)])


def g_scale(x):
    return x * G_SCALE + 1


def g_flag(x):
    return x.relu() if G_FLAG else x.tanh()


def g_full(x):
    return x + 1, torch.full((2,), G_SCALE), torch.tensor(G_SCALE)


def g_tensor(x):
    return x * G_T


def g_list(x):
    return x * G_LIST[0] + len(G_LIST)


def g_fn(x):
    return G_FN(x) * 2


def g_module(x):
    return G_MOD(x)


def g_counter(x):
    global G_COUNT
    G_COUNT += 1
    return x * G_COUNT


def _with_globals(**series):
    def make(i):
        _globals_for(i, **series)
        return xs(i)
    return make


ONES_T = [torch.ones(6)] * 5


GLOBAL_CASES = {
    "float changed every call": (g_scale, dict(G_SCALE=[2.0, 3.0, 2.0, 2.0, -1.0, 0.5, 2.0, 7.0, 1e-4, 2.0])),
    "float replaced by equal int and bool": (g_full, dict(G_SCALE=[1.0] * 5 + [1, True, 1.0, True, 1])),
    "bool in a branch": (g_flag, dict(G_FLAG=[True] * 5 + [False, True, False, False, True])),
    "tensor replaced, other shape / dtype": (g_tensor, dict(
        G_T=ONES_T + [torch.ones(1), torch.ones(6, dtype=torch.float64), torch.ones(3, 1), torch.ones(6, dtype=torch.int64), torch.ones(6)])),
    "tensor replaced by a number": (g_tensor, dict(G_T=ONES_T + [3.0, torch.ones(6), 2, None, torch.ones(6)])),
    "function rebound": (g_fn, dict(G_FN=[_g_helper] * 5 + [_g_other_helper, _g_helper, _g_other_helper, torch.exp, _g_helper])),
}


@pytest.mark.parametrize("name", cases(GLOBAL_CASES))
def test_globals_rebound(name):
    fn, series = GLOBAL_CASES[name]
    saved = {k: getattr(sys.modules[__name__], k) for k in series}
    try:
        run_fn(fn, _with_globals(**series))
    finally:
        for k, v in saved.items():
            setattr(sys.modules[__name__], k, v)


def test_global_tensor_written_in_place_between_calls():
    saved = G_T.clone()

    def make(i):
        with torch.no_grad():
            G_T.add_(i * 0.5)
        return xs(i)
    try:
        run_fn(g_tensor, make)
    finally:
        G_T.copy_(saved)


def test_global_list_item_written_between_calls():
    def make(i):
        G_LIST[0] = float(i % 3)
        if i == CHANGE:
            G_LIST.append(3.0)
        return xs(i)
    saved = list(G_LIST)
    try:
        run_fn(g_list, make)
    finally:
        G_LIST[:] = saved


def test_global_module_replaced_and_updated():
    global G_MOD
    saved = G_MOD
    mods = []

    def make(i):
        global G_MOD
        if i % 4 == 0 or i == CHANGE:
            torch.manual_seed(i)
            mods.append(nn.Linear(6, 3) if i != CHANGE + 2 else nn.Linear(6, 5))
        G_MOD = mods[-1]
        with torch.no_grad():
            G_MOD.weight.mul_(1.1)
        return xs(i)
    try:
        run_fn(g_module, make)
    finally:
        G_MOD = saved


def test_global_counter_set_from_outside():
    """A global the function writes, also set to another value between calls."""
    start = {"v": 0}

    def make(i):
        start["v"] = [0, 1, 2, 3, 4, 10, -3, 4, 4, 0][i]
        return xs(i)

    def reset():
        setattr(sys.modules[__name__], "G_COUNT", start["v"])

    try:
        run_fn(g_counter, make, state=(reset, lambda: G_COUNT))
    finally:
        setattr(sys.modules[__name__], "G_COUNT", 0)


def test_builtin_shadowed_by_a_global():
    """A module global named like a builtin appears between calls (``abs`` is looked up in
    globals first)."""
    def make(i):
        mod = sys.modules[__name__]
        if i == CHANGE:
            mod.abs = lambda v: -v
        elif i == UNDO and hasattr(mod, "abs"):
            del mod.abs
        return xs(i)
    try:
        run_fn(uses_abs, make)
    finally:
        sys.modules[__name__].__dict__.pop("abs", None)


def uses_abs(x):
    return x * abs(G_SCALE - 5)


# ------------------------------------------------------------------ closures, defaults, code


def _closure_pair(initial):
    value = initial

    def fn(x):
        return x * value + 1 if not isinstance(value, torch.Tensor) else x * value

    def setter(v):
        nonlocal value
        value = v
    return fn, setter


CLOSURE_VALUES = {
    "int/bool/float of equal value": [1.0] * 5 + [1, True, 1.0, 1, True],
    "tensor": [torch.ones(6)] * 5 + [torch.full((6,), 2.0), torch.ones(1), torch.ones(6, dtype=torch.float64),
                                     torch.ones(6), torch.zeros(6)],
}


@pytest.mark.parametrize("name", cases(CLOSURE_VALUES))
def test_closure_cell_changed(name):
    values = CLOSURE_VALUES[name]
    fn, setter = _closure_pair(values[0])

    def make(i):
        setter(values[i])
        return xs(i)
    run_fn(fn, make)


def test_closure_cell_holding_a_function():
    helper = torch.relu

    def fn(x):
        return helper(x) + 1

    def make(i):
        nonlocal helper
        helper = [torch.relu, torch.tanh, torch.sigmoid][0 if i < CHANGE else i % 3]
        return xs(i)
    run_fn(fn, make)


def with_default(x, k=2.0, *, bias=1.0):
    return x * k + bias


def test_function_defaults_changed():
    saved = with_default.__defaults__, with_default.__kwdefaults__

    def make(i):
        if i == CHANGE:
            with_default.__defaults__ = (3.0,)
        if i == CHANGE + 1:
            with_default.__kwdefaults__ = {"bias": -5.0}
        if i == UNDO:
            with_default.__defaults__, with_default.__kwdefaults__ = saved
        return xs(i)
    try:
        run_fn(with_default, make)
    finally:
        with_default.__defaults__, with_default.__kwdefaults__ = saved


def code_swapped(x):
    return x * 2 + 1


def _code_donor(x):
    return x.tanh() - 7


def test_function_code_swapped():
    saved = code_swapped.__code__

    def make(i):
        if i == CHANGE:
            code_swapped.__code__ = _code_donor.__code__
        if i == UNDO:
            code_swapped.__code__ = saved
        return xs(i)
    try:
        run_fn(code_swapped, make)
    finally:
        code_swapped.__code__ = saved


# ------------------------------------------------------------------ monkeypatched library functions


def uses_f_relu(x):
    return F.relu(x) * 2


def uses_torch_relu(x):
    return torch.relu(x) + 1


def uses_tensor_relu(x):
    return x.relu() + 1


def uses_max(x):
    return x * max(2, 3)


def uses_math_pi(x):
    return x * math.pi


def uses_config_module(x):
    return x * cfgmod.SCALE


cfgmod = types.ModuleType("sweep_cfgmod")
cfgmod.SCALE = 2.0
sys.modules["sweep_cfgmod"] = cfgmod


def _patcher(owner, name, new):
    saved = getattr(owner, name)

    def once(i):
        if i == CHANGE:
            setattr(owner, name, new)
        if i == UNDO or i is None:
            setattr(owner, name, saved)
    return once


PATCH_CASES = {
    "torch.nn.functional.relu": (uses_f_relu, F, "relu", lambda x, inplace=False: torch.tanh(x)),
    "torch.relu": (uses_torch_relu, torch, "relu", torch.sigmoid),
    "math.pi": (uses_math_pi, math, "pi", 3.0),
    "an attribute of a user's config module": (uses_config_module, cfgmod, "SCALE", -1.0),
    "torch.Tensor.relu": (uses_tensor_relu, torch.Tensor, "relu", lambda self: self.tanh()),
    "builtins.max": (uses_max, builtins, "max", min),
}


@pytest.mark.parametrize("name", cases(PATCH_CASES))
def test_library_function_monkeypatched(name):
    fn, owner, attr, new = PATCH_CASES[name]
    run_fn(fn, xs, once=_patcher(owner, attr, new))


def test_module_calls_patched_functional():
    """``nn.ReLU.forward`` calls ``F.relu``: patched after capture."""
    run_module(MLP, xs, once=_patcher(F, "relu", lambda x, inplace=False: x * 3))


# ====================================================================== the caller's modes


def lin_fn_factory():
    torch.manual_seed(3)
    lin = nn.Linear(6, 4)

    def fn(x):
        h = lin(x)
        return h.relu() * 2, torch.is_grad_enabled()
    return fn


def makes_tensors(x):
    """Factory functions and Python floats turned into tensors: the default dtype matters."""
    return x + torch.zeros(6), torch.tensor(1.5), torch.arange(3) * 0.5, torch.full((2,), 2.0)


def with_enable_grad(x):
    with torch.enable_grad():
        y = x * 2
    return y + 1, y.requires_grad


def uses_dropout(x):
    return F.dropout(x, 0.5, training=True) + torch.randn(3, 6) * 0.1


def _ctx_table(table):
    def ctx(i):
        make = table.get(i)
        return make() if make is not None else contextlib.nullcontext()
    return ctx


def _from(k, make, upto=None):
    def ctx(i):
        return make() if i >= k and (upto is None or i < upto) else contextlib.nullcontext()
    return ctx


def _default_dtype(dtype):
    @contextlib.contextmanager
    def ctx():
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(before)
    return ctx


def _grad_mode_set(flag):
    @contextlib.contextmanager
    def ctx():
        before = torch.is_grad_enabled()
        torch.set_grad_enabled(flag)
        try:
            yield
        finally:
            torch.set_grad_enabled(before)
    return ctx


def _alternate(make):
    return lambda i: make() if i >= 4 and i % 2 else contextlib.nullcontext()


MODE_FN_CASES = {
    "no_grad around odd calls": ("lin", xs_grad, _alternate(torch.no_grad)),
    "set_grad_enabled(False) from the 6th call on": ("lin", xs_grad, _from(CHANGE, _grad_mode_set(False), UNDO)),
    "inference_mode around odd calls": ("lin", xs_grad, _alternate(torch.inference_mode)),
    "autocast(cpu, bfloat16) around odd calls": ("lin", xs, _alternate(
        lambda: torch.autocast("cpu", dtype=torch.bfloat16))),
    "autocast dtype changed": ("lin", xs, _ctx_table({
        i: (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if i < CHANGE else
        (lambda: torch.autocast("cpu", dtype=torch.float16)) for i in range(CALLS)})),
    "default dtype float64 around some calls": ("tensors", xs, _from(CHANGE, _default_dtype(torch.float64), UNDO)),
    "enable_grad inside, no_grad outside": ("enable", xs_grad, _alternate(torch.no_grad)),
}


@pytest.mark.parametrize("name", cases(MODE_FN_CASES))
def test_caller_modes(name):
    which, args, ctx = MODE_FN_CASES[name]
    fn = {"lin": lin_fn_factory(), "tensors": makes_tensors, "enable": with_enable_grad}[which]
    run_fn(fn, args, ctx=ctx)


def test_module_under_no_grad_and_inference_mode():
    table = {5: torch.no_grad, 6: torch.inference_mode, 7: torch.no_grad, 9: torch.inference_mode}
    run_module(BNNet, xs_rows, ctx=_ctx_table(table))


def test_random_ops_with_reseeding_between_calls():
    """The harness seeds the global RNG before every call (another seed per call); the
    function draws through dropout and randn."""
    run_fn(uses_dropout, xs)


def test_generator_replaced_between_calls():
    """A closure's generator replaced by a fresh one (seeded per call) before each call; one
    generator per side, so both draw the same numbers."""
    def make_side():
        cell = {"gen": torch.Generator().manual_seed(0)}

        def draws(x):
            return x + torch.randn(x.shape, generator=cell["gen"])
        return draws, cell
    eager, cell_e = make_side()
    opt_fn, cell_o = make_side()
    opt = specularch.optimize(opt_fn)
    pair = Pair("draws", eager, opt, opt, atol=ATOL, rtol=RTOL)

    def once(i):
        if i is not None and i >= CHANGE:
            cell_e["gen"] = torch.Generator().manual_seed(i % 2)
            cell_o["gen"] = torch.Generator().manual_seed(i % 2)
    drive(pair, xs, once=once)


# ====================================================================== arguments


def arith(x):
    return x * 2 + 1, x.sum(), x / 2


def views_flat(x):
    return x.view(-1) * 2


def layout_info(x):
    y = x.relu()
    return y, y.stride(), y.is_contiguous(), x.storage_offset()


def view_info(x):
    return x * 2, x._is_view()


def shared_info(x):
    return x * 2, x.is_shared()


def conv_strides(x):
    w = torch.ones(2, 3, 1, 1)
    y = F.conv2d(x, w)
    return y, y.stride(), y.is_contiguous(memory_format=torch.channels_last)


def as_real(x):
    return torch.view_as_real(x) * 2


def scaled(x, s):
    return x * s, torch.full((2,), s) if isinstance(s, (int, float)) else s


def optional(x, s=None):
    if s is None:
        return x + 1
    return x * s


def kw_only(x, scale=1.0, *, bias=None, **extra):
    h = x * scale
    if bias is not None:
        h = h + bias
    return h, list(extra), [v * 2 for v in extra.values()]


def summed(items):
    total = items[0]
    for t in items[1:]:
        total = total + t
    return total, len(items)


class _P:
    def __init__(self, w):
        self.w = w

    def apply(self, x):
        return x * self.w


class _Q:
    def __init__(self, w):
        self.w = w

    def apply(self, x):
        return x + self.w


def uses_object(x, obj):
    return obj.apply(x) * 2, obj.w


def write_then_read(a, b):
    a.mul_(2)
    return b + 1


def in_place_arg(x):
    x.mul_(2)
    return x.sum()


def _dtypes(i):
    dtype = [torch.float32] * 5 + [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32][:CALLS - 5]
    d = dtype[i]
    return A(T(3, 6, dtype=d) if not d.is_floating_point else T(3, 6).to(d))


def _strided(i):
    x = T(6, 3)
    return A(x.t() if i in (CHANGE, UNDO) else x.t().contiguous())


def _offsets(i):
    base = T(4, 6)
    return A(base[1:] if i in (CHANGE, UNDO) else base[:3].clone())


def _views(i):
    base = T(3, 6)
    return A(base[:] if i in (CHANGE, UNDO) else base)


def _shared(i):
    base = T(3, 6)
    return A(base.share_memory_() if i in (CHANGE, UNDO) else base)


def _channels_last(i):
    x = T(2, 3, 4, 4)
    return A(x.contiguous(memory_format=torch.channels_last) if i in (CHANGE, CHANGE + 2) else x)


def _conj(i):
    x = T(3, 4, dtype=torch.complex64)
    return A(x.conj() if i in (CHANGE, UNDO) else x)


def _scalars(i):
    s = [T(6), T(6), T(6), T(6), T(6), 2.0, 3, None, T(1), torch.tensor(2.0, dtype=torch.float64)][i]
    return A(T(3, 6), s)


def _optional(i):
    return ((T(3, 6), T(6)) if i < CHANGE or i % 2 else (T(3, 6),)), {}


def _kwargs(i):
    kws = [dict(bias=T(6)), dict(bias=T(6)), dict(bias=T(6)), dict(bias=T(6)), dict(bias=T(6)),
           dict(), dict(scale=2.0), dict(bias=T(6), a=1, b=2), dict(b=2, a=1, bias=T(6)), dict(scale=T(6))]
    return (T(3, 6),), kws[i]


def _lists(i):
    n = [3, 3, 3, 3, 3, 4, 2, 5, 3, 1][i]
    return A([T(6) for _ in range(n)])


def _objects(i):
    cls = _Q if i in (CHANGE, UNDO) else _P
    return A(T(3, 6), cls(2.0))


def _aliased(i):
    a = T(6)
    return A(a, a) if i in (CHANGE, UNDO) else A(a, a.clone())


def _inference_args(i):
    if i in (CHANGE, UNDO):
        with torch.inference_mode():
            return A(T(3, 6))
    return A(T(3, 6))


ARG_CASES = {
    "dtype changes": (arith, _dtypes),
    "contiguity changes, .view(-1)": (views_flat, _strided),
    "storage offset changes": (layout_info, _offsets),
    "a view instead of a base, _is_view()": (view_info, _views),
    "shared memory, is_shared()": (shared_info, _shared),
    "channels_last input": (conv_strides, _channels_last),
    "conjugated complex input": (as_real, _conj),
    "tensor becomes a Python number": (scaled, _scalars),
    "optional argument omitted": (optional, _optional),
    "kwargs given, omitted, reordered": (kw_only, _kwargs),
    "list argument grows and shrinks": (summed, _lists),
    "object of another class, same attributes": (uses_object, _objects),
    "the same tensor passed twice": (write_then_read, _aliased),
    "inference tensor written in place": (in_place_arg, _inference_args),
}


@pytest.mark.parametrize("name", cases(ARG_CASES))
def test_arguments_change(name):
    fn, make = ARG_CASES[name]
    run_fn(fn, make)


# ====================================================================== training steps


class TrainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.head = nn.Linear(2, 2)  # used in forward; not in the optimizer at first

    def forward(self, x):
        return self.head(self.out(self.bn(self.drop(torch.relu(self.lin(x))))))


def _make_step(opt_cls, **kw):
    torch.manual_seed(0)
    model = TrainNet()
    params = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    opt = opt_cls(params, **kw)

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return model, opt, step


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(5, 6, generator=g) + SHIFTS[i % len(SHIFTS)], torch.randn(5, 2, generator=g)


def _same_training_state(model, opt, ref_model, ref_opt, label):
    assert_same(ref_model, model, f"{label}: model", atol=ATOL, rtol=RTOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"{label}: {name}.grad"
        if p.grad is not None:
            assert_same(q.grad, p.grad, f"{label}: {name}.grad", atol=ATOL, rtol=RTOL)
    assert len(opt.param_groups) == len(ref_opt.param_groups)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        assert [k for k in group if k != "params"] == [k for k in ref_group if k != "params"]
        for p, q in zip(group["params"], ref_group["params"]):
            assert_same(dict(ref_opt.state.get(q, {})), dict(opt.state.get(p, {})),
                        f"{label}: optimizer state", atol=ATOL, rtol=RTOL)


def _step_outcome(step, i):
    torch.manual_seed(1000 + i)
    try:
        return ("ok", step(*_batch(i)))
    except Exception as e:  # noqa: BLE001 - both sides must raise the same error
        return ("raised", type(e).__name__, str(e))


def run_training(opt_cls, change, calls=CALLS, **kw):
    model, opt, step = _make_step(opt_cls, **kw)
    ref_model, ref_opt, ref_step = _make_step(opt_cls, **kw)
    fast = specularch.optimize(step)
    for i in range(calls):
        torch.manual_seed(50 + i)
        change(ref_model, ref_opt, i)
        torch.manual_seed(50 + i)
        change(model, opt, i)
        want, got = _step_outcome(ref_step, i), _step_outcome(fast, i)
        label = f"step #{i + 1}"
        assert want[0] == got[0] and (want[0] == "raised" and want == got or
                                      math.isclose(want[1], got[1], rel_tol=RTOL, abs_tol=ATOL)), \
            f"{label}: eager {want}, optimized {got}"
        _same_training_state(model, opt, ref_model, ref_opt, label)
    report = specularch.explain(fast)
    differential._judge(report, None, None, None, None, "train step")
    _show(f"train step ({opt_cls.__name__})", report)


def _group(key, values):
    def change(model, opt, i):
        opt.param_groups[0][key] = values[i % len(values)]
    return change


def _at_step(k, fn):
    def change(model, opt, i):
        if i == k:
            fn(model, opt)
    return change


def _chain(*changes):
    def change(model, opt, i):
        for c in changes:
            c(model, opt, i)
    return change


def _add_head_group(model, opt):
    opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.05})


def _scheduler(model, opt):
    opt._test_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _scheduler_steps(model, opt, i):
    if i > CHANGE:  # after the step made with the scheduler's first learning rate
        opt._test_sched.step()


LRS = [0.1, 0.1, 0.1, 0.1, 0.1, 0.05, 0.2, 0.0, 0.1, 0.01]

TRAIN_CASES = {
    "SGD lr changed every step": (torch.optim.SGD, dict(lr=0.1), _group("lr", LRS)),
    "SGD momentum 0 -> 0.9 -> 0": (torch.optim.SGD, dict(lr=0.1), _group("momentum", [0.0] * 5 + [0.9, 0.9, 0.5, 0.0, 0.9])),
    "SGD add_param_group": (torch.optim.SGD, dict(lr=0.1, momentum=0.9), _at_step(CHANGE, _add_head_group)),
    "SGD parameter frozen": (torch.optim.SGD, dict(lr=0.1, momentum=0.9), _at_step(
        CHANGE, lambda m, o: m.lin.weight.requires_grad_(False))),
    "Adam betas and eps changed": (torch.optim.Adam, dict(lr=0.01), _chain(
        _group("betas", [(0.9, 0.999)] * 5 + [(0.5, 0.9), (0.9, 0.999), (0.0, 0.5)] * 2),
        _group("eps", [1e-8] * 5 + [1e-3, 1e-8, 1.0, 1e-8, 1e-8]))),
    "Adam add_param_group": (torch.optim.Adam, dict(lr=0.01), _at_step(CHANGE, _add_head_group)),
    "AdamW StepLR from the 6th step": (torch.optim.AdamW, dict(lr=0.01), _chain(_at_step(CHANGE, _scheduler),
                                                                              _scheduler_steps)),
    "SGD gradient hook added": (torch.optim.SGD, dict(lr=0.1), _at_step(
        CHANGE, lambda m, o: m.out.weight.register_hook(lambda g: g * 10))),
}


@pytest.mark.parametrize("name", cases(TRAIN_CASES))
def test_training_step_changes(name):
    opt_cls, kw, change = TRAIN_CASES[name]
    run_training(opt_cls, change, **kw)


def _optimizer_hook(kind):
    def change(model, opt):
        getattr(opt, kind)(lambda o, args, kwargs: o.param_groups[0].__setitem__(
            "lr", o.param_groups[0]["lr"] * 0.5) if kind == "register_step_pre_hook" else None)
    return change


_OPT_HOOKS = []


def _global_optimizer_hook(model, opt):
    if not _OPT_HOOKS:  # once for both sides: it runs for every optimizer's step
        _OPT_HOOKS.append(register_optimizer_step_post_hook(
            lambda o, args, kwargs: [p.data.mul_(0.5) for g in o.param_groups for p in g["params"]]))


def _drop_global_optimizer_hooks(model=None, opt=None):
    while _OPT_HOOKS:
        _OPT_HOOKS.pop().remove()


TRAIN_HOOK_CASES = {
    "SGD step pre-hook added": (_at_step(CHANGE, _optimizer_hook("register_step_pre_hook")), None),
    "SGD step post-hook added": (_at_step(CHANGE, _optimizer_hook("register_step_post_hook")), None),
    "global optimizer step post-hook added": (_chain(_at_step(CHANGE, _global_optimizer_hook),
                                                     _at_step(UNDO, _drop_global_optimizer_hooks)),
                                              _drop_global_optimizer_hooks),
    "SGD lr becomes a tensor": (_at_step(CHANGE, lambda m, o: o.param_groups[0].__setitem__(
        "lr", torch.tensor(0.05))), None),
    "SGD foreach switched on": (_at_step(CHANGE, lambda m, o: o.param_groups[0].__setitem__("foreach", True)), None),
}


@pytest.mark.parametrize("name", cases(TRAIN_HOOK_CASES))
def test_training_step_optimizer_hooks_and_options(name):
    change, cleanup = TRAIN_HOOK_CASES[name]
    models = []

    def tracked(model, opt, i):
        models.append((model, opt))
        change(model, opt, i)
    try:
        run_training(torch.optim.SGD, tracked, lr=0.1, momentum=0.9)
    finally:
        if cleanup is not None:
            for model, opt in models:
                cleanup(model, opt)


# ====================================================================== more module state


class EMA(nn.Module):
    """A buffer assigned in forward: ``Module.__setattr__`` runs the global buffer
    registration hooks on it."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("avg", torch.zeros(6))

    def forward(self, x):
        h = self.lin(x)
        self.avg = self.avg * 0.5 + h.detach().mean(0)
        return h - self.avg


def _global_registration_hook(register, fn):
    handle = []

    def once(i):
        if i == CHANGE:
            handle.append(register(fn))
        if (i == UNDO or i is None) and handle:
            handle.pop().remove()
    return once


def test_buffer_assigned_in_forward():
    run_module(EMA, xs_rows)


def test_global_buffer_registration_hook_added():
    hook = _global_registration_hook(nn.modules.module.register_module_buffer_registration_hook,
                                     lambda mod, name, t: torch.zeros_like(t))
    run_module(EMA, xs_rows, once=hook)


class ClassScale(nn.Module):
    SCALE = 2.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        return self.lin(x) * self.SCALE


def _own_class(base):
    """A subclass of its own per test, shared by both sides (class-level changes are made
    twice, once per side, with the same value), so that they do not leak into other tests."""
    cls = type(base.__name__, (base,), {})
    return lambda: cls()


CLASS_CASES = {
    "class attribute changed": at((CHANGE, lambda m: setattr(type(m), "SCALE", -1.0))),
    "class attribute shadowed on the instance": at((CHANGE, lambda m: setattr(m, "SCALE", 7.0)),
                                                   (UNDO, lambda m: delattr(m, "SCALE"))),
    "class attribute becomes a property": at((CHANGE, lambda m: setattr(
        type(m), "SCALE", property(lambda self: self.lin.in_features * 1.0)))),
}


@pytest.mark.parametrize("name", cases(CLASS_CASES))
def test_class_attributes_changed(name):
    run_module(_own_class(ClassScale), xs_rows, between=CLASS_CASES[name])


def run_calling(make_module, call, make_args, **kw):
    """Like run_module, but each side runs ``call(module, *args)`` (the module optimized on
    the optimized side)."""
    torch.manual_seed(0)
    eager = make_module()
    torch.manual_seed(0)
    opt = specularch.optimize(make_module())
    pair = Pair(type(eager).__qualname__, functools.partial(call, eager), functools.partial(call, opt),
                opt, atol=ATOL, rtol=RTOL, eager_roots={"self": eager}, opt_roots={"self": opt})
    return drive(pair, make_args, **kw)


def _functional_call(m, x, k):
    params = {n: p.detach() * (1 + 0.1 * k) for n, p in m.named_parameters()}
    return torch.func.functional_call(m, params, (x,))


def test_functional_call_with_other_parameters_each_call():
    run_calling(MLP, _functional_call, lambda i: A(T(3, 6) + SHIFTS[i], i))


class _Plus100(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 100 if getattr(func, "__name__", "") == "relu" else out


class _Unpack2:
    """saved_tensors_hooks whose unpack doubles every saved tensor (changes gradients)."""
    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t * 2)


CONTEXT_MODULE_CASES = {
    "a TorchFunctionMode around some calls": (xs, False, _alternate(_Plus100)),
    "saved_tensors_hooks around some calls": (xs_grad, True, _alternate(_Unpack2())),
}


@pytest.mark.parametrize("name", cases(CONTEXT_MODULE_CASES))
def test_module_under_contexts(name):
    args, grad, ctx = CONTEXT_MODULE_CASES[name]
    run_module(MLP, args, grad=grad, ctx=ctx)


# ====================================================================== more function state


G_GONE = 2.0


def reads_gone(x):
    return x * G_GONE


def test_global_deleted_between_calls():
    mod = sys.modules[__name__]

    def make(i):
        if i == CHANGE:
            mod.__dict__.pop("G_GONE", None)  # (make_args runs once per side)
        if i == UNDO:
            mod.G_GONE = 3.0
        return xs(i)
    try:
        run_fn(reads_gone, make)
    finally:
        mod.G_GONE = 2.0


def reads_grad(x):
    g = x.grad
    return x.detach() * 2 + (g if g is not None else 0)


def test_argument_grad_set_between_calls():
    def make(i):
        x = T(3, 6, requires_grad=True)
        if i >= CHANGE and i % 2:
            x.grad = torch.full((3, 6), float(i))
        return A(x)
    run_fn(reads_grad, make)


def test_parameter_grads_dropped_between_calls():
    """A function reading ``.grad`` of a module's parameters; between calls the gradients are
    recomputed, zeroed or set to None (``zero_grad``)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)

    def grad_norm(scale):
        total = torch.zeros(())
        for p in model.parameters():
            total = total + p.grad.norm() * scale
        return total

    def make(i):
        model.zero_grad(set_to_none=(i in (CHANGE, UNDO)))
        if i not in (CHANGE, UNDO):
            model(torch.randn(2, 6) * (i + 1)).sum().backward()
        return A(float(i % 3))
    run_fn(grad_norm, make)


# ====================================================================== more module cases


class TwoSquare(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.register_buffer("shift", torch.linspace(-1, 1, 6))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.shift


def _tie(m):
    m.b.weight = m.a.weight


def _inference_data(m):
    with torch.inference_mode():
        data = torch.full((6, 6), 0.1)
    m.a.weight.data = data


GRAD_PARAM_MORE = {
    "weights tied": at((CHANGE, _tie)),
    "buffer made to require grad": at((CHANGE, lambda m: m.shift.requires_grad_(True))),
    ".data replaced by an inference tensor": at((CHANGE, _inference_data)),
}


@pytest.mark.parametrize("name", cases(GRAD_PARAM_MORE))
def test_parameters_tied_and_shared(name):
    run_module(TwoSquare, xs_grad, grad=True, between=GRAD_PARAM_MORE[name])


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return y, y.stride()


def _images(i):
    return A(T(2, 3, 5, 5) + SHIFTS[i % len(SHIFTS)])


CONV_CASES = {
    "module made channels_last": at((CHANGE, lambda m: m.to(memory_format=torch.channels_last))),
    "conv padding and stride changed": at((CHANGE, lambda m: setattr(m.conv, "padding", (0, 0))),
                                          (CHANGE + 1, lambda m: setattr(m.conv, "stride", (2, 2))),
                                          (UNDO, lambda m: setattr(m.conv, "padding_mode", "reflect"))),
}


@pytest.mark.parametrize("name", cases(CONV_CASES))
def test_conv_settings_changed(name):
    run_module(ConvNet, _images, between=CONV_CASES[name])


class Checkpointed(nn.Module):
    """``gradient_checkpointing_enable()``-style switch between calls."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)
        self.checkpointing = False

    def forward(self, x):
        if self.checkpointing:
            h = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=False)
        else:
            h = self.lin(x)
        return self.out(torch.relu(h))


def test_gradient_checkpointing_switched_on():
    run_module(Checkpointed, xs_grad, grad=True, between=at((CHANGE, _set_attr("checkpointing", True)),
                                                            (UNDO, _set_attr("checkpointing", False))))


def test_hook_on_one_layer_of_a_module_list():
    run_module(Listed, xs_rows, between=at(
        (CHANGE, _hook_on("layers.1", "register_forward_hook", _times(-1))), (UNDO, _remove_hooks)))


class DropList(Listed):
    def __init__(self):
        super().__init__()
        self.drops = nn.ModuleList([nn.Dropout(0.5), nn.Dropout(0.2)])

    def forward(self, x):
        for layer, drop in zip(self.layers, self.drops):
            x = drop(torch.tanh(layer(x)))
        return x


def test_one_dropout_of_a_module_list_in_eval():
    run_module(DropList, xs_rows, between=at((CHANGE, lambda m: m.drops[1].eval()),
                                             (UNDO, lambda m: m.drops[0].eval())))


def _instance_forward(self, x):
    return self.out(torch.sigmoid(self.lin(x))) * 100


def test_forward_set_on_the_instance_before_optimize():
    """``module.forward`` patched on the instance before ``optimize`` (as accelerate's
    ``add_hook_to_module`` does): eager calls the instance's forward."""
    def make():
        m = MLP()
        m.forward = types.MethodType(_instance_forward, m)
        return m
    run_module(make, xs)
