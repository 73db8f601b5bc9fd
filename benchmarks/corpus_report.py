"""Coverage of the public-example-style corpus (benchmarks/corpus/): how much of each program
runs as graphs, what falls back and why, and whether results equal eager.

    python benchmarks/corpus_report.py [--switch] [--json out.json] [--scripts a,b]
        [--backend fx]

Default mode, per script, in this process (``torch.set_num_threads(1)``): ``main()`` runs
eagerly, then again with the same seeds and ``optimize=specularch.optimize`` (the script
applies it to its model(s) and step function(s)); the two results (losses, metrics, final
parameters) and the text each run printed are compared. ``--switch`` instead runs every
script twice as a plain program in a subprocess with a clean environment: once without
specularch and once with ``SPECULARCH=1 SPECULARCH_REPORT=1``; each run saves its result with
``torch.save`` and the report printed at exit is parsed.

Per script the table gives the optimized calls (summed over every optimized object, a model
called by a step that fell back included), the calls profiled eagerly, the calls that ran as a
graph (graph hits plus the capturing calls), their share of the calls after profiling, the
calls that fell back (the step share is the same share for the step functions alone, without
the models they call), the fallback kinds with their call counts, internal errors and whether
the result differed from eager (bit-exact for the ``fx`` backend, else within 1e-5
relative), with the largest absolute difference. Then every fallback record (kind, calls,
first explanation, ``file:line``) and the fallback causes ranked by the calls they cost.
Progress goes to stderr, the report to stdout.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORPUS = pathlib.Path(__file__).resolve().parent / "corpus"
SCRIPTS = sorted(p.stem for p in CORPUS.glob("*.py") if not p.name.startswith("_"))
RELATIVE_TOLERANCE = 1e-5  # for compiling backends; ``fx`` must be bit-exact


@dataclasses.dataclass
class Fallback:
    kind: str
    calls: int
    function: str
    location: str
    explanation: str


@dataclasses.dataclass
class ScriptResult:
    name: str
    mode: str                      # "optimize" or "switch"
    calls: int = 0
    profiled: int = 0
    graph_hits: int = 0
    captures: int = 0
    fallback_calls: int = 0
    assumption_failures: int = 0
    recompiles: int = 0
    graphs: int = 0
    objects: list = dataclasses.field(default_factory=list)   # what was optimized
    # the same counts for the step functions only (not a module's ``forward``): a step
    # that falls back still runs its model's optimized forward, whose graph calls count above
    step_calls: int = 0
    step_profiled: int = 0
    step_graph_calls: int = 0
    fallbacks: list = dataclasses.field(default_factory=list)  # [Fallback]
    mismatch: bool = False
    max_abs_diff: float = 0.0
    difference: str = ""           # where the first difference is
    error: str = ""                # an exception of the optimized run (a crash)
    eager_seconds: float = 0.0
    optimized_seconds: float = 0.0

    @property
    def graph_calls(self) -> int:
        return self.graph_hits + self.captures

    @property
    def share(self) -> float | None:
        """Calls that ran as a graph, of the calls after the eagerly profiled ones."""
        after = self.calls - self.profiled
        return self.graph_calls / after if after > 0 else None

    @property
    def step_share(self) -> float | None:
        after = self.step_calls - self.step_profiled
        return self.step_graph_calls / after if after > 0 else None

    @property
    def internal_errors(self) -> int:
        return sum(f.calls for f in self.fallbacks if f.kind == "internal_error")

    def kinds(self) -> collections.Counter:
        counts = collections.Counter()
        for f in self.fallbacks:
            counts[f.kind] += f.calls
        return counts


# --- running -----------------------------------------------------------------------------

def load(name: str):
    """The corpus script ``name`` as a fresh module (not as ``__main__``)."""
    path = CORPUS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"specularch_corpus_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_optimized(name: str, backend: str | None = None, **main_kwargs) -> ScriptResult:
    """``main()`` eagerly, then with ``optimize=specularch.optimize``; compare the two."""
    import specularch
    result = ScriptResult(name, "optimize")
    module = load(name)
    start = time.perf_counter()
    expected, expected_out = _call_capturing_stdout(module.main, **main_kwargs)
    result.eager_seconds = time.perf_counter() - start
    optimized = []

    def optimize(obj):
        out = specularch.optimize(obj, backend=backend)
        optimized.append(out)
        return out

    start = time.perf_counter()
    try:
        with specularch.config.patch(warn_fallbacks=False):
            got, got_out = _call_capturing_stdout(module.main, optimize=optimize, **main_kwargs)
    except Exception as e:  # a crash: eager did not raise
        result.error = f"{type(e).__name__}: {e}"
        result.mismatch = True
        got, got_out = None, None
    result.optimized_seconds = time.perf_counter() - start
    for obj in optimized:
        _add_report(result, specularch.explain(obj))
    if not result.error:
        exact = (backend or specularch.config.backend) == "fx"
        _judge(result, expected, got, exact, expected_out, got_out)
    return result


def _call_capturing_stdout(fn, **kwargs):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        value = fn(**kwargs)
    return value, text.getvalue()


def _add_report(result: ScriptResult, report) -> None:
    _add_stats(result, report.name, vars(report.stats))
    result.graphs += len(report.graphs)
    for f in report.fallbacks:
        result.fallbacks.append(Fallback(f.kind, f.count, f.function, _short(f.location),
                                         f.explanation))


def _add_stats(result: ScriptResult, name: str, stats: dict) -> None:
    result.objects.append(name)
    calls, profiled = int(stats["calls"]), int(stats["profiled_calls"])
    graph_calls = int(stats["graph_hits"]) + int(stats["captures"])
    result.calls += calls
    result.profiled += profiled
    result.graph_hits += int(stats["graph_hits"])
    result.captures += int(stats["captures"])
    result.fallback_calls += int(stats["fallback_calls"])
    result.assumption_failures += int(stats["assumption_failures"])
    result.recompiles += int(stats["recompiles"])
    if not name.endswith(".forward"):
        result.step_calls += calls
        result.step_profiled += profiled
        result.step_graph_calls += graph_calls


def _short(location: str) -> str:
    """``file:line`` relative to the repository (or torch's folder) where it is inside it."""
    for base, prefix in ((str(ROOT) + os.sep, ""),
                         (os.path.dirname(torch.__file__) + os.sep, "torch/")):
        if location.startswith(base):
            return prefix + location[len(base):]
    return location


def _judge(result, expected, got, exact, expected_out=None, got_out=None) -> None:
    tolerance = 0.0 if exact else RELATIVE_TOLERANCE
    diff = compare(expected, got, tolerance)
    result.max_abs_diff = diff.max_abs
    if diff.first is None and expected_out is not None and expected_out != got_out:
        diff.first = f"printed text differs: {_first_line_difference(expected_out, got_out)}"
    result.mismatch = diff.first is not None
    result.difference = diff.first or ""


def _first_line_difference(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())):
        if x != y:
            return f"line {i + 1}: eager {x!r}, optimized {y!r}"
    return f"eager printed {len(a.splitlines())} lines, optimized {len(b.splitlines())}"


