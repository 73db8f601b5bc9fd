"""Guards: the facts a captured graph assumed, each able to check and explain itself.

A guard is a frozen dataclass on a source. ``conditions(v, consts)`` returns Python boolean
expressions over ``v`` (the expression of the source's value) used by the compiled fast check
(see ``codegen.py``); ``reason(value)`` says, in words, why a given value fails it
("``L['x'].shape`` expected (4, 8), got (3, 8) — model.py:12").
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Any

import math
import weakref

import torch

from .._torch_nn import (GLOBAL_HOOKS_OWNER, GLOBAL_OPTIMIZER_HOOK_TABLES,
                         GLOBAL_OPTIMIZER_HOOKS_OWNER, REGISTRATION_HOOK_TABLES,
                         global_module_hooks, global_module_hooks_expr, registration_hooks)
from .sources import Source


def const_name(consts: dict[str, Any], value: Any) -> str:
    """Name under which ``value`` is visible to the generated check function."""
    for name, existing in consts.items():
        if existing is value:
            return name
    name = f"K{len(consts)}"
    consts[name] = value
    return name


@dataclass(frozen=True, eq=False)
class Guard:
    source: Source | None
    where: str = field(default="", kw_only=True)

    def key(self) -> tuple:
        """Identity for de-duplication: a guard set holds one guard per key."""
        return (type(self).__name__, str(self.source))

    def conditions(self, v: str, consts: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def reason(self, value: Any) -> str | None:
        """None when ``value`` satisfies the guard, else expected-vs-actual in words."""
        consts: dict[str, Any] = {}
        for cond in self.conditions("v", consts):
            try:
                ok = eval(cond, {**consts, "type": type, "len": len, "list": list, "hasattr": hasattr},
                          {"v": value})
            except Exception as e:  # an attribute vanished, etc.
                ok, cond = False, f"{cond} (raised {type(e).__name__})"
            if not ok:
                text = self.mismatch(value)
                sep = "" if text.startswith(".") else " "
                return f"{self.source}{sep}{text}{self._at()}"
        return None

    def mismatch(self, value: Any) -> str:
        return f"failed: {self.describe()} (got {_short(value)})"

    def _at(self) -> str:
        return f" — {self.where}" if self.where else ""

    def __str__(self) -> str:
        return f"{self.describe()}{self._at()}"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"Tensor(dtype={value.dtype}, shape={tuple(value.shape)}, device={value.device}, "
                f"requires_grad={value.requires_grad})")
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


@dataclass(frozen=True, eq=False)
class TypeGuard(Guard):
    expected: type

    def conditions(self, v, consts):
        return [f"type({v}) is {const_name(consts, self.expected)}"]

    def describe(self):
        return f"type({self.source}) is {self.expected.__qualname__}"

    def mismatch(self, value):
        return f"expected type {self.expected.__qualname__}, got {type(value).__qualname__}"


@dataclass(frozen=True, eq=False)
class IdGuard(Guard):
    """The very same object (modules, functions, classes called or read).

    The object is held through a weak reference where it can be: a strong one would keep
    every module a graph was captured for alive as long as its cache (which its own
    ``optimize`` state is). A dead reference fails the guard (the call recaptures); it can
    never match a new object that reuses the id, since a dead ``weakref.ref`` returns None.
    """

    obj: InitVar[Any]
    ref: Any = field(init=False, repr=False)  # () -> the object, or None once it died
    weak: bool = field(init=False, repr=False)

    def __post_init__(self, obj):
        try:
            ref, weak = weakref.ref(obj), True
        except TypeError:  # builtins, ints ...: no weak references; they are long-lived
            ref, weak = _Strong(obj), False
        object.__setattr__(self, "ref", ref)
        object.__setattr__(self, "weak", weak)

    @property
    def expected(self) -> Any:
        return self.ref()

    def conditions(self, v, consts):
        if not self.weak:
            return [f"{v} is {const_name(consts, self.ref.obj)}"]
        # ``is not None``: a dead reference must not match a source that now reads None
        return [f"{v} is {const_name(consts, self.ref)}() is not None"]

    def describe(self):
        obj = self.ref()
        if obj is None and self.weak:
            return f"{self.source} is <an object that no longer exists>"
        return f"{self.source} is <{type(obj).__qualname__} at {id(obj):#x}>"

    def mismatch(self, value):
        if self.ref() is None and self.weak:
            return "expected the object seen at capture, which no longer exists"
        return f"expected the same object as at capture, got another {type(value).__qualname__}"


def refers_to_dead(guards) -> bool:
    """Whether some guard holds an object that no longer exists: they can never pass again."""
    return any(type(g) is IdGuard and g.weak and g.ref() is None for g in guards)


class _Strong:
    """``weakref.ref``'s interface for an object that cannot be weakly referenced."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


