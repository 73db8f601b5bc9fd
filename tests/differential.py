"""Differential test harness: eager PyTorch vs ``specularch.optimize`` on identical inputs.

Every check builds two identical copies of the inputs (``make_args()`` is called twice under the
same seed), runs the original function on one copy and the optimized one on the other, and
compares everything a user can observe: return values (structure, types, tensor dtype / shape /
device / requires_grad / values, identity with an argument), exceptions (type and message), the
arguments after the call (tensors, lists, dicts, objects' ``__dict__``, modules' parameters,
buffers and public attributes), stdout, the global RNG state, grad mode and, with ``grad=True``,
the gradients. Then it judges what specularch says it did (``expect="graph"`` / ``"fallback"``).

``make_args`` may take one parameter: it then receives the call index (0, 1, ...), which lets a
test change shapes or Python values from one call to the next.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dis
import functools
import inspect
import io
import math
import os
import random
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

import specularch

DEFAULT_CALLS = 3
_SEED_BASE = 1234
_ATOMS = (bool, int, str, bytes, type(None), type(Ellipsis), slice, range, torch.dtype,
          torch.device, torch.layout, torch.memory_format, type)


# --------------------------------------------------------------------------- inputs

def A(*args, **kwargs):
    """``A(x, y, flag=True)`` -> ``((x, y), {"flag": True})``, the shape ``make_args`` returns."""
    return args, kwargs


def T(*shape, dtype=torch.float32, requires_grad=False, seed=None, low=-4, high=5):
    """A small random tensor. Without ``seed`` it draws from the global RNG (which the harness
    seeds before each ``make_args``); with ``seed`` it uses a private generator (for module-level
    constants)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=gen)
    elif dtype == torch.bool:
        t = torch.rand(shape, generator=gen) > 0.5
    else:
        t = torch.randint(low, high, shape, dtype=dtype, generator=gen)
    return t.requires_grad_(requires_grad)


# --------------------------------------------------------------------------- comparison

