"""Validation mode (``pytest --specularch=compare``): every optimized call is also run
eagerly on deep copies of the state it can touch, with the same random numbers, and the two
runs are compared. A difference raises ``SpecularchMismatch`` naming the function, the graph,
its guards and the first differing value.

Isolation. One deepcopy covers the arguments, the closure's contents and the global bindings
the call can reach (so objects shared between them stay shared, e.g. an optimizer and its
model's parameters): the names the code uses in its own module, and, followed by global name
a few levels deep, in the modules of user-level functions, classes and modules it reaches
(and of the arguments' classes); torch, specularch, numpy, pytest and standard-library modules
are not entered. While the eager reference runs, those bindings hold the copies; afterwards
their values are read and the real objects are put back. Functions the reference run calls
that specularch optimizes run eagerly too. What the reference run prints is captured;
what the optimized run prints is captured, compared and then written out.

Compared: the result or the exception; the arguments and the closure afterwards; the reached
globals afterwards (numbers and strings included, as are globals the call creates); and the
printed text. Tensors are compared exactly (so the optimized run uses ``templates="exact"``:
recursion templates and rolled loops in eager's order), with the ``.grad`` of leaf tensors; modules by
their parameters and buffers (with gradients) and the public attributes (``training``
included) of every submodule; optimizers by their state and hyper-parameters.

Not isolated: state reached only through attributes of objects that are not copied (e.g. a
module object's function that writes to a file), other threads (the global bindings are
swapped in the module dicts themselves) and logging handlers bound to the real streams.
"""
from __future__ import annotations

import contextlib
import copy
import dis
import functools
import io
import math
import random
import sys
import threading
import types
from typing import Any

import torch

from . import frames
from .config import config
from .explain import explain_state
from .fx_lower.randomness import generator_states, restore_generators

_local = threading.local()
MISMATCHES: list[str] = []
# How many calls deep global names are followed from the optimized function.
REACH_DEPTH = 3
# Packages whose state the reference run shares with the optimized one (not user state).
_NOT_ENTERED = frozenset(sys.stdlib_module_names) | {
    "torch", "torchvision", "torchaudio", "functorch", "specularch", "numpy", "scipy",
    "pytest", "_pytest", "pluggy"}
# Kinds of global values a call commonly mutates or rebinds; instances of user-level
# classes are swapped too.
_STATE_TYPES = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, list, dict, set, tuple,
                int, float, complex, str, bytes, bool, type(None))
_ABSENT = type("_Absent", (), {"__repr__": lambda self: "<not defined>"})()


class SpecularchMismatch(AssertionError):
    """An optimized call differed from eager on the same inputs (see the message)."""


def validator(state, slots, cells, run) -> Any:
    target = state.target
    if getattr(_local, "busy", False):  # called by the eager reference run: stay eager
        return target.call_original(slots, cells)
    bindings = _reached_bindings(target, slots, cells)
    real_values = [namespace.get(name, _ABSENT) for namespace, name in bindings]
    real_cells = [c.cell_contents for c in cells or ()]
    copied = _copy_state(slots, real_cells, bindings, real_values)
    if copied is None:
        return run(state, slots, cells)  # cannot copy: nothing to compare against
    copies, cell_copies, bindings, real_values, value_copies = copied
    reference = types.FunctionType(target.shadow_code, target.globals, target.code.co_name, None,
                                   tuple(types.CellType(c) for c in cell_copies) or None)
    rng, python_rng = generator_states(), random.getstate()
    _bind(bindings, value_copies)
    _local.busy = True
    try:
        with frames.hook_active(), _output() as expected_output:
            expected, expected_error = _call(frames.call_with_slots, reference, copies)
    finally:
        _local.busy = False
        expected_globals = [namespace.get(name, _ABSENT) for namespace, name in bindings]
        _bind(bindings, real_values)
    restore_generators(rng)  # the optimized call draws the same random numbers
    expected_python_rng = random.getstate()
    random.setstate(python_rng)  # random.random() too
    # compared bit for bit, so recursion templates and rolled loops run (and are captured)
    # in eager's order here: their default batching is only promised within float rounding
    with _output() as got_output, config.patch(templates="exact"):
        got, got_error = _call(run, state, slots, cells)
    sys.stdout.write(got_output[0])
    sys.stderr.write(got_output[1])
    problem = _first_difference(expected_error, got_error, "exception")
    if problem is None and expected_error is None:
        problem = (_first_difference(expected, got, "result")
                   or _first_difference(copies, slots, "arguments after the call")
                   or _first_difference([c.cell_contents for c in reference.__closure__ or ()],
                                        [c.cell_contents for c in cells or ()], "closure after the call"))
    if problem is None:
        got_globals = [namespace.get(name, _ABSENT) for namespace, name in bindings]
        for (namespace, name), a, b in zip(bindings, expected_globals, got_globals):
            problem = problem or _first_difference(
                a, b, f"global {namespace.get('__name__', '?')}.{name} after the call")
    if problem is None and random.getstate() != expected_python_rng:
        problem = "Python's random module is left in another state than eager leaves it"
    problem = (problem or _first_difference(expected_output[0], got_output[0], "printed stdout")
               or _first_difference(expected_output[1], got_output[1], "printed stderr"))
    if problem is not None:
        report = (f"specularch compare mode: {target.name} differs from eager: {problem}\n"
                  f"{explain_state(state, verbose=True)}")  # the graph code too
        MISMATCHES.append(report)
        raise SpecularchMismatch(report)
    if got_error is not None:
        raise got_error
    return got