def _inexact_eq(b: Any) -> bool:
    """Whether ``== b`` does not mean "the same float": for ±0.0 and nan."""
    return type(b) is float and (b == 0.0 or b != b)


def same_value(a: Any, b: Any) -> bool:
    """``a == b``, except that floats must be the same float: ``==`` cannot tell -0.0 from 0.0
    (``1 / x``, ``copysign``, formatting differ) and is never true for nan."""
    if type(a) is float and _inexact_eq(b):
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (a != a and b != b)
    return a == b


def equal_condition(expr: str, expected: Any, consts: dict) -> str:
    """Guard text: ``expr`` still equals ``expected`` (exactly, for floats; see same_value)."""
    if _inexact_eq(expected):
        return f"{const_name(consts, same_value)}({expr}, {const_name(consts, expected)})"
    return f"{expr} == {const_name(consts, expected)}"


@dataclass(frozen=True, eq=False)
class ValueGuard(Guard):
    """A Python value (int, bool, str, None, dtype, ...) baked into the graph."""

    expected: Any

    def conditions(self, v, consts):
        t = type(self.expected)
        if self.expected is None or isinstance(self.expected, bool):
            return [f"{v} is {const_name(consts, self.expected)}"]
        return [f"type({v}) is {const_name(consts, t)}", equal_condition(v, self.expected, consts)]

    def describe(self):
        return f"{self.source} == {self.expected!r}"

    def mismatch(self, value):
        return f"expected {self.expected!r}, got {_short(value)}"


@dataclass(frozen=True, eq=False)
class LenGuard(Guard):
    expected_type: type
    expected: int

    def conditions(self, v, consts):
        return [f"type({v}) is {const_name(consts, self.expected_type)}", f"len({v}) == {self.expected}"]

    def describe(self):
        return f"len({self.source}) == {self.expected} ({self.expected_type.__qualname__})"

    def mismatch(self, value):
        if type(value) is not self.expected_type:
            return f"expected type {self.expected_type.__qualname__}, got {type(value).__qualname__}"
        return f"expected length {self.expected}, got {len(value)}"


@dataclass(frozen=True, eq=False)
class DictKeysGuard(Guard):
    expected_type: type
    keys: tuple
    relaxable: bool = False  # a user dict read whole; may be relaxed to keyed access

    def conditions(self, v, consts):
        return [f"type({v}) is {const_name(consts, self.expected_type)}",
                f"list({v}) == {const_name(consts, list(self.keys))}"]

    def describe(self):
        return f"keys of {self.source} == {list(self.keys)!r}"

    def mismatch(self, value):
        return f"expected keys {list(self.keys)!r}, got {_short(list(value)) if isinstance(value, dict) else _short(value)}"


@dataclass(frozen=True, eq=False)
class ContainsGuard(Guard):
    """Whether one key is in a dict whose key set is not guarded (``KeyedDictV``)."""

    key_value: Any = None
    expected: bool = True

    def key(self):
        return ("Contains", str(self.source), repr(self.key_value))

    def conditions(self, v, consts):
        return [f"({const_name(consts, self.key_value)} in {v}) is {self.expected}"]

    def describe(self):
        return f"({self.key_value!r} in {self.source}) is {self.expected}"

    def mismatch(self, value):
        return f"expected {self.key_value!r} {'in' if self.expected else 'not in'} it"


