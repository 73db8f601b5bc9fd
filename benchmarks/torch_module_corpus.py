"""Capture on PyTorch's own module tests: every ``nn`` module class of torch's ``module_db``
(constructor args and forward inputs from its ``module_inputs_func``), run eagerly and with
``specularch.optimize``, compared bit for bit.

    python benchmarks/torch_module_corpus.py [--json out.json] [--modules Linear,Conv2d]
        [--train | --eval] [--samples 3] [--calls 3] [--threads 1]

One *program* is one (module class, sample, training mode): CPU, float32, the first
``--samples`` samples of each module (0: all), in train and eval mode where the two differ
(else train), as torch's ``TestModule.test_forward`` runs them; what that test skips or expects
to fail on CPU is skipped. Two instances are built from the same seed; one runs eagerly,
the other ``specularch.optimize``-d with ``profile_calls=0`` (the first call captures). Each
runs ``--calls`` calls on deep copies of the same inputs, RNG reseeded before each call, then
``backward()`` of the sum of its floating outputs that require grad. After every call the
outputs, the gradients of inputs and parameters, the module's state (parameters and buffers)
and any exception raised are compared, bit for bit (backend ``fx``).

Each program is classified: *captured whole* (every optimized call ran a graph), *fell back*
(a call ran the original Python: kind, explanation, ``file:line``), *mismatch* (a value
differs), *internal_error* (a fallback of that kind), *crash* (one side raised where the
other did not, or raised something else). Progress goes to stderr, the markdown report to
stdout; the exit code is 1 on a mismatch, an internal error or a crash.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _torch_testing  # noqa: E402
from corpus_report import _short, compare  # noqa: E402

SEED = 1234
MAX_LISTED = 40  # programs listed by name under "Mismatches, internal errors, crashes"
STATUSES = ("captured whole", "fell back", "mismatch", "internal_error", "crash")


@dataclasses.dataclass
class Fallback:
    kind: str
    explanation: str
    location: str
    calls: int


@dataclasses.dataclass
class ProgramResult:
    module: str
    sample: int
    desc: str
    training: bool
    status: str = "captured whole"
    calls: int = 0
    graph_calls: int = 0
    fallbacks: list = dataclasses.field(default_factory=list)  # [Fallback]
    max_abs_diff: float = 0.0
    detail: str = ""          # the first difference, or the exception that differed
    eager_raised: str = ""    # what both sides raised, when eager raises (not a crash)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        mode = "train" if self.training else "eval"
        return f"{self.module}[{self.sample}]({mode})"


# --- one program ---------------------------------------------------------------------------

def run_program(entry, index: int, sample, training: bool, calls: int = 3) -> ProgramResult:
    """``sample`` of ``entry`` eagerly and optimized, ``calls`` times each; compare."""
    import specularch
    result = ProgramResult(entry.name, index, sample.desc, training)
    start = time.perf_counter()
    eager = _run_calls(_build(entry, sample, training), sample, calls)
    optimized_module = _build(entry, sample, training)
    with specularch.config.patch(profile_calls=0, backend="fx", warn_fallbacks=False):
        specularch.optimize(optimized_module)
        got = _run_calls(optimized_module, sample, calls)
    _classify(result, specularch.explain(optimized_module), eager, got)
    result.seconds = time.perf_counter() - start
    return result


def _build(entry, sample, training: bool) -> torch.nn.Module:
    torch.manual_seed(SEED)
    module = entry.module_cls(*_copy(sample.ctor_args), **_copy(sample.ctor_kwargs))
    return module.to(torch.float32).train(training)  # as torch's test_forward: m.to(dtype)


def _run_calls(module, sample, calls: int) -> list:
    """Per call, what it left: outputs, gradients and module state, or the exception."""
    seen = []
    for i in range(calls):
        args, kwargs = _copy(sample.args), _copy(sample.kwargs)
        torch.manual_seed(SEED + 1 + i)
        try:
            out = module(*args, **kwargs)
            _backward(out)
        except Exception as e:  # eager may raise too: then the optimized side must as well
            seen.append(("raised", f"{type(e).__name__}: {e}"))
            continue
        seen.append(("returned", _snapshot(module, out, (args, kwargs))))
    return seen


def _copy(value):
    """A deep copy in which every tensor is a fresh leaf (some samples hold non-leaf
    tensors, which ``copy.deepcopy`` refuses)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _copy(v) for k, v in value.items()}
    return copy.deepcopy(value)


