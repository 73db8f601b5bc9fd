"""``python -m specularch.bench``: training throughput of the JANUS workloads (``models/``)
for eager, specularch (per backend) and torch.compile, side by side in one process.

Each mode trains its own copy of the model (same seed) with SGD on the same cycle of
pre-generated batches (``--batches`` full batches and the epoch's short last batch). Before
timing, every mode runs specularch's profiled calls and then one whole cycle, so every
batch shape has been captured and compiled (that warm-up, and specularch's capture + compile
seconds, are reported in their own columns); then modes are interleaved round by round.
The default mode (``auto``: tiered, compiling in the background) runs more cycles after its
warm-up until its hot graphs' candidates are decided; its row shows the time from its first
call to its first speedup and the tier each graph ended on.
Medians over rounds and ratios to eager are printed as a markdown table, with one check of
the guards in µs (the costliest graph's, as ``explain()`` reports it) and the backend that
actually ran each specularch graph (a backend that refuses a graph leaves it to ``fx`` with a
note, printed below the table); everything is written to JSON. Progress goes to stderr.
``--profile DIR`` writes PyTorch profiler traces (TensorBoard, torch-tb-profiler).

That cycle regime measures only the cache for workloads whose structure varies per batch.
Those (tree_rnn, tree_lstm, lstm_lm, greedy_decoder) run in the never-seen regime (``never_seen.py``) unless
``--regime cycle`` says otherwise: every timed step a structure no earlier step had.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time

import torch

import specularch

from . import never_seen
from .steps import make_step, sync, to_device


def build_modes(workload, preset, device, backends, with_compile, with_script):
    modes = {}

    def fresh():
        torch.manual_seed(0)
        return workload.build(preset).to(device)

    modes["eager"] = make_step(workload, fresh(), device)
    for backend in backends:
        modes[f"specularch {backend}"] = specularch.optimize(make_step(workload, fresh(), device),
                                                             backend=backend)
    if with_compile:
        # Each workload's step starts from empty torch.compile caches: the steps share one code
        # object, so an earlier workload's recompiles would count against this one's
        # recompile limit (and past it torch.compile silently runs the step eagerly).
        torch.compiler.reset()
        modes["torch.compile"] = torch.compile(make_step(workload, fresh(), device))
    if with_script:
        try:
            modes["torch.jit.script"] = make_step(workload, torch.jit.script(fresh()), device)
        except Exception as e:  # not scriptable (Python objects, recursion over trees, ...)
            modes["torch.jit.script"] = _unavailable(f"not scriptable: {type(e).__name__}")
    return modes


def _unavailable(reason):
    def step(batch):
        raise RuntimeError(reason)
    return step


def make_batches(workload, preset, count, device):
    """``count`` full batches and the epoch's short last batch, on ``device``."""
    gen = torch.Generator().manual_seed(0)
    batches = [workload.make_batch(preset, gen, i) for i in range(count)]
    batches.append(workload.make_batch(preset, gen, count, last=True))
    return [to_device(b, device) for b in batches]


MAX_WARMUP_CYCLES = 6


def warm_up(step, batches, mode: str) -> int:
    """specularch's profiled calls, then whole cycles of the batches until one cycle captured
    nothing new (a relaxation found in one cycle can drop graphs that the next cycle captures
    again; at most ``MAX_WARMUP_CYCLES``), so every batch shape is captured and compiled here,
    not in the timed rounds. Other modes run two cycles (torch.compile recompiles once when a
    size changes). Returns the number of cycles."""
    specularch_mode = mode.startswith("specularch")
    for i in range(specularch.config.profile_calls if specularch_mode else 0):
        step(batches[i % len(batches)])
    for cycle in range(1, MAX_WARMUP_CYCLES + 1):
        before = specularch.explain(step).stats.captures if specularch_mode else None
        for batch in batches:
            step(batch)
        if specularch_mode and specularch.explain(step).stats.captures == before:
            return cycle
        if not specularch_mode and cycle == 2:
            return cycle
    return MAX_WARMUP_CYCLES


def settle_tiers(step, batches, budget_s: float = 300.0, hot_within_s: float = 60.0) -> float | None:
    """The tiered mode (``auto``): more cycles until every graph got hot and its candidates
    are decided and no background compile is pending (at most ``budget_s``), so that the
    timed rounds measure the tier each graph ends on, not its trials. A graph that is not hot
    after ``hot_within_s`` counts as cold (it stays on ``fx``): the warm-up cycles alone are
    too few calls for a graph to reach ``config.tier_min_hits`` and ``tier_min_seconds``.
    Returns the seconds from the mode's first call to its first speedup (a candidate kept),
    or None."""
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s:
        tiers = [g.tier for g in specularch.explain(step).graphs if g.tier is not None]
        cold_ok = time.perf_counter() - start >= hot_within_s
        if specularch.tiering.pending() == 0 and \
                all(t.settled or (cold_ok and t.submitted_at is None) for t in tiers):
            break
        for batch in batches:
            step(batch)
    tiers = [g.tier for g in specularch.explain(step).graphs if g.tier is not None]
    kept = [t.promoted_at - t.started for t in tiers if t.promoted_at is not None]
    return min(kept) if kept else None