# --- comparing ---------------------------------------------------------------------------

@dataclasses.dataclass
class Difference:
    max_abs: float = 0.0
    first: str | None = None  # where the first out-of-tolerance difference is

    def note(self, where: str, what: str) -> None:
        if self.first is None:
            self.first = f"{where}: {what}"


def compare(expected, got, tolerance: float = 0.0, where: str = "result") -> Difference:
    """Walk two results (dicts, lists, tuples, tensors, numbers) side by side. ``tolerance``
    is relative (0: bit-exact); NaN equals NaN."""
    diff = Difference()
    _compare(expected, got, tolerance, where, diff)
    return diff


def _compare(a, b, tol, where, diff) -> None:
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return diff.note(where, f"keys {list(a)} vs {list(b) if isinstance(b, dict) else b!r}")
        for k in a:
            _compare(a[k], b[k], tol, f"{where}[{k!r}]", diff)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return diff.note(where, f"{type(a).__name__} of {len(a)} vs {b!r:.80}")
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, tol, f"{where}[{i}]", diff)
    elif isinstance(a, torch.Tensor):
        _compare_tensors(a, b, tol, where, diff)
    elif isinstance(a, (int, float)) and not isinstance(a, bool):
        if not isinstance(b, (int, float)) or isinstance(b, bool):
            return diff.note(where, f"{a!r} vs {b!r}")
        _compare_tensors(torch.tensor(float(a), dtype=torch.float64),
                         torch.tensor(float(b), dtype=torch.float64), tol, where, diff)
    elif a != b:
        diff.note(where, f"{a!r} vs {b!r}")


def _compare_tensors(a, b, tol, where, diff) -> None:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        what = f"{tuple(b.shape)} {b.dtype}" if isinstance(b, torch.Tensor) else repr(b)
        return diff.note(where, f"tensor {tuple(a.shape)} {a.dtype} vs {what}")
    if a.numel() == 0:
        return
    x, y = a.detach().double(), b.detach().double()
    both_nan = torch.isnan(x) & torch.isnan(y)
    gap = torch.where(both_nan, torch.zeros_like(x), (x - y).abs())
    gap = torch.nan_to_num(gap, nan=math.inf)  # NaN on one side only
    largest = gap.max().item()
    diff.max_abs = max(diff.max_abs, largest)
    allowed = tol * y.abs().nan_to_num(nan=0.0, posinf=0.0)
    if (gap > allowed).any():
        diff.note(where, f"max abs difference {largest:.3g}")


