"""The never-seen-structure regime of ``python -m specularch.bench``.

Every timed step is a whole training step on a structure no earlier step had (a new random
tree per sentence, a new random BPTT length per LM batch), so a system that compiles one
graph per structure pays its capture on every step, or runs eagerly once its cache is
full: the cycle regime (a few batches repeated) measures only the cache. The modes run
side by side, interleaved step by step on the same seeded batches, each on its own copy of
the model; the report gives per mode the median and mean step, the first compiled step,
graphs, cache-limit fallbacks and how far its parameters ended up from eager's.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import specularch

from . import _torch_dynamo
from .steps import make_step, sync, to_device

PRESET = "never_seen"   # the sizes this regime reports (tree models: emb 300, hidden 150)
RTOL, ATOL = 1e-4, 1e-6  # "parameters equal to eager's" after the run
SLOW_STEP_S = 2.0       # a single step this slow is logged as it happens (a compile, usually)


def supports(workload) -> bool:
    """Workloads whose structure varies per batch: the ones this regime is for."""
    return PRESET in workload.presets


def structure(value):
    """A hashable key of a batch's structure: tree shapes, tensor shapes."""
    from specularch.workloads.data import Tree
    if isinstance(value, Tree):
        return "leaf" if value.is_leaf else (structure(value.left), structure(value.right))
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return tuple(structure(v) for v in value)
    return None


def make_batches(workload, preset, count, device):
    """``count`` full batches, each drawn afresh (seeded: the same for every mode and run)."""
    gen = torch.Generator().manual_seed(0)
    return [to_device(workload.make_batch(preset, gen, i), device) for i in range(count)]


@dataclass
class Mode:
    """One way of running the step, and what it did over the run."""

    name: str
    step: Callable
    model: torch.nn.Module
    times: list = field(default_factory=list)   # seconds per step
    new_graphs: list = field(default_factory=list)  # graphs made during each step
    stopped: str = ""                           # why it ran fewer steps than the others

    def graphs_made(self) -> int:
        """Graphs made so far (0 for eager): specularch's captures, torch.compile's graphs."""
        if self.name.startswith("specularch"):
            return specularch.explain(self.step).stats.captures
        if self.name == "torch.compile":
            return _torch_dynamo.graphs_compiled()
        return 0

    def run(self, batch, seed, device):
        torch.manual_seed(seed)  # the same random numbers for every mode (dropout)
        before = self.graphs_made()
        start = time.perf_counter()
        self.step(batch)
        sync(device)
        self.times.append(time.perf_counter() - start)
        self.new_graphs.append(self.graphs_made() - before)


def build_modes(workload, preset, device, backends, with_compile) -> list[Mode]:
    def fresh():
        torch.manual_seed(0)
        model = workload.build(preset).to(device)
        return model, make_step(workload, model, device)

    model, step = fresh()
    modes = [Mode("eager", step, model)]
    for backend in backends:
        model, step = fresh()
        modes.append(Mode(f"specularch {backend}", specularch.optimize(step, backend=backend), model))
    if with_compile:
        torch.compiler.reset()  # the steps share one code object (see the cycle regime)
        model, step = fresh()
        modes.append(Mode("torch.compile", torch.compile(step), model))
    return modes


def run_interleaved(name, modes, batches, device, budget_s, log, progress_every):
    """Step ``i`` of every mode on batch ``i``, the order of the modes rotating per step (no
    mode always runs right after the same other one). A mode whose steps have taken more
    than ``budget_s`` in all is stopped there (torch.compile recompiling per structure)."""
    with _torch_dynamo.RecompileLimitHits() as limit_hits:
        for i, batch in enumerate(batches):
            running = [m for m in modes if not m.stopped]
            shift = i % len(running)
            for mode in running[shift:] + running[:shift]:
                mode.run(batch, seed=i, device=device)
                if mode.times[-1] > SLOW_STEP_S:
                    log(f"{name}: step {i + 1}: {mode.name} took {mode.times[-1]:.1f}s "
                        f"({mode.new_graphs[-1]} new graphs)")
                if sum(mode.times) > budget_s and i + 1 < len(batches):
                    mode.stopped = f"stopped after {i + 1} steps ({budget_s:.0f}s budget)"
                    log(f"{name}: {mode.name} {mode.stopped}")
            if (i + 1) % progress_every == 0 or i + 1 == len(batches):
                log(f"{name}: step {i + 1}/{len(batches)}: " + "; ".join(
                    f"{m.name} median {statistics.median(m.times) * 1e3:.1f} ms, "
                    f"{sum(m.new_graphs)} graphs" for m in modes))
    return limit_hits.hits