# --- what the call can reach --------------------------------------------------------------

def _reached_bindings(target, slots, cells) -> list[tuple[dict, str]]:
    """``(module globals, name)`` of the state-holding globals a call of ``target`` can read
    or write: the code's global names in its module, followed through user-level functions,
    classes and modules ``REACH_DEPTH`` levels deep; the arguments' classes are entered too."""
    found: dict[tuple[int, str], tuple[dict, str]] = {}
    pending = [(target.code, target.globals, 0)]
    for value in [*slots, *(c.cell_contents for c in cells or () if _has_contents(c))]:
        pending += _codes_of_instance(value, 1)
    seen = set()
    while pending:
        code, namespace, depth = pending.pop()
        if (code, id(namespace)) in seen:
            continue
        seen.add((code, id(namespace)))
        names, stored = _code_names(code)
        for name in names:
            value = namespace.get(name, _ABSENT)
            if value is _ABSENT:
                if name in stored:  # a global the call may create
                    found[(id(namespace), name)] = (namespace, name)
                continue
            if _is_state(value):
                found[(id(namespace), name)] = (namespace, name)
            if depth < REACH_DEPTH:
                pending += _codes_reached(value, names, depth + 1, found)
    return list(found.values())


def _codes_reached(value, names, depth, found) -> list:
    """Code objects (with their globals) that calling or using ``value`` may run."""
    if isinstance(value, types.MethodType):
        value = value.__func__
    if isinstance(value, types.FunctionType):
        return [(value.__code__, value.__globals__, depth)] if _user_level(value.__module__) else []
    if isinstance(value, type):
        return _codes_of_class(value, depth)
    if isinstance(value, types.ModuleType):
        if not _user_level(value.__name__):
            return []
        namespace, codes = vars(value), []
        for name in names & namespace.keys():  # ``helpers.LOG``, ``helpers.note(...)``
            if _is_state(namespace[name]):
                found[(id(namespace), name)] = (namespace, name)
            codes += _codes_reached(namespace[name], names, depth, found)
        return codes
    return _codes_of_instance(value, depth)


def _codes_of_instance(value, depth) -> list:
    if isinstance(value, torch.nn.Module):
        return [c for m in value.modules() for c in _codes_of_class(type(m), depth)]
    if not isinstance(value, type) and _user_level(type(value).__module__):
        return _codes_of_class(type(value), depth)
    return []


def _codes_of_class(cls: type, depth) -> list:
    codes = []
    for klass in cls.__mro__:
        if not _user_level(klass.__module__):
            continue
        for attr in vars(klass).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            functions = [attr.fget, attr.fset] if isinstance(attr, property) else [attr]
            codes += [(f.__code__, f.__globals__, depth) for f in functions
                      if isinstance(f, types.FunctionType)]
    return codes


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple[frozenset, frozenset]:
    """Names the code (and code nested in it) uses, and the global names it assigns."""
    names, stored = set(code.co_names), set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stored.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_names, inner_stored = _code_names(const)
            names |= inner_names
            stored |= inner_stored
    return frozenset(names), frozenset(stored)


def _user_level(module_name: str | None) -> bool:
    return bool(module_name) and module_name.partition(".")[0] not in _NOT_ENTERED


def _is_state(value) -> bool:
    if isinstance(value, _STATE_TYPES):
        return True
    return not isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType)) \
        and _user_level(type(value).__module__)


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _copy_state(slots, cells, bindings, values):
    """One deepcopy of arguments, closure contents and global values; a global that cannot
    be copied is left out of the isolation (shared by both runs) rather than giving up."""
    for last_try in (False, True):
        try:
            memo: dict = {}
            copies, cell_copies, value_copies = copy.deepcopy((slots, cells, values), memo)
        except Exception:
            if last_try:
                return None
            keep = [i for i, v in enumerate(values) if _copyable(v)]
            bindings, values = [bindings[i] for i in keep], [values[i] for i in keep]
            continue
        _copy_gradients(memo)
        return copies, cell_copies, bindings, values, value_copies