def _backward(out) -> None:
    roots = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
    if roots:
        sum(t.sum() for t in roots).backward()


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _snapshot(module, out, inputs) -> dict:
    return {"output": _plain(out),
            "output requires_grad": [t.requires_grad for t in _tensors(out)],
            "input grads": [_grad(t) for t in _tensors(inputs)],
            "parameter grads": {n: _grad(p) for n, p in module.named_parameters()},
            "state": {n: _plain(t) for n, t in module.state_dict(keep_vars=True).items()}}


def _grad(t: torch.Tensor):
    return "no grad" if t.grad is None else t.grad.detach().clone()


def _plain(value):
    """A copy made only of tensors, lists, tuples, dicts and plain values (a named tuple
    such as ``PackedSequence`` becomes a tuple: ``compare`` needs the exact type)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def _classify(result: ProgramResult, report, eager: list, got: list) -> None:
    stats = report.stats
    result.calls = stats.calls
    result.graph_calls = stats.graph_hits + stats.captures
    result.fallbacks = [Fallback(f.kind, f.explanation, _short(f.location), f.count)
                        for f in report.fallbacks]
    if _compare_calls(result, eager, got):
        return
    if any(f.kind == "internal_error" for f in result.fallbacks):
        result.status = "internal_error"
    elif result.fallbacks or result.graph_calls < result.calls or result.calls == 0:
        result.status = "fell back"


def _compare_calls(result: ProgramResult, eager: list, got: list) -> bool:
    """Set a crash or mismatch status (and say True) where a call's outcome differs."""
    for i, ((e_how, e_what), (g_how, g_what)) in enumerate(zip(eager, got)):
        if e_how != g_how or (e_how == "raised" and e_what != g_what):
            result.status = "crash"
            result.detail = f"call {i}: eager {e_how} {_brief(e_what)}; optimized {g_how} {_brief(g_what)}"
            return True
        if e_how == "raised":
            result.eager_raised = e_what
            continue
        try:
            diff = compare(e_what, g_what, 0.0, f"call {i}")
        except Exception as e:  # values that cannot even be compared differ
            result.status, result.detail = "mismatch", f"call {i}: {type(e).__name__}: {e}"
            return True
        result.max_abs_diff = max(result.max_abs_diff, diff.max_abs)
        if diff.first is not None:
            result.status, result.detail = "mismatch", diff.first
            return True
    return False


def _brief(what) -> str:
    return repr(what)[:200] if isinstance(what, str) else "(values)"


# --- the corpus ----------------------------------------------------------------------------

def programs(names=None, training=None, samples: int = 3):
    """(entry, index, sample, training) of every program, and what was skipped and why."""
    chosen, skipped = [], []
    for entry in _torch_testing.module_entries(names):
        for mode in _torch_testing.training_modes(entry) if training is None else [training]:
            reason = _torch_testing.cpu_skip_reason(entry, mode)
            if reason is None:
                found = list(_torch_testing.samples(entry, mode))[:samples or None]
                reason = _needs_other_device(found)
                chosen += [] if reason else [(entry, i, s, mode) for i, s in enumerate(found)]
            if reason:
                skipped.append((entry.name, mode, reason))
    return chosen, skipped


def _needs_other_device(found) -> str | None:
    for sample in found:
        for t in _tensors([sample.ctor_args, sample.ctor_kwargs, sample.args, sample.kwargs]):
            if t.device.type != "cpu":
                return f"its inputs need {t.device.type}"
    return None


def run_corpus(names=None, training=None, samples: int = 3, calls: int = 3,
               progress=None) -> tuple[list[ProgramResult], list]:
    import specularch
    chosen, skipped = programs(names, training, samples)
    results = []
    for n, (entry, index, sample, mode) in enumerate(chosen):
        specularch.reset()
        result = run_program(entry, index, sample, mode, calls)
        results.append(result)
        if progress:
            progress(f"[{n + 1}/{len(chosen)}] {result.name}: {result.status} "
                     f"({result.seconds:.2f}s) {result.detail[:120]}")
    return results, skipped


