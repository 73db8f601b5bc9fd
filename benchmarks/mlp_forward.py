"""Per-call time of a small MLP forward: eager vs specularch vs torch.compile, side by side.

    python benchmarks/mlp_forward.py [--quick] [--rounds N] [--calls N] [--warm-cache]
        [--backends torchscript,inductor] [--no-torch-compile]

The model is nn.Sequential(Linear(256, 256), ReLU, Linear(256, 256), ReLU, Linear(256, 10)) on
a batch of 32, run under ``torch.no_grad()`` and with grad enabled (forward only). Modes:

* ``eager``                      — the module called normally;
* ``specularch``                 — ``specularch.optimize(model)`` (default ``fx`` backend);
* ``specularch graph only``      — the captured graph's compiled function called directly with
  the same inputs (no dispatch, no guards): the floor specularch could reach;
* ``specularch <backend>``       — with ``--backends``: specularch with another backend (the
  backend that ran the graphs is printed; one that refuses a graph leaves it to ``fx``);
* ``torch.compile (inductor)``   — ``torch.compile(model)``, the default backend;
* ``torch.compile (aot_eager)``  — ``torch.compile(model, backend="aot_eager")`` (no code
  generation; also the fallback when Inductor cannot compile on this machine, e.g. no C++
  compiler or OpenMP: the reason is printed).

Rules: ``torch.set_num_threads(1)``; every mode has its own copy of the same weights and is
warmed up; the modes are interleaved in rounds within one process (order rotated each round);
medians over rounds; ratios are eager time / mode time (above 1.00x = faster than eager).
specularch's dispatch + guard overhead per cached call is, per round, specularch's per-call
time minus the direct call of its graph, and the median of that is printed. First-call times
(capture + compile) are printed for specularch and torch.compile in both grad modes; Inductor
compiles into a fresh cache directory (a cold compile) unless ``--warm-cache`` is given.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import specularch

BATCH, WIDTH, OUT = 32, 256, 10


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, OUT))


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def per_call_us(fn, args: tuple, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def graph_only(model: nn.Module, x: torch.Tensor):
    """(compiled graph function, its inputs) of ``model``'s cached graph for the current grad
    mode: exactly what a cache hit calls after its guards passed."""
    state = specularch.api._state_of(model)
    entry = next(e for e in state.entries if e.grad_enabled == torch.is_grad_enabled())
    graph_fn = entry.fn.__globals__["GRAPH"]  # the backend's compiled function
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    inputs = []
    for source in map(str, entry.capture.input_sources):
        if source.startswith("L['self']."):
            inputs.append(named[source[len("L['self']."):]])
        elif source.startswith("L["):
            inputs.append(x)  # the forward's only argument
        else:
            raise RuntimeError(f"unexpected graph input {source}")
    return graph_fn, tuple(inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds x 50 calls (a smoke run)")
    parser.add_argument("--rounds", type=int, help="rounds per grad mode (default 21)")
    parser.add_argument("--calls", type=int, help="calls per mode per round (default 300)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="let Inductor use its usual on-disk cache (first call not cold)")
    parser.add_argument("--backends", default="",
                        help="also time specularch with these backends (e.g. torchscript,inductor)")
    parser.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()
    cold_cache = None
    if not args.warm_cache:  # read lazily by Inductor, so setting it here is early enough
        cold_cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    try:
        run(args)
    finally:
        if cold_cache:
            shutil.rmtree(cold_cache, ignore_errors=True)


def run(args) -> None:
    rounds, calls = (3, 50) if args.quick else (21, 300)
    rounds, calls = args.rounds or rounds, args.calls or calls
    torch.set_num_threads(1)
    wall = time.perf_counter()
    x = torch.randn(BATCH, WIDTH)
    with torch.no_grad():
        reference = mlp()(x)

    models: dict[str, nn.Module] = {"eager": mlp(), "specularch": specularch.optimize(mlp())}
    for backend in [b for b in args.backends.split(",") if b and b != "fx"]:
        models[f"specularch {backend}"] = specularch.optimize(mlp(), backend=backend)
    problems: list[str] = []
    for name, backend in (("torch.compile (inductor)", "inductor"),
                          ("torch.compile (aot_eager)", "aot_eager")):
        if not args.no_torch_compile:
            models[name] = torch.compile(mlp(), backend=backend)
    first: dict[tuple[str, str], float] = {}
    grad_modes = ("no_grad", "grad")

    for grad_mode in grad_modes:
        with torch.set_grad_enabled(grad_mode == "grad"):
            for name in [n for n in models if n.startswith("specularch")]:
                spec = models[name]
                while not specularch.explain(spec).graphs or \
                        all(e.grad_enabled != torch.is_grad_enabled()
                            for e in specularch.api._state_of(spec).entries):
                    seconds, _ = timed(spec, x)  # profiled eager calls, then the capturing call
                first[(name, grad_mode)] = seconds
            for name in [n for n in models if n.startswith("torch.compile")]:
                try:
                    seconds, out = timed(models[name], x)
                    torch.testing.assert_close(out.detach(), reference, rtol=1e-4, atol=1e-5)
                    first[(name, grad_mode)] = seconds
                except Exception as e:  # e.g. Inductor without a working C++ toolchain
                    why = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                    problems.append(f"{name} failed ({grad_mode}): {type(e).__name__}: {why}")
                    del models[name]

    results = {g: {} for g in grad_modes}
    overhead = {g: [] for g in grad_modes}
    for grad_mode in grad_modes:
        with torch.set_grad_enabled(grad_mode == "grad"):
            fns = {name: (m, (x,)) for name, m in models.items()}
            fns["specularch graph only"] = graph_only(models["specularch"], x)
            for name, (fn, fn_args) in fns.items():
                out = fn(*fn_args)
                out = out[0] if isinstance(out, tuple) else out
                exact = not name.startswith(("torch.compile (inductor)", "specularch "))
                torch.testing.assert_close(out.detach(), reference, rtol=0 if exact else 1e-4,
                                           atol=0 if exact else 1e-5, msg=lambda m: f"{name}: {m}")
                for _ in range(30):
                    fn(*fn_args)  # warm up
            results[grad_mode] = {name: [] for name in fns}
            names = list(fns)
            hits_before = specularch.explain(models["specularch"]).stats.graph_hits
            gc.collect()
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                this_round = {}
                for name in order:
                    fn, fn_args = fns[name]
                    this_round[name] = per_call_us(fn, fn_args, calls)
                for name, us in this_round.items():
                    results[grad_mode][name].append(us)
                overhead[grad_mode].append(this_round["specularch"] - this_round["specularch graph only"])
            e = specularch.explain(models["specularch"])
            if e.stats.graph_hits - hits_before != rounds * calls or e.fallbacks:
                problems.append(f"specularch did not run from its cache in every timed call "
                                f"({grad_mode}):\n{e}")

    print(f"MLP {WIDTH}-{WIDTH}-{WIDTH}-{OUT} forward, batch {BATCH}; torch {torch.__version__}, "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"torch threads={torch.get_num_threads()}")
    print(f"{rounds} rounds x {calls} calls per mode, modes interleaved; medians over rounds; "
          f"'vs eager' = eager time / mode time\n")
    names = list(results[grad_modes[0]])
    width = max(len(n) for n in names)
    print(f"{'mode':{width}s} | {'no_grad us/call':>15s} {'vs eager':>8s} | "
          f"{'grad us/call':>12s} {'vs eager':>8s}")
    print(f"{'-' * width}-+-{'-' * 24}-+-{'-' * 21}")
    for name in names:
        cells = []
        for grad_mode, w in zip(grad_modes, (15, 12)):
            med = statistics.median(results[grad_mode][name])
            eager = statistics.median(results[grad_mode]["eager"])
            cells.append(f"{med:{w}.1f} {eager / med:7.2f}x")
        print(f"{name:{width}s} | {cells[0]} | {cells[1]}")
    print("\nspecularch dispatch + guard overhead per cached call "
          "(specularch - its graph called directly, median of per-round differences):")
    for grad_mode in grad_modes:
        values = overhead[grad_mode]
        print(f"  {grad_mode:8s} {statistics.median(values):6.2f} us "
              f"(min {min(values):.2f}, max {max(values):.2f})")
    print("\nfirst call (capture/trace + compile), ms:")
    for grad_mode in grad_modes:
        row = ", ".join(f"{name} {first[(name, grad_mode)] * 1e3:.0f}"
                        for name, g in first if g == grad_mode)
        print(f"  {grad_mode:8s} {row}")
    inductor_ran = not args.no_torch_compile or "inductor" in args.backends.split(",")
    cache = (f"; Inductor's on-disk cache was {'used' if args.warm_cache else 'empty (cold compile)'}"
             if inductor_ran else "")
    print(f"  (specularch: after {specularch.config.profile_calls} profiled eager calls; "
          f"its grad graph is a recompile of the same cache{cache})")
    for name in [n for n in models if n.startswith("specularch")]:
        graphs = specularch.explain(models[name]).graphs
        ran = ", ".join(f"{'grad' if e.grad_enabled else 'no_grad'}: {e.backend}"
                        + (f" ({e.note})" if e.note else "")
                        for e in specularch.api._state_of(models[name]).entries)
        print(f"  {name}: {len(graphs)} graphs, ran with {ran}")
    for problem in problems:
        print(f"\nnote: {problem}")
    print(f"\ntotal wall time {time.perf_counter() - wall:.0f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
