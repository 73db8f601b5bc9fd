"""Compiling a guard set into one fast Python function.

The generated function takes the frame roots ``(L, C, G, B)`` and evaluates every guard in
capture order, binding each source to a local variable once (``s2 = s1._modules['fc']``), so
shared prefixes of source paths are evaluated once. Any exception while evaluating (a missing
attribute, a wrong type) means "guards failed". The guard dataclasses stay around to explain
a failure in words; the compiled function only answers yes/no.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ._torch_guards import global_state_checker, tensor_checker
from .slots import compact_locals
from .sources import PINNED, Source
from .aliasing import AliasGuard, DistinctGuard
from .guard import GlobalStateGuard, Guard, InferenceGuard, TensorGuard, const_name, same_value

_FAST_TYPES = (torch.Tensor, torch.nn.Parameter)


class SourceNamer:
    """Emits ``sN = <expr>`` lines, evaluating each distinct source once."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._names: dict[Source, str] = {}

    def name(self, source: Source) -> str:
        found = self._names.get(source)
        if found is not None:
            return found
        parent = source.parent
        base = self.name(parent) if parent is not None else ""
        rendered = source.render_named(base, self.name)
        var = f"s{len(self._names)}"
        self.lines.append(f"{var} = {rendered}")
        self._names[source] = var
        return var

    def named(self, source: Source) -> str | None:
        """The local already bound to ``source``, or None (binds nothing)."""
        return self._names.get(source)


def guard_lines(guards: Iterable[Guard], namer: SourceNamer, consts: dict[str, Any],
                fast_tensors: bool = True) -> list[str]:
    """Statements that ``return MISS`` from the enclosing function when a guard fails.

    With ``fast_tensors``, all tensor guards are checked by one C++ call at the end.
    """
    out: list[str] = []
    tensor_guards: list[TensorGuard] = []
    tensor_vars: list[str] = []
    guards = list(guards)
    fast_sources = {g.source for g in guards if fast_tensors and isinstance(g, TensorGuard)
                    and g.tensor_type in _FAST_TYPES}
    # "Not an inference tensor" of a tensor in the C++ check: its dispatch keys say so
    # already (an inference tensor lacks the autograd keys a template has); checked in
    # Python only if the C++ check is unavailable.
    not_inference: list[str] = []
    for g in guards:
        v = namer.name(g.source) if g.source is not None else "None"
        out.extend(namer.lines)
        namer.lines.clear()
        if isinstance(g, InferenceGuard) and not g.expected and g.source in fast_sources:
            not_inference.append(f"if not ({' and '.join(g.conditions(v, consts))}): return MISS")
            continue
        if fast_tensors and isinstance(g, TensorGuard) and g.tensor_type in _FAST_TYPES:
            tensor_guards.append(g)
            tensor_vars.append(v)
            if g.dynamic:  # strides go unchecked for dynamic tensors: keep their layout class
                out.append(f"if {v}.is_contiguous() is not {g.contiguous}: return MISS")
            if g.leaf is not None:  # not part of torch's C++ tensor check
                out.append(f"if not {g.leaf_condition(v)}: return MISS")
            continue
        if isinstance(g, GlobalStateGuard):
            out.append(global_state_line(g, consts))
            continue
        if isinstance(g, (AliasGuard, DistinctGuard)):  # sources of its own: named like every other source
            conds = g.conditions(v, consts, namer.name)
            out.extend(namer.lines)
            namer.lines.clear()
        else:
            conds = g.conditions(v, consts)
        if conds:
            out.append(f"if not ({' and '.join(conds)}): return MISS")
    if tensor_guards:
        checker = tensor_checker(tensor_guards)
        if checker is None:
            out.extend(not_inference)
            for g, v in zip(tensor_guards, tensor_vars):
                out.append(f"if not ({' and '.join(g.conditions(v, consts))}): return MISS")
        else:
            name = f"TG{len(consts)}"
            consts[name] = checker
            out.append(f"if not {name}({', '.join(tensor_vars)}): return MISS")
    return out


def global_state_line(g: GlobalStateGuard, consts: dict[str, Any]) -> str:
    """The global-state check: one C++ call (a snapshot of the state taken now, while it is
    the guarded one) where it can answer; it also compares state our guard ignores (the
    number of threads, ...), so where it says no, the Python conditions decide."""
    checker = global_state_checker() if g.holds_now() else None
    if checker is None:
        return f"if not ({' and '.join(g.conditions(None, consts))}): return MISS"
    python = " and ".join(g.dispatch_conditions(consts))
    return (f"if not ({g.inference_condition(consts)} and ({const_name(consts, checker)}() "
            f"or ({python}))): return MISS")


class GuardSet:
    """The guards of one captured graph, de-duplicated, in capture order."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, Guard] = {}
        self.micros: float | None = None  # one check's cost, timed on the capturing call
        self.timer = None  # set by the entry function's builder: (L, C, G, B) -> µs or None

    def measure(self, L, C, G, B) -> None:
        """Time the guard check on the call it was captured from (``explain()`` reports it);
        the timer is dropped after, so nothing of that call is kept."""
        timer, self.timer = self.timer, None
        if timer is not None:
            self.micros = timer(L, C, G, B)

    def add(self, guard: Guard) -> None:
        self._by_key.setdefault(guard.key(), guard)

    def __iter__(self):
        return iter(self._by_key.values())

    def __len__(self) -> int:
        return len(self._by_key)

    def readable(self) -> list[str]:
        return [str(g) for g in self]

    def compile(self):
        """A function ``check(L, C, G, B) -> bool``."""
        consts: dict[str, Any] = {}
        namer = SourceNamer()
        body = guard_lines(self, namer, consts)
        src = "def check(L, C, G, B):\n    try:\n"
        src += "".join(f"        {line}\n" for line in body)
        src += "        return True\n    except Exception:\n        return False\n"
        ns: dict[str, Any] = dict(consts, MISS=False, O=PINNED)
        exec(compile(src, "<specularch guards>", "exec"), ns)
        check = ns["check"]
        check.__code__ = compact_locals(check.__code__)
        return check

    def first_failure(self, L, C, G, B) -> str | None:
        """The first failing guard's explanation, or None if all pass."""
        failing = self.first_failing(L, C, G, B)
        return None if failing is None else failing[2]

    def first_failing(self, L, C, G, B) -> tuple | None:
        """``(guard, value read, explanation)`` of the first failing guard, or None."""
        return next(self.failing(L, C, G, B), None)

    def failing(self, L, C, G, B):
        """``(guard, value read, explanation)`` of every failing guard, in order (a source
        that cannot be read at all fails with value None)."""
        roots = {"L": L, "C": C, "G": G, "B": B, "O": PINNED}
        for g in self:
            if g.source is None:
                value = None
            else:
                try:
                    value = eval(g.source.expr(), {}, roots)
                except Exception as e:
                    yield g, None, f"{g.source} could not be read ({type(e).__name__}: {e})"
                    continue
            if g.key()[0] == "Expr":
                try:
                    got = eval(g.expr, {}, roots)
                except Exception as e:
                    got = f"<{type(e).__name__}>"
                text = None if same_value(got, g.expected) else (
                    f"{g.describe().rsplit(' == ', 1)[0]} expected {g.expected!r}, got {got!r}"
                    + (f" — {g.where}" if g.where else ""))
            elif g.source is None and g.key()[0] == "NotShadowed":
                text = g.reason(G.get(g.name))
            elif hasattr(g, "reason_from_roots"):
                text = g.reason_from_roots(roots)
            else:
                text = g.reason(value)
            if text is not None:
                yield g, value, text