def backend_report(explanation) -> dict:
    """Which backend actually ran the graphs (for ``auto``: the tier each graph ended on),
    and why another one was not used."""
    used = collections.Counter(g.backend for g in explanation.graphs)
    notes = list(dict.fromkeys(g.note for g in explanation.graphs if g.note))
    tiers = [line for g in explanation.graphs for line in g.tiers if "not hot enough" not in line]
    return {"backends": dict(used), "notes": notes, **({"tiers": tiers} if tiers else {})}


def bench_workload(name, workload, args, log):
    batches = make_batches(workload, args.preset, args.batches, args.device)
    modes = build_modes(workload, args.preset, args.device, args.backends, args.torch_compile,
                        args.torchscript)
    result = {"workload": name, "unit": workload.unit, "preset": args.preset, "modes": {}}
    first, cycles, alive, failed, speedup = {}, {}, {}, {}, {}
    for mode, step in modes.items():
        log(f"{name}: warm-up over every batch shape ({mode})")
        try:
            start = time.perf_counter()
            cycles[mode] = warm_up(step, batches, mode)
            if mode == "specularch auto":
                speedup[mode] = settle_tiers(step, batches, hot_within_s=args.tier_warmup_s)
            sync(args.device)
            first[mode] = time.perf_counter() - start
            alive[mode] = step
        except Exception as e:
            failed[mode] = {"error": str(e) if isinstance(e, RuntimeError) else
                            f"{type(e).__name__}: {e}"}
            log(f"{name}: {mode} failed: {type(e).__name__}: {e}")
    rates = {mode: [] for mode in alive}
    captures = {mode: specularch.explain(step).stats.captures for mode, step in alive.items()
                if mode.startswith("specularch")}
    for r in range(args.rounds):
        log(f"{name}: round {r + 1}/{args.rounds}")
        for mode, step in alive.items():
            items, start = 0, time.perf_counter()
            for i in range(args.steps):
                batch = batches[i % len(batches)]
                step(batch)
                items += workload.items(batch)
            sync(args.device)
            rates[mode].append(items / (time.perf_counter() - start))
    for mode in modes:  # rows in the order of the modes
        if mode in failed:
            result["modes"][mode] = failed[mode]
            continue
        values = rates[mode]
        entry = {"throughput": statistics.median(values), "warmup_s": first[mode],
                 "warmup_cycles": cycles[mode]}
        if mode.startswith("specularch"):
            e = specularch.explain(alive[mode])
            entry.update(graphs=len(e.graphs), recompiles=e.stats.recompiles,
                         fallback_calls=e.stats.fallback_calls,
                         fallback_kinds=sorted({f.kind for f in e.fallbacks}),
                         compile_s=e.stats.capture_seconds + e.stats.compile_seconds,
                         first_speedup_s=speedup.get(mode),
                         captures_while_timed=e.stats.captures - captures[mode],
                         guard_us=max((g.guard_us for g in e.graphs if g.guard_us is not None),
                                      default=None),
                         **backend_report(e))
            if entry["captures_while_timed"]:
                log(f"{name}: {mode} captured {entry['captures_while_timed']} graphs during the "
                    f"timed rounds (the warm-up did not reach a steady state)")
        result["modes"][mode] = entry
    if args.profile:
        profile(name, alive, batches, args.profile, log)
    return result


def profile(name, modes, batches, directory, log):
    from torch.profiler import ProfilerActivity, profile as torch_profile, tensorboard_trace_handler
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    for mode, step in modes.items():
        log(f"{name}: profiling {mode} -> {directory}")
        handler = tensorboard_trace_handler(directory, worker_name=f"{name}-{mode.replace(' ', '_')}")
        with torch_profile(activities=activities, on_trace_ready=handler):
            for batch in batches[:3]:
                step(batch)


def _ran_with(m) -> str:
    if "backends" not in m:
        return "-"
    return ", ".join(f"{b} {n}" for b, n in sorted(m["backends"].items())) or "-"