@dataclass(frozen=True, eq=False)
class TensorGuard(Guard):
    """Type, dtype, device, shape, strides and requires_grad of a tensor."""

    tensor_type: type
    dtype: torch.dtype
    device: torch.device
    shape: tuple
    stride: tuple
    requires_grad: bool
    dynamic: frozenset = frozenset()  # dims whose size may vary (strides then unchecked)
    contiguous: bool = True
    # For a non-Parameter tensor that requires grad: whether it was a leaf (no autograd
    # history). A graph's backward stops at its inputs; eager's goes on into their history.
    leaf: bool | None = None

    @staticmethod
    def of(source: Source, t: torch.Tensor, where: str = "") -> "TensorGuard":
        return TensorGuard(source, type(t), t.dtype, t.device, tuple(t.shape), tuple(t.stride()),
                           t.requires_grad, where=where)

    def conditions(self, v, consts):
        conds = [f"type({v}) is {const_name(consts, self.tensor_type)}",
                 f"{v}.dtype is {const_name(consts, self.dtype)}",
                 f"{v}.device == {const_name(consts, self.device)}"]
        if self.dynamic:
            conds.append(f"{v}.dim() == {len(self.shape)}")
            conds += [f"{v}.shape[{d}] == {s}" for d, s in enumerate(self.shape) if d not in self.dynamic]
            conds.append(f"{v}.is_contiguous() is {self.contiguous}")
        else:
            conds += [f"{v}.shape == {self.shape!r}", f"{v}.stride() == {self.stride!r}"]
        conds.append(f"{v}.requires_grad is {self.requires_grad}")
        return conds + ([self.leaf_condition(v)] if self.leaf is not None else [])

    def leaf_condition(self, v: str) -> str:
        return f"({v}.grad_fn is None) is {self.leaf}"

    def shown_shape(self) -> tuple:
        return tuple("?" if d in self.dynamic else s for d, s in enumerate(self.shape))

    def describe(self):
        stride = f"stride={self.stride}, " if not self.dynamic else ""
        leaf = "" if self.leaf is None else f", leaf={self.leaf}"
        return (f"{self.source}: {self.tensor_type.__name__}(dtype={self.dtype}, "
                f"shape={self.shown_shape()}, {stride}device={self.device}, "
                f"requires_grad={self.requires_grad}{leaf})")

    def mismatch(self, value):
        if not isinstance(value, torch.Tensor):
            return f"expected a {self.tensor_type.__name__}, got {type(value).__qualname__}"
        if value.dim() == len(self.shape):
            for d, (want, got) in enumerate(zip(self.shape, value.shape)):
                if d not in self.dynamic and want != got:
                    return f".shape[{d}] expected {want}, got {got}"
        got_shape = tuple("?" if d in self.dynamic else s for d, s in enumerate(value.shape))
        for name, want, got in (("type", self.tensor_type, type(value)), ("dtype", self.dtype, value.dtype),
                                ("device", self.device, value.device), ("shape", self.shown_shape(), got_shape),
                                ("stride", None if self.dynamic else self.stride,
                                 None if self.dynamic else tuple(value.stride())),
                                ("requires_grad", self.requires_grad, value.requires_grad),
                                ("is_leaf", self.leaf, None if self.leaf is None else value.grad_fn is None)):
            if want != got:
                shown = (lambda x: x.__name__) if name == "type" else repr
                return f".{name} expected {shown(want)}, got {shown(got)}"
        return "did not match"


@dataclass(frozen=True, eq=False)
class ExprGuard(Guard):
    """A Python value computed from the frame (e.g. ``L[0].shape[0] > 2`` for a dynamic
    dimension that steered control flow) keeps the value it had at capture."""

    expr: str = ""
    expected: Any = None
    label: str = ""  # the expression as the user would write it (L['x'].shape[0] > 2)

    def key(self):
        return ("Expr", self.expr)

    def conditions(self, v, consts):
        return [equal_condition(self.expr, self.expected, consts)]

    def describe(self):
        return f"{self.label or self.expr} == {self.expected!r}"

    def reason(self, value):
        return None  # evaluated by GuardSet.first_failure with the frame roots