# --- the switch: subprocesses --------------------------------------------------------------

def run_switch(name: str, backend: str | None = None, timeout: float = 600) -> ScriptResult:
    """The unmodified script as a program, plain and under ``SPECULARCH=1``; the report
    printed at exit (``SPECULARCH_REPORT=1``) is parsed."""
    result = ScriptResult(name, "switch")
    with tempfile.TemporaryDirectory() as tmp:
        plain_file, switch_file = os.path.join(tmp, "eager.pt"), os.path.join(tmp, "switch.pt")
        start = time.perf_counter()
        plain = _run_script(name, plain_file, {}, tmp, timeout)
        result.eager_seconds = time.perf_counter() - start
        if plain.returncode != 0:
            raise RuntimeError(f"{name} fails without specularch:\n{plain.stderr[-2000:]}")
        extra = {"SPECULARCH": "1", "SPECULARCH_REPORT": "1", "SPECULARCH_WARN_FALLBACKS": "0"}
        if backend:
            extra["SPECULARCH_BACKEND"] = backend
        start = time.perf_counter()
        run = _run_script(name, switch_file, extra, tmp, timeout)
        result.optimized_seconds = time.perf_counter() - start
        parse_report(run.stderr, result)
        if run.returncode != 0:
            result.error = f"exit code {run.returncode}: {run.stderr.strip().splitlines()[-1:]}"
            result.mismatch = True
            return result
        expected = torch.load(plain_file, weights_only=True)
        got = torch.load(switch_file, weights_only=True)
        _judge(result, expected, got, (backend or "fx") == "fx", plain.stdout, run.stdout)
    return result