def param_difference(model, reference) -> tuple[float, bool]:
    """The largest absolute parameter difference, and whether all are within RTOL/ATOL."""
    worst, close = 0.0, True
    for p, ref in zip(model.parameters(), reference.parameters()):
        worst = max(worst, (p.detach() - ref.detach()).abs().max().item())
        close = close and torch.allclose(p, ref, rtol=RTOL, atol=ATOL)
    return worst, close


def mode_report(mode: Mode, eager: Mode, steps: int, compile_limit_hits: int) -> dict:
    median = statistics.median(mode.times)
    # a stopped mode is compared with eager over the same steps
    entry = {"steps": len(mode.times), "median_ms": median * 1e3,
             "mean_ms": statistics.fmean(mode.times) * 1e3,
             "vs_eager": statistics.median(eager.times[:len(mode.times)]) / median,
             "mean_vs_eager": statistics.fmean(eager.times[:len(mode.times)]) / statistics.fmean(mode.times),
             "first_step_ms": mode.times[0] * 1e3, "graphs": sum(mode.new_graphs),
             "times_ms": [round(t * 1e3, 3) for t in mode.times]}
    compiled = [i for i, n in enumerate(mode.new_graphs) if n]
    if compiled:
        entry.update(first_compiled_step=compiled[0] + 1,
                     first_compiled_step_ms=mode.times[compiled[0]] * 1e3)
    if mode.name.startswith("specularch"):
        e = specularch.explain(mode.step)
        entry.update(cache_limit_fallbacks=sum(f.count for f in e.fallbacks if f.kind == "cache_limit"),
                     fallback_calls=e.stats.fallback_calls,
                     fallback_kinds=sorted({f.kind for f in e.fallbacks}),
                     recompiles=e.stats.recompiles)
    elif mode.name == "torch.compile":
        # torch.compile says only once per code object that its limit was hit (every later
        # call of that code runs eagerly): these are code objects, not calls
        entry["recompile_limit_hits"] = compile_limit_hits
    if mode.stopped:
        entry["stopped"] = mode.stopped
    elif mode is not eager and len(eager.times) == steps:
        entry["max_param_diff"], entry["params_close"] = param_difference(mode.model, eager.model)
    return entry


def bench_workload(name, workload, args, log) -> dict:
    preset = args.preset or PRESET
    batches = make_batches(workload, preset, args.structures, args.device)
    distinct = len({structure(b) for b in batches})
    modes = build_modes(workload, preset, args.device, args.backends, args.torch_compile)
    log(f"{name}: never-seen regime, {len(batches)} steps ({distinct} distinct structures), "
        f"modes: {', '.join(m.name for m in modes)}")
    hits = run_interleaved(name, modes, batches, args.device, args.mode_budget_s, log,
                           args.progress_every)
    eager = modes[0]
    return {"workload": name, "unit": "ms/step", "preset": preset, "steps": len(batches),
            "distinct_structures": distinct,
            "modes": {m.name: mode_report(m, eager, len(batches), hits) for m in modes}}


def _first_compiled(m) -> str:
    if "first_compiled_step" not in m:
        return "-"
    return f"{m['first_compiled_step_ms'] / 1e3:.2f}s (step {m['first_compiled_step']})"


def _limit(m) -> str:
    if "cache_limit_fallbacks" in m:
        return str(m["cache_limit_fallbacks"])
    if "recompile_limit_hits" in m:
        return f"limit hit ({m['recompile_limit_hits']} code objects)"
    return "-"


def _params(m) -> str:
    if "stopped" in m:
        return m["stopped"]
    if "max_param_diff" not in m:
        return "(reference)"
    return f"{m['max_param_diff']:.1e} ({'ok' if m['params_close'] else 'NOT within'} rtol {RTOL:g})"


def table(results) -> str:
    lines = ["| workload | mode | median step | vs eager | mean step | mean vs eager | "
             "first compiled step | graphs captured | cache-limit fallbacks | max param diff vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in results:
        for mode, m in r["modes"].items():
            lines.append(f"| {r['workload']} | {mode} | {m['median_ms']:.2f} ms | {m['vs_eager']:.2f}x | "
                         f"{m['mean_ms']:.2f} ms | {m['mean_vs_eager']:.2f}x | {_first_compiled(m)} | "
                         f"{m['graphs'] if mode != 'eager' else '-'} | {_limit(m)} | {_params(m)} |")
        notes.append(f"* {r['workload']} (preset {r['preset']}): {r['steps']} steps, "
                     f"{r['distinct_structures']} distinct structures")
    return "\n".join(lines + [""] + notes)