@dataclass(frozen=True, eq=False)
class HasAttrGuard(Guard):
    """Whether an object has an attribute (``hasattr``/``getattr`` with a default)."""

    name: str = ""
    expected: bool = True

    def key(self):
        return ("HasAttr", str(self.source), self.name)

    def conditions(self, v, consts):
        return [f"hasattr({v}, {self.name!r}) is {self.expected}"]

    def describe(self):
        return f"hasattr({self.source}, {self.name!r}) is {self.expected}"

    def mismatch(self, value):
        return f"expected hasattr(..., {self.name!r}) to be {self.expected}"


@dataclass(frozen=True, eq=False)
class NoHooksGuard(Guard):
    """An nn.Module whose call was inlined has no hooks (hooks would change what runs) and,
    with ``cls``, is still of that class (``m.__class__ = Other`` changes its ``forward``)."""

    HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    cls: Any = None

    def conditions(self, v, consts):
        same = [] if self.cls is None else [f"type({v}) is {const_name(consts, self.cls)}"]
        return same + [f"not {v}.{d}" for d in self.HOOK_DICTS]

    def describe(self):
        of = "" if self.cls is None else f" and is a {self.cls.__qualname__}"
        return f"{self.source} has no forward/backward hooks{of}"

    def mismatch(self, value):
        if self.cls is not None and type(value) is not self.cls:
            return f"is a {type(value).__qualname__} now (a {self.cls.__qualname__} at capture)"
        return "has hooks registered now (hooks were absent at capture)"


@dataclass(frozen=True, eq=False)
class NoStepHooksGuard(NoHooksGuard):
    """An optimizer whose ``step()`` was captured has no step hooks of its own."""

    HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")

    def conditions(self, v, consts):  # and no global ones (register_optimizer_step_pre_hook)
        owner = const_name(consts, GLOBAL_OPTIMIZER_HOOKS_OWNER)
        return super().conditions(v, consts) + [f"not {owner}.{name}"
                                                for name in GLOBAL_OPTIMIZER_HOOK_TABLES]

    def describe(self):
        return f"{self.source} has no step hooks (nor are global ones set)"

    def mismatch(self, value):
        return "has step hooks registered now (they were absent at capture)"


@dataclass(frozen=True, eq=False)
class NotNoneGuard(Guard):
    """The value is not None, whatever it is (``zero_grad()`` sets a gradient that is not None
    to None: what the gradient was does not matter)."""

    def conditions(self, v, consts):
        return [f"{v} is not None"]

    def describe(self):
        return f"{self.source} is not None"

    def mismatch(self, value):
        return "expected a value, got None"


@dataclass(frozen=True, eq=False)
class InferenceGuard(Guard):
    """Whether a tensor input is an inference tensor stays as at capture. An input that was one:
    its views are inference tensors too, and the rebuilt results hand them out as such
    (grad_mode.py). One the call writes in place (at commit, outside inference mode) must not
    be one: torch refuses that write, and it would fail halfway through a commit."""

    expected: bool = True

    def key(self):
        return ("Inference", str(self.source), self.expected)

    def conditions(self, v, consts):
        return [f"{'' if self.expected else 'not '}{v}.is_inference()"]

    def describe(self):
        return f"{self.source} is {'' if self.expected else 'not '}an inference tensor"

    def mismatch(self, value):
        if self.expected:
            return "is not an inference tensor now (it was one at capture)"
        return "is an inference tensor now (made under torch.inference_mode(); it was not at capture)"


@dataclass(frozen=True, eq=False)
class NoTensorHooksGuard(Guard):
    """A tensor whose gradient the graph computes has no gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``): a captured backward would not run them."""

    def conditions(self, v, consts):
        return [f"not {v}._backward_hooks", f"not {v}._post_accumulate_grad_hooks"]

    def describe(self):
        return f"{self.source} has no gradient hooks"

    def mismatch(self, value):
        return "has gradient hooks registered now (they were absent at capture)"


@dataclass(frozen=True, eq=False)
class NoGlobalHooksGuard(Guard):
    """No global module hook was registered since capture (it would run around every module
    call the graph inlined)."""

    def key(self):
        return ("NoGlobalHooks",)

    def conditions(self, v, consts):
        return [f"not {global_module_hooks_expr(const_name(consts, GLOBAL_HOOKS_OWNER))}"]

    def describe(self):
        return "no global nn.Module hooks are registered"

    def mismatch(self, value):
        return "global nn.Module hooks are registered now"

    def reason(self, value):
        return f"{self.mismatch(value)}{self._at()}" if global_module_hooks() else None