def table(results) -> str:
    """The markdown table, then one line per distinct backend note."""
    lines = ["| workload | unit | mode | throughput | vs eager | warm-up (all shapes) | "
             "capture + compile | first speedup | graphs | guard µs | ran with | recompiles | fallback calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in results:
        eager = r["modes"].get("eager", {}).get("throughput")
        for mode, m in r["modes"].items():
            if "error" in m:
                lines.append(f"| {r['workload']} | {r['unit']} | {mode} | error: {m['error'][:60]} "
                             f"| | | | | | | | | |")
                continue
            ratio = f"{m['throughput'] / eager:.2f}x" if eager else "-"
            compile_s = f"{m['compile_s']:.2f}s" if "compile_s" in m else "-"
            fast = m.get("first_speedup_s")
            fast = f"{fast:.2f}s" if fast is not None else "-"
            guard = f"{m['guard_us']:.1f}" if m.get("guard_us") is not None else "-"
            lines.append(f"| {r['workload']} | {r['unit']} | {mode} | {m['throughput']:.1f} | {ratio} | "
                         f"{m['warmup_s']:.2f}s | {compile_s} | {fast} | {m.get('graphs', '-')} | {guard} | "
                         f"{_ran_with(m)} | "
                         f"{m.get('recompiles', '-')} | {m.get('fallback_calls', '-')} |")
            notes += [f"* {r['workload']}, {mode}: {note}" for note in m.get("notes", ())]
            notes += [f"* {r['workload']}, {mode}: {line}" for line in m.get("tiers", ())]
    return "\n".join(lines + ([""] + notes if notes else []))


def _parser(workloads) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specularch.bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workloads", default=",".join(workloads), help="comma-separated names")
    parser.add_argument("--regime", default="auto", choices=("auto", "cycle", "never-seen"),
                        help="cycle: the same few batches repeated (measures the cache); "
                             "never-seen: every step a new tree / BPTT length / decoding "
                             "length (tree_rnn, tree_lstm, lstm_lm, greedy_decoder); auto: never-seen where a workload has it")
    parser.add_argument("--preset", default=None, choices=("tiny", "cpu", "paper", never_seen.PRESET),
                        help="workload sizes (tiny: a smoke run); default: cpu for the cycle "
                             f"regime, {never_seen.PRESET} for the never-seen one")
    parser.add_argument("--backends", default="auto,fx",
                        help="specularch backends, comma-separated (auto: the default, tiered)")
    parser.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also run torch.compile (default: in the never-seen regime only)")
    parser.add_argument("--torchscript", action="store_true",
                        help="also run torch.jit.script(model) where the model is scriptable")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (modes interleaved)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    parser.add_argument("--batches", type=int, default=4,
                        help="distinct full batches cycled through (plus the short last batch)")
    parser.add_argument("--structures", type=int, default=100,
                        help="never-seen regime: timed steps, each on a new structure")
    parser.add_argument("--mode-budget-s", type=float, default=900.0,
                        help="never-seen regime: stop a mode whose steps took longer in all")
    parser.add_argument("--progress-every", type=int, default=10,
                        help="never-seen regime: log medians every this many steps")
    parser.add_argument("--tier-warmup-s", type=float, default=60.0,
                        help="auto: seconds of steps for its graphs to get hot and compiled in "
                             "the background before the timed rounds (a graph not hot by then "
                             "stays on fx)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", default="bench-results/results.json", help="results file")
    parser.add_argument("--profile", default=None, help="write profiler traces to this folder")
    return parser


def _split_regimes(args, parser, workloads):
    """(cycle workloads and their args, never-seen workloads and theirs); each regime's own
    default preset and torch.compile default."""
    names = args.workloads.split(",")
    unknown = [w for w in names if w not in workloads]
    if unknown:
        parser.error(f"unknown workloads {unknown}; available: {sorted(workloads)}")
    fresh = [n for n in names if args.regime == "never-seen" or
             (args.regime == "auto" and never_seen.supports(workloads[n]))]
    lacking = [n for n in names if (args.preset or (never_seen.PRESET if n in fresh else "cpu"))
               not in workloads[n].presets]
    if lacking:
        parser.error(f"workloads {lacking} have no preset {args.preset or never_seen.PRESET!r}")
    cycle_args = argparse.Namespace(**{**vars(args), "preset": args.preset or "cpu",
                                       "torch_compile": bool(args.torch_compile)})
    fresh_args = argparse.Namespace(**{**vars(args), "torch_compile": args.torch_compile is not False})
    return [n for n in names if n not in fresh], cycle_args, fresh, fresh_args


def main(argv=None) -> int:
    from specularch.workloads import WORKLOADS
    parser = _parser(WORKLOADS)
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available on this machine")
    cycle, cycle_args, fresh, fresh_args = _split_regimes(args, parser, WORKLOADS)
    torch.set_num_threads(args.threads)

    def log(message):
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    results = [bench_workload(n, WORKLOADS[n], cycle_args, log) for n in cycle]
    fresh_results = [never_seen.bench_workload(n, WORKLOADS[n], fresh_args, log) for n in fresh]
    machine = f"{platform.machine()} {os.cpu_count()} cores, {platform.node()}"
    print(f"torch={torch.__version__} device={args.device} threads={torch.get_num_threads()} "
          f"machine={machine} date={time.strftime('%Y-%m-%d %H:%M %Z')}")
    header = (f"preset={cycle_args.preset} device={args.device} threads={torch.get_num_threads()} "
              f"rounds={args.rounds} steps/round={args.steps} torch={torch.__version__} (medians)")
    if results:
        print(header)
        print(table(results))
    if fresh_results:
        print(f"\nnever-seen structures: each step a new structure (tree, BPTT length, decoding length), modes interleaved, "
              f"threads={torch.get_num_threads()}, medians over all {args.structures} steps")
        print(never_seen.table(fresh_results))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"header": header, "results": results, "never_seen": fresh_results,
                   "threads": torch.get_num_threads(), "machine": machine}, f, indent=2)
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
