"""Structured records of what specularch did: fallbacks (why a call ran eagerly) and recompiles.

Every fallback has a stable ``kind`` from ``FALLBACK_KINDS`` (documented in the README), a
plain-language explanation, a hint and the user's ``file:line``. ``Unsupported`` is raised
inside capture and turned into a ``FallbackRecord`` by the dispatcher.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# kind -> (what it means, how to fix it). Keep in sync with the README table (a test checks).
FALLBACK_KINDS: dict[str, tuple[str, str]] = {
    "data_dependent_branch": (
        "Python control flow depends on the value inside a tensor (e.g. `if x.sum() > 0:`).",
        "Use torch.where / masking, or move the branch outside the optimized function."),
    "data_dependent_value": (
        "A tensor value was turned into a Python value (`.item()`, `float(t)`, `.tolist()`, "
        "printing a tensor) while capturing.",
        "Keep the computation in tensors, or return the tensor and convert it outside."),
    "unsupported_opcode": (
        "The function uses a bytecode instruction the symbolic executor does not handle.",
        "Move that construct into a helper that is not optimized; specularch.unhandled_opcodes() lists them."),
    "unsupported_call": (
        "A call to a function specularch cannot see into or model (e.g. a C extension, I/O).",
        "Move the call outside the optimized function, or compute it with torch operations."),
    "generator": (
        "The optimized code is a generator or coroutine; these always run eagerly.",
        "Optimize the function that consumes the generator instead."),
    "exception_handling": (
        "An exception leaves the optimized function (a `raise` reached, a missing key, an op "
        "raising on these values), or a graph op raised at run time inside a try/with block "
        "whose handler the original code takes. try/except/finally and `with` blocks are "
        "captured; handlers run in the graph when a Python-level raise decides them.",
        "Expected when the error really happens (the call runs eagerly and raises or handles "
        "it exactly as eager); to keep such calls in a graph, check values before the op "
        "instead of relying on the exception."),
    "side_effect": (
        "The code changes state that outlives the call in a way specularch does not defer yet "
        "(I/O, mutation of an object that existed before the call).",
        "Return the new values and assign them outside, or keep the state in tensors."),
    "input_mutation": (
        "An in-place operation writes into a tensor that existed before the call "
        "(an argument, parameter or buffer).",
        "Use the out-of-place form (x = x + 1 instead of x.add_(1))."),
    "assumption_failed": (
        "The graph speculated on a tensor value (a branch like `if loss > 0:` or a loop's trip "
        "count) and this call went the other way; nothing was committed and the call ran "
        "eagerly. The branch is no longer speculated.",
        "Expected for branches that really flip. A plain if/else whose sides have no side "
        "effects is captured with both sides (torch.where) from the next call on; otherwise "
        "this path runs eagerly: write torch.where yourself to keep it in one graph."),
    "module_hooks": (
        "An nn.Module called in the function has forward/backward hooks registered.",
        "Remove the hooks, or optimize a function that does not call the hooked module."),
    "recursion_limit": (
        "Inlined calls were nested deeper than config.inline_depth, too many instructions "
        "ran (config.max_instructions), or unrolling a long Python loop (more than "
        "max_instructions/100 iterations) took longer than max(0.5 s, 2 eager calls).",
        "Raise the limit, or restructure deep recursion or long loops into tensor operations "
        "(or keep them out of the optimized function)."),
    "cache_limit": (
        "This code already has config.cache_limit graphs; a new guard failure would need another.",
        "Check `specularch.explain(fn).recompiles` for the value that keeps changing; raise cache_limit."),
    "backend_error": (
        "The backend failed to compile or run the captured graph.",
        "Try another backend (backend='fx'); report the error if the graph looks valid."),
    "internal_error": (
        "specularch itself hit an unexpected error while capturing; the call ran eagerly.",
        "Please report it with the explanation text; nothing else is needed to stay correct."),
}


@dataclass
class FallbackRecord:
    """Why one call (or a family of identical calls) ran the original Python eagerly."""

    kind: str
    explanation: str
    hint: str
    filename: str = "<unknown>"
    lineno: int = 0
    function: str = "<unknown>"
    count: int = 1

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def __str__(self) -> str:
        times = f" (x{self.count})" if self.count > 1 else ""
        return (f"[{self.kind}] {self.function} at {self.location}{times}: {self.explanation}\n"
                f"    hint: {self.hint}")


@dataclass
class RecompileRecord:
    """A guard of an existing graph failed, so a new graph was captured."""

    function: str
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"recompiled {self.function}: " + "; ".join(self.reasons)


class Unsupported(Exception):
    """Raised during capture when the code cannot be turned into a graph.

    The dispatcher catches it, records a FallbackRecord and runs the original Python.
    ``lineno``/``filename`` are filled in by the executor from the instruction being run.
    """

    def __init__(self, kind: str, explanation: str, hint: str | None = None):
        if kind not in FALLBACK_KINDS:
            raise ValueError(f"unknown fallback kind {kind!r}")
        super().__init__(explanation)
        self.kind = kind
        self.explanation = explanation
        self.hint = hint or FALLBACK_KINDS[kind][1]
        self.filename: str | None = None
        self.lineno: int | None = None
        self.function: str | None = None
        # The failure depends on tensor values the guards do not cover (an op raised on
        # these values, or code reached under a speculated tensor branch): other calls that
        # pass the same guards may well be capturable.
        self.value_dependent = False

    def record(self) -> FallbackRecord:
        return FallbackRecord(self.kind, self.explanation, self.hint,
                              self.filename or "<unknown>", self.lineno or 0,
                              self.function or "<unknown>")


class AssumptionBroken(Exception):
    """Raised inside a graph whose in-graph assumption failed where the graph cannot go on
    (a rolled loop's body assumption, in a later iteration: what follows the loop would run
    on a partial result). The dispatcher treats it as the entry's failed assumption
    (``where``, ``site``): nothing was committed, the graph is dropped, the original runs."""

    def __init__(self, where: str, site: tuple):
        super().__init__(f"in-graph assumption at {where} failed")
        self.where, self.site = where, site


class SpecularchStrictError(RuntimeError):
    """Raised instead of a fallback or recompile when ``config.strict`` is on.

    Example: with ``SPECULARCH_STRICT=1``, calling an optimized function that does
    ``if x.sum() > 0:`` raises this error naming ``data_dependent_branch`` and the line.
    Fix the code as the hint says, or turn strict mode off for that function.
    """