class Mismatch(AssertionError):
    """Eager and optimized runs differ in something a user can observe."""


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_user_object(obj) -> bool:
    return (hasattr(obj, "__dict__") and not isinstance(obj, (types.FunctionType, types.MethodType,
            types.ModuleType, type, functools.partial, torch.Tensor)))


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _tensor_difference(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> str | None:
    a, b = a.detach(), b.detach()
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    if a.dtype == torch.bool or not a.is_floating_point():
        differ = a != b
    else:
        a64, b64 = a.double(), b.double()
        close = (a64 == b64) | (a64.isnan() & b64.isnan())
        if atol or rtol:
            close |= (a64 - b64).abs() <= atol + rtol * b64.abs()
        differ = ~close
    if not bool(differ.any()):
        return None
    index = tuple(differ.nonzero()[0].tolist())
    return (f"{int(differ.sum())} of {differ.numel()} elements differ (atol={atol}, rtol={rtol}); "
            f"first at index {index}: eager={a[index].item()!r} optimized={b[index].item()!r}")


class _Comparer:
    def __init__(self, atol: float, rtol: float, ids_eager=None, ids_opt=None):
        self.atol, self.rtol = atol, rtol
        self.ids_eager, self.ids_opt = ids_eager, ids_opt
        self.seen: set[tuple[int, int]] = set()

    def fail(self, path: str, message: str):
        raise Mismatch(f"{path}: {message}")

    def check_identity(self, a, b, path):
        if self.ids_eager is None:
            return
        where_a, where_b = self.ids_eager.get(id(a)), self.ids_opt.get(id(b))
        if where_a != where_b:
            self.fail(path, f"identity differs: eager returned "
                      f"{'the input ' + where_a + ' itself' if where_a else 'a new object'}, optimized "
                      f"returned {'the input ' + where_b + ' itself' if where_b else 'a new object'}")

    def compare(self, a, b, path):
        key = (id(a), id(b))
        if key in self.seen:
            return
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return self.tensor(a, b, path)
        if type(a) is not type(b):
            self.fail(path, f"type differs: eager {type(a).__qualname__} {_describe(a)}, "
                      f"optimized {type(b).__qualname__} {_describe(b)}")
        if isinstance(a, _ATOMS):
            if a != b:
                self.fail(path, f"value differs: eager {a!r}, optimized {b!r}")
            return
        if isinstance(a, (float, complex)):
            return self.number(a, b, path)
        self.seen.add(key)
        if isinstance(a, types.GeneratorType):
            return self.compare(list(a), list(b), f"list({path})")
        if isinstance(a, (list, dict, set)) or _is_user_object(a):
            self.check_identity(a, b, path)
        if isinstance(a, tuple):
            self.sequence(a, b, path, a._fields if _is_namedtuple(a) else None)
        elif isinstance(a, list):
            self.sequence(a, b, path, None)
        elif isinstance(a, dict):
            if list(a) != list(b):
                self.fail(path, f"dict keys differ (order matters): eager {list(a)!r}, optimized {list(b)!r}")
            for k in a:
                self.compare(a[k], b[k], f"{path}[{k!r}]")
        elif isinstance(a, (set, frozenset)):
            if a != b:
                self.fail(path, f"set differs: eager {a!r}, optimized {b!r}")
        elif isinstance(a, collections.deque):
            if a.maxlen != b.maxlen:
                self.fail(path, f"deque maxlen differs: eager {a.maxlen}, optimized {b.maxlen}")
            self.sequence(a, b, path, None)
        elif isinstance(a, nn.Module):
            self.module(a, b, path)
        elif isinstance(a, functools.partial):
            self.compare((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), f"{path}<partial>")
        elif isinstance(a, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
            if getattr(a, "__code__", a) is not getattr(b, "__code__", b) and a != b:
                self.fail(path, f"different functions: eager {a!r}, optimized {b!r}")
        elif _is_user_object(a):
            da, db = vars(a), vars(b)
            if sorted(da) != sorted(db):
                self.fail(path, f"attributes differ: eager {sorted(da)}, optimized {sorted(db)}")
            for k in da:
                self.compare(da[k], db[k], f"{path}.{k}")
        elif a != b:
            self.fail(path, f"value differs: eager {_describe(a)}, optimized {_describe(b)}")

    def number(self, a, b, path):
        if a == b or (a != a and b != b):
            return
        if (self.atol or self.rtol) and isinstance(a, float) and math.isclose(
                a, b, rel_tol=self.rtol, abs_tol=self.atol):
            return
        self.fail(path, f"value differs: eager {a!r}, optimized {b!r}")

    def sequence(self, a, b, path, fields):
        if len(a) != len(b):
            self.fail(path, f"length differs: eager {len(a)} {_describe(a)}, optimized {len(b)} {_describe(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            self.compare(x, y, f"{path}.{fields[i]}" if fields else f"{path}[{i}]")

    def tensor(self, a, b, path):
        if type(a) is not type(b):
            self.fail(path, f"type differs: eager {type(a).__qualname__} {_describe(a)}, "
                      f"optimized {type(b).__qualname__} {_describe(b)}")
        self.check_identity(a, b, path)
        for attr in ("dtype", "shape", "device", "layout", "requires_grad"):
            va, vb = getattr(a, attr), getattr(b, attr)
            if va != vb:
                self.fail(path, f"tensor {attr} differs: eager {va}, optimized {vb}")
        problem = _tensor_difference(a, b, self.atol, self.rtol)
        if problem:
            self.fail(path, f"tensor values differ: {problem}")

    def module(self, a, b, path):
        if a.training != b.training:
            self.fail(f"{path}.training", f"eager {a.training}, optimized {b.training}")
        for kind in ("parameters", "buffers", "modules"):
            na = [n for n, _ in getattr(a, f"named_{kind}")()]
            nb = [n for n, _ in getattr(b, f"named_{kind}")()]
            if na != nb:
                self.fail(path, f"{kind} differ: eager {na}, optimized {nb}")
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            self.compare(pa, pb, f"{path}.{name}")
        for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers()):
            self.compare(ba, bb, f"{path}.{name}")
        for (name, ma), (_, mb) in zip(a.named_modules(), b.named_modules()):
            prefix = f"{path}.{name}" if name else path
            # Public plain attributes only; `forward` is where optimize() installs its wrapper.
            da = {k: v for k, v in vars(ma).items() if not k.startswith("_") and k not in ("training", "forward")}
            db = {k: v for k, v in vars(mb).items() if not k.startswith("_") and k not in ("training", "forward")}
            if sorted(da) != sorted(db):
                self.fail(prefix, f"module attributes differ: eager {sorted(da)}, optimized {sorted(db)}")
            for k in da:
                self.compare(da[k], db[k], f"{prefix}.{k}")


def assert_same(eager, opt, path="result", *, atol=0.0, rtol=0.0, ids_eager=None, ids_opt=None):
    """Assert that ``opt`` is observably the same as ``eager`` (see the module docstring).

    ``ids_eager``/``ids_opt`` map ``id(obj)`` of each input object to its path; when given, an
    output that is an input object itself must be the same input on both sides."""
    _Comparer(atol, rtol, ids_eager, ids_opt).compare(eager, opt, path)


def _reachable(root, path: str, out: list, seen: set, depth: int = 0):
    """Append (path, obj) for every tensor / list / dict / user object / module under ``root``."""
    if id(root) in seen or depth > 25 or isinstance(root, _ATOMS + (float, complex)):
        return
    if isinstance(root, torch.Tensor):
        seen.add(id(root))
        out.append((path, root))
    elif isinstance(root, nn.Module):
        seen.add(id(root))
        out.append((path, root))
        for name, t in list(root._parameters.items()) + list(root._buffers.items()):
            if t is not None:
                _reachable(t, f"{path}.{name}", out, seen, depth + 1)
        for name, sub in root._modules.items():
            if sub is not None:
                _reachable(sub, f"{path}.{name}", out, seen, depth + 1)
    elif isinstance(root, (list, tuple)):
        seen.add(id(root))
        if isinstance(root, list):
            out.append((path, root))
        for i, item in enumerate(root):
            _reachable(item, f"{path}[{i}]", out, seen, depth + 1)
    elif isinstance(root, dict):
        seen.add(id(root))
        out.append((path, root))
        for k, v in root.items():
            _reachable(v, f"{path}[{k!r}]", out, seen, depth + 1)
    elif isinstance(root, (set, frozenset)):
        seen.add(id(root))
        out.append((path, root))
    elif _is_user_object(root):
        seen.add(id(root))
        out.append((path, root))
        for k, v in vars(root).items():
            _reachable(v, f"{path}.{k}", out, seen, depth + 1)


def _inputs(roots: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list = []
    seen: set = set()
    for name, root in roots.items():
        _reachable(root, name, out, seen)
    return out


# --------------------------------------------------------------------------- running

@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    stdout: str = ""
    rng: torch.Tensor | None = None
    python_rng: tuple | None = None  # Python's random module
    grad_enabled: bool = True
    state: Any = None


def _run(fn, args, kwargs, seed, state) -> Outcome:
    if state is not None:
        state[0]()
    grad_mode = torch.is_grad_enabled()
    out = Outcome()
    buffer = io.StringIO()
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        with contextlib.redirect_stdout(buffer):
            out.value = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every exception is part of the observable result
        out.error = exc
    out.stdout = buffer.getvalue()
    out.rng = torch.get_rng_state()
    out.python_rng = random.getstate()
    out.grad_enabled = torch.is_grad_enabled()
    torch.set_grad_enabled(grad_mode)
    if state is not None:
        out.state = state[1]()
    return out


def _grad_weight(t: torch.Tensor, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99 + index)
    return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)


def _backward(value, label: str, side: str):
    leaves = [t for _, t in _inputs({"result": value})
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not leaves:
        raise AssertionError(f"{label}: grad=True but the {side} result has no floating tensor that "
                             f"requires grad (test bug)")
    loss = sum((t * _grad_weight(t, i)).sum() for i, t in enumerate(leaves))
    loss.backward()


class Pair:
    """An eager callable and its optimized twin, called in lockstep on identical inputs.

    ``roots`` name extra objects whose state is compared after each call (e.g. ``self`` for
    modules). ``state=(reset, read)``: ``reset()`` runs before each side's call and ``read()``
    after it, and the two reads must be the same (for globals and other shared state)."""

    def __init__(self, name, eager, opt, explain_target, *, atol=0.0, rtol=0.0, grad=False,
                 eager_roots=None, opt_roots=None, state=None):
        self.name, self.eager, self.opt, self.target = name, eager, opt, explain_target
        self.atol, self.rtol, self.grad, self.state = atol, rtol, grad, state
        self.eager_roots, self.opt_roots = eager_roots or {}, opt_roots or {}
        self.calls = 0

    @classmethod
    def of_function(cls, fn, *, backend=None, **kw) -> "Pair":
        opt = specularch.optimize(fn) if backend is None else specularch.optimize(fn, backend=backend)
        if inspect.isfunction(fn):
            assert getattr(opt, "__wrapped__", None) is fn, "optimize(fn) must return a functools.wraps wrapper"
            assert opt.__name__ == fn.__name__
        return cls(getattr(fn, "__qualname__", repr(fn)), fn, opt, opt, **kw)

    @classmethod
    def of_module(cls, make_module, *, backend=None, **kw) -> "Pair":
        torch.manual_seed(0)
        eager = make_module()
        torch.manual_seed(0)
        opt = make_module()
        assert_same(eager, opt, "module before optimize (make_module is not deterministic)")
        cls_forward = type(opt).__dict__.get("forward")
        result = specularch.optimize(opt) if backend is None else specularch.optimize(opt, backend=backend)
        assert result is opt, "optimize(module) must return the same module object"
        assert type(opt).__dict__.get("forward") is cls_forward, \
            "optimize(module) must not change the class's forward (other instances stay eager)"
        return cls(type(eager).__qualname__, eager, opt, opt, eager_roots={"self": eager},
                   opt_roots={"self": opt}, **kw)

    def explain(self):
        return specularch.explain(self.target)

    def apply(self, change: Callable[[Any], Any]):
        """Apply the same change to both sides' roots (modules): ``pair.apply(lambda m: m.eval())``."""
        change(self.eager_roots.get("self", self.eager))
        change(self.opt_roots.get("self", self.opt))

    def _make(self, make_args, index, seed):
        torch.manual_seed(seed)
        made = make_args(index) if _takes_argument(make_args) else make_args()
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict)):
            raise TypeError(f"make_args must return (args, kwargs); got {_describe(made)}")
        return tuple(made[0]), dict(made[1])

    def step(self, make_args) -> Any:
        """One call on each side; returns the eager result (or raises Mismatch)."""
        index = self.calls
        self.calls += 1
        label = f"call #{index + 1} of {self.name}"
        seed = _SEED_BASE + index
        args_e, kw_e = self._make(make_args, index, seed)
        args_o, kw_o = self._make(make_args, index, seed)
        try:
            assert_same(args_e, args_o, "args")
            assert_same(kw_e, kw_o, "kwargs")
        except Mismatch as err:
            raise AssertionError(f"{label}: make_args is not deterministic: {err}") from None
        inputs_e = _inputs({"args": args_e, "kwargs": kw_e, **self.eager_roots})
        inputs_o = _inputs({"args": args_o, "kwargs": kw_o, **self.opt_roots})
        ids_e = {id(o): p for p, o in inputs_e}
        ids_o = {id(o): p for p, o in inputs_o}

        eager = _run(self.eager, args_e, kw_e, seed, self.state)
        opt = _run(self.opt, args_o, kw_o, seed, self.state)
        try:
            self._compare(eager, opt, ids_e, ids_o)
            after = _Comparer(self.atol, self.rtol)
            after.compare(args_e, args_o, "args (after the call)")
            after.compare(kw_e, kw_o, "kwargs (after the call)")
            for name in self.eager_roots:
                after.compare(self.eager_roots[name], self.opt_roots[name], f"{name} (after the call)")
            if self.grad and eager.error is None:
                self._compare_grads(eager, opt, inputs_e, inputs_o, label)
        except Mismatch as err:
            raise Mismatch(f"{label}: {err}") from None
        return eager.value

    def _compare(self, eager: Outcome, opt: Outcome, ids_e, ids_o):
        if eager.error is not None or opt.error is not None:
            if eager.error is None:
                raise Mismatch(f"optimized call raised {type(opt.error).__name__}: {opt.error}; eager "
                               f"returned {_describe(eager.value)}") from opt.error
            if opt.error is None:
                raise Mismatch(f"eager raised {type(eager.error).__name__}({str(eager.error)!r}) but the "
                               f"optimized call returned {_describe(opt.value)}")
            if type(eager.error) is not type(opt.error) or str(eager.error) != str(opt.error):
                raise Mismatch(f"exception differs: eager {type(eager.error).__name__}({str(eager.error)!r}), "
                               f"optimized {type(opt.error).__name__}({str(opt.error)!r})") from opt.error
        else:
            assert_same(eager.value, opt.value, "result", atol=self.atol, rtol=self.rtol,
                        ids_eager=ids_e, ids_opt=ids_o)
        if eager.stdout != opt.stdout:
            raise Mismatch(f"stdout differs: eager {eager.stdout!r}, optimized {opt.stdout!r}")
        if not torch.equal(eager.rng, opt.rng):
            raise Mismatch("global RNG state differs after the call: the optimized call drew a different "
                           "amount of random numbers than eager (ran something twice or skipped it)")
        if eager.python_rng != opt.python_rng:
            raise Mismatch("Python's random module is in another state after the call: the optimized "
                           "call made another number of random.random() draws than eager")
        if eager.grad_enabled != opt.grad_enabled:
            raise Mismatch(f"grad mode after the call differs: eager {eager.grad_enabled}, "
                           f"optimized {opt.grad_enabled}")
        if self.state is not None:
            assert_same(eager.state, opt.state, "state", atol=self.atol, rtol=self.rtol)

    def _compare_grads(self, eager, opt, inputs_e, inputs_o, label):
        _backward(eager.value, label, "eager")
        _backward(opt.value, label, "optimized")
        leaves_e = [(p, t) for p, t in inputs_e if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
        leaves_o = [(p, t) for p, t in inputs_o if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
        assert [p for p, _ in leaves_e] == [p for p, _ in leaves_o]
        if not any(t.grad is not None for _, t in leaves_e):
            raise AssertionError(f"{label}: grad=True but no input received a gradient in eager (test bug)")
        for (path, te), (_, to) in zip(leaves_e, leaves_o):
            if (te.grad is None) != (to.grad is None):
                raise Mismatch(f"{path}.grad: eager {'None' if te.grad is None else 'a tensor'}, "
                               f"optimized {'None' if to.grad is None else 'a tensor'}")
            if te.grad is not None:
                assert_same(te.grad, to.grad, f"{path}.grad", atol=self.atol, rtol=self.rtol)
            te.grad = to.grad = None


def _takes_argument(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


# --------------------------------------------------------------------------- expectations

def _source_file(obj) -> str:
    obj = inspect.unwrap(obj) if callable(obj) and not isinstance(obj, nn.Module) else obj
    if isinstance(obj, functools.partial):
        return _source_file(obj.func)
    if isinstance(obj, nn.Module):
        obj = type(obj).forward
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    return obj.__code__.co_filename


def _same_file(a: str, b: str) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def expect_graph(explanation, what="function"):
    """Everything ran as graphs: no fallback recorded and at least one graph captured."""
    assert explanation.fallbacks == [], (
        f"{what}: expected no fallback, got {len(explanation.fallbacks)}:\n"
        + "\n".join(str(r) for r in explanation.fallbacks) + f"\n--- explain() ---\n{explanation}")
    assert len(explanation.graphs) >= 1, f"{what}: expected a captured graph, got none\n{explanation}"


def expect_fallback(explanation, kind, *, filename=None, lineno=None, what="function"):
    """A fallback of ``kind`` (a string or a tuple of acceptable kinds) was recorded, at the user's
    file (and line, if given)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    for k in kinds:
        assert k in specularch.records.FALLBACK_KINDS, f"test bug: unknown fallback kind {k!r}"
    found = [r for r in explanation.fallbacks if r.kind in kinds]
    assert found, (f"{what}: expected a fallback of kind {' or '.join(kinds)}, got "
                   f"{[r.kind for r in explanation.fallbacks]}\n--- explain() ---\n{explanation}")
    for rec in found:
        assert rec.explanation and rec.hint, f"fallback record without explanation/hint: {rec}"
        assert rec.count >= 1 and rec.location == f"{rec.filename}:{rec.lineno}"
    if filename is not None:
        assert any(_same_file(r.filename, filename) for r in found), (
            f"{what}: fallback {kinds} should point at the user's file {filename}, got "
            f"{[r.location for r in found]}")
    if lineno is not None:
        assert any(r.lineno == lineno for r in found if filename is None or _same_file(r.filename, filename)), (
            f"{what}: fallback {kinds} should point at line {lineno}, got {[r.location for r in found]}")
    assert explanation.stats.fallback_calls >= 1, f"{what}: stats.fallback_calls should count the fallback"
    return found


def _judge(explanation, expect, fallback_kind, fallback_file, fallback_line, what):
    bugs = [str(f) for f in explanation.fallbacks if f.kind == "internal_error"]
    assert not bugs, f"{what}: specularch hit an internal error (a bug, even if the result " \
                     f"was right):\n" + "\n".join(bugs)
    if len(explanation.fallbacks) < specularch.config.max_fallback_records:
        counted = sum(f.count for f in explanation.fallbacks)
        assert counted == explanation.stats.fallback_calls, (
            f"{what}: the fallback records count {counted} eager calls, stats.fallback_calls "
            f"says {explanation.stats.fallback_calls}\n{explanation}")
    if expect == "graph":
        assert fallback_kind is None, "test bug: fallback_kind given with expect='graph'"
        expect_graph(explanation, what)
    elif expect == "fallback":
        assert fallback_kind is not None, "test bug: expect='fallback' needs fallback_kind"
        expect_fallback(explanation, fallback_kind, filename=fallback_file, lineno=fallback_line, what=what)
    else:
        assert expect is None, f"test bug: expect must be 'graph', 'fallback' or None, not {expect!r}"
        assert fallback_kind is None, "test bug: fallback_kind needs expect='fallback'"


def _strictness(expect):
    # A fallback test is about the silent fallback; keep it silent even under SPECULARCH_STRICT=1.
    return specularch.config.patch(strict=False) if expect == "fallback" else contextlib.nullcontext()


def mse_train_step(model, opt, after=None):
    """The plain training step ``(x, y) -> loss.item()`` (MSE loss); ``after(model, loss)``
    replaces the returned value (e.g. to read a parameter after ``opt.step()``)."""
    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item() if after is None else after(model, loss)
    return train_step


def ce_train_step(model, opt):
    """The plain training step ``(x, labels) -> loss.item()`` (cross-entropy loss)."""
    def train_step(x, labels):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


def lm_train_step(model, opt):
    """A language model's training step ``(tokens, targets) -> loss`` (cross-entropy over
    every position of the ``(batch, time, vocab)`` logits)."""
    def step(tokens, targets):
        opt.zero_grad()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        return loss
    return step


def check(fn, make_args, *, calls=DEFAULT_CALLS, expect=None, fallback_kind=None, fallback_line=None,
          fallback_file=None, atol=0.0, rtol=0.0, grad=False, backend=None, state=None):
    """Run ``fn`` eagerly and optimized ``calls`` times on identical inputs and compare everything;
    then judge the explanation (``expect="graph"`` / ``"fallback"``). Returns ``explain(opt)``."""
    with _strictness(expect):
        pair = Pair.of_function(fn, backend=backend, atol=atol, rtol=rtol, grad=grad, state=state)
        for _ in range(calls):
            pair.step(make_args)
    explanation = pair.explain()
    _judge(explanation, expect, fallback_kind, fallback_file or _source_file(fn), fallback_line, pair.name)
    return explanation


def check_module(make_module, make_args, *, calls=DEFAULT_CALLS, expect=None, fallback_kind=None,
                 fallback_line=None, fallback_file=None, atol=0.0, rtol=0.0, grad=False, backend=None,
                 between=None):
    """Like ``check`` for an nn.Module: two modules built under ``torch.manual_seed(0)``, one
    optimized; outputs, parameters, buffers, public attributes and (``grad=True``) parameter
    gradients compared after every call. ``between(module, i)`` runs on both modules before
    call ``i`` (to flip flags, replace parameters, toggle train/eval)."""
    with _strictness(expect):
        pair = Pair.of_module(make_module, backend=backend, atol=atol, rtol=rtol, grad=grad)
        for i in range(calls):
            if between is not None:
                pair.apply(lambda m: between(m, i))
            pair.step(make_args)
    explanation = pair.explain()
    _judge(explanation, expect, fallback_kind, fallback_file or _source_file(pair.opt), fallback_line, pair.name)
    return explanation


def module_globals(module_name: str, **initial):
    """``state=`` for ``check``: resets the named globals of a module to (copies of) ``initial``
    before each side's call and reads them back after it."""
    module = sys.modules[module_name]

    def reset():
        for name, value in initial.items():
            setattr(module, name, copy.deepcopy(value))

    def read():
        return {name: getattr(module, name) for name in initial}

    return reset, read


# --------------------------------------------------------------------------- source helpers

def _code_of(obj) -> types.CodeType:
    if isinstance(obj, types.CodeType):
        return obj
    if isinstance(obj, nn.Module):
        obj = type(obj).forward
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, functools.partial):
        obj = obj.func
    obj = inspect.unwrap(obj)
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    return obj.__code__


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def assert_uses_opcode(fn, opname: str, argrepr: str | None = None):
    """Assert that ``opname`` (optionally with this ``argrepr``, e.g. ``"+="`` for BINARY_OP) occurs
    in ``fn``'s bytecode or in a code object nested in it (comprehensions, lambdas, inner defs)."""
    assert opname in dis.opmap, f"{opname} is not an opcode of this Python version"
    used = set()
    for code in _code_objects(_code_of(fn)):
        for ins in dis.get_instructions(code):
            used.add(ins.opname if ins.opname != "BINARY_OP" else f"BINARY_OP {ins.argrepr}")
            if ins.opname == opname and (argrepr is None or ins.argrepr == argrepr):
                return
    raise AssertionError(f"{getattr(fn, '__qualname__', fn)} does not use {opname}"
                         f"{' ' + argrepr if argrepr else ''}; it uses {sorted(used)}")


def marker_line(obj, marker: str) -> int:
    """Line number (in ``obj``'s file) of the line in ``obj``'s source ending with ``# <marker>``."""
    if isinstance(obj, nn.Module):
        obj = type(obj)
    lines, start = inspect.getsourcelines(inspect.unwrap(obj) if callable(obj) else obj)
    hits = [start + i for i, line in enumerate(lines) if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times in {obj!r}"
    return hits[0]


def graph_code_without_comments(graph) -> str:
    """A graph's readable code with comments removed (they may quote the user's source)."""
    return "\n".join(line.split("#", 1)[0] for line in graph.code.splitlines())