def _copy_gradients(memo: dict) -> None:
    """``Parameter.__deepcopy__`` leaves ``.grad`` behind; the reference run must start from
    the gradients accumulated so far."""
    for original in memo.get(id(memo), ()):  # deepcopy keeps every copied original here
        if isinstance(original, torch.Tensor) and original.is_leaf and original.grad is not None:
            duplicate = memo.get(id(original))
            if isinstance(duplicate, torch.Tensor) and duplicate.grad is None:
                duplicate.grad = copy.deepcopy(original.grad, memo)


def _copyable(value) -> bool:
    try:
        copy.deepcopy(value)
    except Exception:
        return False
    return True


def _bind(bindings, values) -> None:
    for (namespace, name), value in zip(bindings, values):
        if value is _ABSENT:
            namespace.pop(name, None)
        else:
            namespace[name] = value


# --- running ------------------------------------------------------------------------------

@contextlib.contextmanager
def _output():
    """Capture what the block prints; yields ``[stdout_text, stderr_text]``, filled at exit."""
    texts = ["", ""]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield texts
    finally:
        texts[:] = [out.getvalue(), err.getvalue()]


def _call(fn, *args):
    try:
        return fn(*args), None
    except Exception as e:
        return None, e


# --- comparing ----------------------------------------------------------------------------

def _first_difference(a: Any, b: Any, path: str, seen: set | None = None) -> str | None:
    """Where ``a`` (eager) and ``b`` (optimized) first differ, or None."""
    if a is b:
        return None
    seen = set() if seen is None else seen
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        if type(a) is not type(b) or str(a) != str(b):
            return f"{path}: eager raised {a!r}, optimized raised {b!r}"
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, path, seen)
    if (id(a), id(b)) in seen:  # cycles, and objects reached twice
        return None
    seen.add((id(a), id(b)))
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        return (_first_difference(dict(a.state_dict(keep_vars=True)),
                                  dict(b.state_dict(keep_vars=True)), path, seen)
                or _first_difference(_public_attributes(a), _public_attributes(b), path, seen))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]", seen)
            if found:
                return found
        return None
    if isinstance(a, torch.optim.Optimizer) and isinstance(b, torch.optim.Optimizer):
        state_a = [a.state.get(p, {}) for g in a.param_groups for p in g["params"]]
        state_b = [b.state.get(p, {}) for g in b.param_groups for p in g["params"]]
        hyper_a = [{k: v for k, v in g.items() if k != "params"} for g in a.param_groups]
        hyper_b = [{k: v for k, v in g.items() if k != "params"} for g in b.param_groups]
        return (_first_difference(state_a, state_b, f"{path}.state", seen)
                or _first_difference(hyper_a, hyper_b, f"{path}.param_groups", seen))
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            found = _first_difference(a[k], b[k], f"{path}[{k!r}]", seen)
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, (type, types.ModuleType)):
        return _first_difference(vars(a), vars(b), path, seen)
    if type(a) is type(b) and type(a).__eq__ is object.__eq__:
        return None  # identity is all it compares: a copy never equals its original
    try:
        same = bool(a == b)
    except Exception:
        return None
    return None if same else f"{path}: eager {a!r} vs optimized {b!r}"


def _tensor_difference(a, b, path: str, seen: set) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{path}: shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    if not torch.equal(a.detach(), b.detach()):
        diff = (a.detach().double() - b.detach().double()).abs()
        index = tuple(int(i) for i in (diff == diff.max()).nonzero()[0]) if diff.numel() else ()
        return (f"{path}{list(index)}: eager {a.detach()[index].item() if index or a.dim() == 0 else a} "
                f"vs optimized {b.detach()[index].item() if index or b.dim() == 0 else b}")
    if a.is_leaf and b.is_leaf and (a.grad is not None or b.grad is not None):
        return _first_difference(a.grad, b.grad, f"{path}.grad", seen)
    return None


def _public_attributes(module: torch.nn.Module) -> dict:
    """``training`` and the other public data attributes of the module and every submodule,
    keyed by their dotted name (parameters, buffers and submodules are compared apart;
    callables such as an instance-level ``forward`` are behaviour, not state)."""
    return {f"{prefix}.{k}" if prefix else k: v for prefix, sub in module.named_modules()
            for k, v in vars(sub).items()
            if not k.startswith("_") and (isinstance(v, torch.Tensor) or not callable(v))}