@dataclass(frozen=True, eq=False)
class NoRegistrationHooksGuard(Guard):
    """No global buffer/parameter/module registration hook was registered since capture (it
    would run, and may replace the value, at an assignment the commit replays)."""

    def key(self):
        return ("NoRegistrationHooks",)

    def conditions(self, v, consts):
        owner = const_name(consts, GLOBAL_HOOKS_OWNER)
        return [f"not {owner}.{name}" for name in REGISTRATION_HOOK_TABLES]

    def describe(self):
        return "no global buffer/parameter/module registration hooks are registered"

    def mismatch(self, value):
        return "global buffer/parameter/module registration hooks are registered now"

    def reason(self, value):
        return f"{self.mismatch(value)}{self._at()}" if registration_hooks() else None


@dataclass(frozen=True, eq=False)
class NotShadowedGuard(Guard):
    """A builtin name is not shadowed by a module global of the same name."""

    name: str = ""

    def key(self):
        return ("NotShadowed", self.name)

    def conditions(self, v, consts):
        return [f"{self.name!r} not in G"]

    def describe(self):
        return f"global {self.name!r} does not shadow the builtin"

    def reason(self, value):
        return None if value is None else f"global {self.name!r} now shadows the builtin{self._at()}"


@dataclass(frozen=True, eq=False)
class GlobalStateGuard(Guard):
    """Process state that changes what torch ops compute: grad mode, inference mode (its
    tensors are inference tensors), autocast (CPU and CUDA) and the default dtype (used by
    factory functions such as ``torch.zeros``)."""

    grad_enabled: bool = True
    autocast: tuple = (False, False, None, None)  # (cpu, cuda) enabled, then their dtypes
    default_dtype: Any = None
    inference_mode: bool = False

    @staticmethod
    def now() -> "GlobalStateGuard":
        return GlobalStateGuard(None, grad_enabled=torch.is_grad_enabled(), autocast=_autocast(),
                                default_dtype=torch.get_default_dtype(),
                                inference_mode=torch.is_inference_mode_enabled())

    def key(self):
        return ("GlobalState",)

    def conditions(self, v, consts):
        return [*self.dispatch_conditions(consts), self.inference_condition(consts)]

    def dispatch_conditions(self, consts) -> list[str]:
        """Grad mode, autocast and the default dtype: what torch's C++ global-state check
        covers too (codegen.py), unlike inference mode."""
        return [f"{const_name(consts, torch.is_grad_enabled)}() is {self.grad_enabled}",
                f"{const_name(consts, _autocast)}() == {const_name(consts, self.autocast)}",
                f"{const_name(consts, torch.get_default_dtype)}() is {const_name(consts, self.default_dtype)}"]

    def inference_condition(self, consts) -> str:
        return f"{const_name(consts, torch.is_inference_mode_enabled)}() is {self.inference_mode}"

    def holds_now(self) -> bool:
        now = GlobalStateGuard.now()
        return all(getattr(now, name) == getattr(self, name)
                   for name in ("grad_enabled", "autocast", "default_dtype", "inference_mode"))

    def describe(self):
        return (f"torch.is_grad_enabled() is {self.grad_enabled}, autocast(cpu, cuda) is "
                f"{self.autocast}, default dtype is {self.default_dtype}, inference mode is "
                f"{self.inference_mode}")

    def reason(self, value):
        now = GlobalStateGuard.now()
        for name in ("grad_enabled", "autocast", "default_dtype", "inference_mode"):
            if getattr(now, name) != getattr(self, name):
                return f"global state {name} expected {getattr(self, name)!r}, got {getattr(now, name)!r}"
        return None


def _autocast() -> tuple:
    """Whether autocast is on for CPU and CUDA, and the dtype of each that is (a compiled
    graph casts to the dtype it was traced with: bfloat16 and float16 are two graphs)."""
    cpu, cuda = torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")
    return (cpu, cuda, torch.get_autocast_dtype("cpu") if cpu else None,
            torch.get_autocast_dtype("cuda") if cuda else None)