def _run_script(name, out_file, env_extra, cwd, timeout):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULARCH")}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **env_extra})
    return subprocess.run([sys.executable, str(CORPUS / f"{name}.py"), out_file], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


_HEADER = re.compile(r"^specularch report for (.+)$")
_STATS = re.compile(r"^stats: (.*)$")
_GRAPHS = re.compile(r"^graphs: (\d+)$")
_FALLBACK = re.compile(r"^  \[(\w+)\] (\S+) at (.+?:\d+)(?: \(x(\d+)\))?: (.*)$")


def parse_report(text: str, result: ScriptResult) -> None:
    """Add the reports ``startup.report()`` printed (one per optimized code object)."""
    section = name = None
    for line in text.splitlines():
        if m := _HEADER.match(line):
            name, section = m[1], "stats"
        elif section is None:
            continue
        elif m := _STATS.match(line):
            _add_stats(result, name, dict(kv.split("=", 1) for kv in m[1].split()))
        elif m := _GRAPHS.match(line):
            result.graphs += int(m[1])
        elif line.startswith("fallbacks:"):
            section = "fallbacks"
        elif line.startswith("recompiles:"):
            section = "rest"
        elif section == "fallbacks" and (m := _FALLBACK.match(line)):
            result.fallbacks.append(Fallback(m[1], int(m[4] or 1), m[2], _short(m[3]), m[5]))


# --- the report --------------------------------------------------------------------------

def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _kinds(result: ScriptResult) -> str:
    return ", ".join(f"{k} {n}" for k, n in result.kinds().most_common()) or "-"


def summary_table(results: list[ScriptResult]) -> list[str]:
    lines = ["| script | calls | profiled | graph calls | graph share | step share | fell back | "
             "fallback kinds (calls) | internal errors | mismatch | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mismatch = "**yes**: " + (r.error or r.difference) if r.mismatch else "no"
        lines.append(f"| {r.name} | {r.calls} | {r.profiled} | {r.graph_calls} | "
                     f"{_percent(r.share)} | {_percent(r.step_share)} | {r.fallback_calls} | "
                     f"{_kinds(r)} | "
                     f"{r.internal_errors} | {mismatch} | {r.max_abs_diff:.3g} |")
    total = ScriptResult("total", results[0].mode if results else "")
    for r in results:
        for f in ("calls", "profiled", "graph_hits", "captures", "fallback_calls",
                  "step_calls", "step_profiled", "step_graph_calls"):
            setattr(total, f, getattr(total, f) + getattr(r, f))
        total.fallbacks += r.fallbacks
        total.max_abs_diff = max(total.max_abs_diff, r.max_abs_diff)
    mismatches = sum(r.mismatch for r in results)
    whole = sum(r.fallback_calls == 0 and r.calls > 0 for r in results)
    lines.append(f"| **total** ({len(results)} scripts, {whole} with no fallback) | "
                 f"{total.calls} | {total.profiled} | {total.graph_calls} | "
                 f"**{_percent(total.share)}** | **{_percent(total.step_share)}** | "
                 f"{total.fallback_calls} | {_kinds(total)} | "
                 f"{total.internal_errors} | {mismatches} | {total.max_abs_diff:.3g} |")
    return lines


def fallback_table(results: list[ScriptResult]) -> list[str]:
    lines = ["| script | kind | calls | where | function | first explanation |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for f in sorted(r.fallbacks, key=lambda f: -f.calls):
            lines.append(f"| {r.name} | {f.kind} | {f.calls} | {f.location} | {f.function} | "
                         f"{_cell(f.explanation)} |")
    return lines if len(lines) > 2 else ["(no fallbacks)"]


def ranked_causes(results: list[ScriptResult]) -> list[tuple]:
    """(calls, kind, explanation, scripts) per distinct cause, most calls first."""
    calls, scripts = collections.Counter(), collections.defaultdict(set)
    for r in results:
        for f in r.fallbacks:
            key = (f.kind, _cause(f.explanation))
            calls[key] += f.calls
            scripts[key].add(r.name)
    return [(n, kind, why, sorted(scripts[(kind, why)]))
            for (kind, why), n in calls.most_common()]


def _cause(explanation: str) -> str:
    """The explanation without what varies between sites of one cause (sizes, numbers)."""
    return re.sub(r"\d+", "N", explanation.splitlines()[0])


def causes_table(results: list[ScriptResult]) -> list[str]:
    lines = ["| rank | calls | kind | cause | scripts |", "|---|---|---|---|---|"]
    for i, (n, kind, why, names) in enumerate(ranked_causes(results), 1):
        lines.append(f"| {i} | {n} | {kind} | {_cell(why)} | {', '.join(names)} |")
    return lines if len(lines) > 2 else ["(no fallbacks)"]


def _cell(text: str, limit: int = 220) -> str:
    text = text.splitlines()[0] if text else ""
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|")


def render(results: list[ScriptResult], backend: str) -> str:
    mode = ("under `SPECULARCH=1` (subprocesses)" if results and results[0].mode == "switch"
            else "with explicit `specularch.optimize`")
    return "\n".join([
        f"### Corpus {mode}, backend `{backend}`, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)", "",
        "calls are summed over every optimized object; graph calls = graph hits + capturing "
        "calls; graph share = graph calls / (calls - profiled); step share = the same for the "
        "step functions only (a step that falls back still calls its model's optimized "
        "forward, which counts in the graph share)", "",
        *summary_table(results), "", "#### Fallbacks", "", *fallback_table(results), "",
        "#### Fallback causes ranked by the calls they cost", "", *causes_table(results), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", action="store_true",
                        help="run each script as a program under SPECULARCH=1 (subprocesses)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--scripts", help=f"comma-separated subset of: {', '.join(SCRIPTS)}")
    parser.add_argument("--backend", default=None, help="specularch backend (default: fx)")
    args = parser.parse_args(argv)
    names = args.scripts.split(",") if args.scripts else SCRIPTS
    unknown = sorted(set(names) - set(SCRIPTS))
    if unknown:
        parser.error(f"unknown script(s): {', '.join(unknown)}")
    torch.set_num_threads(1)
    results = []
    for name in names:
        print(f"corpus: {name} ...", file=sys.stderr, flush=True)
        run = run_switch if args.switch else run_optimized
        r = run(name, backend=args.backend)
        print(f"corpus: {name}: {r.calls} calls, {_percent(r.share)} graphs, "
              f"{r.fallback_calls} fell back, mismatch={r.mismatch} "
              f"({r.eager_seconds:.2f}s eager, {r.optimized_seconds:.2f}s optimized)",
              file=sys.stderr, flush=True)
        results.append(r)
    print(render(results, args.backend or "fx"))
    if args.json:
        payload = [{**dataclasses.asdict(r), "graph_calls": r.graph_calls, "share": r.share,
                    "step_share": r.step_share,
                    "internal_errors": r.internal_errors} for r in results]
        causes = [{"calls": n, "kind": k, "cause": why, "scripts": s}
                  for n, k, why, s in ranked_causes(results)]
        pathlib.Path(args.json).write_text(json.dumps({"scripts": payload, "causes": causes},
                                                      indent=1))
    return 1 if any(r.mismatch or r.internal_errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