# --- the report ----------------------------------------------------------------------------

def summary(results: list[ProgramResult]) -> str:
    counts = collections.Counter(r.status for r in results)
    total = len(results)
    share = counts["captured whole"] / total if total else 0.0
    lines = ["| programs | " + " | ".join(STATUSES) + " | share captured whole |",
             "|---" * (len(STATUSES) + 2) + "|",
             f"| {total} | " + " | ".join(str(counts[s]) for s in STATUSES) + f" | {share:.1%} |"]
    # Per module class too: a class with hundreds of samples would otherwise weigh most.
    modules = collections.defaultdict(set)
    for r in results:
        modules[r.module].add(r.status)
    whole = sum(statuses == {"captured whole"} for statuses in modules.values())
    lines += ["", f"Module classes with every program captured whole: {whole} of {len(modules)}."]
    return "\n".join(lines)


def ranked_causes(results: list[ProgramResult]) -> list[dict]:
    """Fallback (kind, explanation) pairs by the number of programs they occur in."""
    causes = {}
    for r in results:
        for f in r.fallbacks:
            cause = causes.setdefault((f.kind, f.explanation),
                                      {"kind": f.kind, "explanation": f.explanation,
                                       "programs": 0, "example": r.name,
                                       "location": f.location, "modules": set()})
            cause["programs"] += 1
            cause["modules"].add(r.module)
    ranked = sorted(causes.values(), key=lambda c: (-c["programs"], c["kind"], c["explanation"]))
    for c in ranked:
        c["modules"] = sorted(c["modules"])
    return ranked


def report(results: list[ProgramResult], skipped: list, seconds: float) -> str:
    out = [f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU float32, "
           f"backend fx, profile_calls=0; {len(results)} programs in {seconds:.0f} s", "",
           summary(results), ""]
    bad = [r for r in results if r.status in ("mismatch", "internal_error", "crash")]
    if bad:
        out += ["## Mismatches, internal errors, crashes", ""]
        out += [f"* `{r.name}` {r.status}: {r.detail or _first_internal(r)}"
                for r in bad[:MAX_LISTED]]
        out += [f"* ... and {len(bad) - MAX_LISTED} more"] if len(bad) > MAX_LISTED else []
        out.append("")
    out += ["## Fallback causes, ranked by programs", "",
            "| kind | explanation | programs | modules | example | file:line |",
            "|---|---|---|---|---|---|"]
    for c in ranked_causes(results):
        text = c["explanation"].replace("|", "\\|").replace("\n", " ")
        out.append(f"| {c['kind']} | {text[:160]} | {c['programs']} | {len(c['modules'])} | "
                   f"`{c['example']}` | {c['location']} |")
    if skipped:
        out += ["", "Skipped: " + "; ".join(f"{n} ({'train' if m else 'eval'}): {why}"
                                          for n, m, why in skipped)]
    return "\n".join(out)


def _first_internal(r: ProgramResult) -> str:
    return next((f"{f.location}: {f.explanation}" for f in r.fallbacks
                 if f.kind == "internal_error"), "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every program's result here")
    parser.add_argument("--modules", help="comma-separated class names (Linear,Conv2d)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="training", action="store_const", const=True)
    mode.add_argument("--eval", dest="training", action="store_const", const=False)
    parser.add_argument("--samples", type=int, default=3,
                        help="the first N samples per module and mode (3; 0: all, ~2000 programs)")
    parser.add_argument("--calls", type=int, default=3, help="calls per program (3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = set(args.modules.split(",")) if args.modules else None
    start = time.perf_counter()
    results, skipped = run_corpus(names, args.training, args.samples, args.calls,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report(results, skipped, time.perf_counter() - start))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"torch": torch.__version__, "threads": torch.get_num_threads(),
             "results": [dataclasses.asdict(r) for r in results],
             "skipped": skipped, "causes": ranked_causes(results)}, indent=1))
    return int(any(r.status in ("mismatch", "internal_error", "crash") for r in results))


if __name__ == "__main__":
    sys.exit(main())
