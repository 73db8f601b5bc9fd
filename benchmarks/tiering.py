"""Tiered execution (the default, ``backend="auto"``) over a minute of training, against eager
and the pinned backends, for the MLP and LeNet of ``train_step.py``.

    python benchmarks/tiering.py [--seconds 60] [--models mlp,lenet] [--pinned fx,torchscript,inductor]
        [--switch-interval 0.0005] [--compile-in process|thread] [--worker fork|new]
        [--json PATH] [--trace]
        [--cache-dir DIR] [--what step|forward] [--short-every K]

One thread (``torch.set_num_threads(1)``), unmodified Adam training steps, subnormal floats
flushed to zero (``torch.set_flush_denormal(True)``, every mode): the tiered model has trained
tens of thousands of steps on the same 4 batches when the final ratios are taken, the others
a few, and past ~70 thousand steps its arithmetic reaches subnormal floats, which cost
compiled kernels far more than eager's (measured: Inductor's step 1.8x eager, then 0.95x),
so unflushed the final ratios compared training stages, not backends. Per model:

* eager: the median step over 10 s, and its slowest step over the median (the machine's
  noise, to read the next number against);
* tiered: every step of ``--seconds`` timed from the first call; the slowest step while a
  background compile was pending, over the eager median (the GIL cost of compiling beside
  the program); the time from the first call to the first speedup (a candidate kept); the
  tier each graph ended on;
* then eager, tiered and each pinned backend interleaved round by round (medians): the final
  ratio of tiered to eager and to the best pinned backend.

``--what forward`` optimizes the model only (``specularch.optimize(model)``; the loss,
``backward()`` and Adam stay eager): its graph's results need autograd, and its candidates
travel to the worker as their forward and backward (``fx_lower/split.py``).
``--short-every K`` makes every K-th batch a short one (a third of the rows), as a
``DataLoader`` without ``drop_last`` gives at each epoch's end: the graph's batch dimension
becomes dynamic (``guards/relax.py``).
``--worker`` chooses how the worker process starts: forked from the program where that is safe
(``fork``, the default; ``specularch.tiering.process.FORK``) or as a new interpreter (``new``).
``--compile-in`` chooses where candidates compile (``specularch.tiering.process.ENABLED``; default
``process``). ``--switch-interval`` sets the thread switch interval the background compiler uses
(``specularch.tiering.worker.SWITCH_INTERVAL``; CPython's default is 0.005 s).
Inductor and the compile cache start from fresh, empty directories (a first run), unless
``--cache-dir`` names one (run twice with the same one: the second run's numbers are a second
run's). ``--trace`` lists the slowest steps while compiling with the tiering events that
happened during each (worker started, job sent, artefact loaded, warm-up, trial calls,
decisions, Python's garbage collections), to find where a slow step's time went.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specularch  # noqa: E402
from specularch import _glibc_malloc  # noqa: E402
from specularch.tiering import process, worker  # noqa: E402
import tiering_trace  # noqa: E402
from train_step import MODELS, build, make_step  # noqa: E402


def _batches(name, count=4, short_every=0):
    """``count`` batches; with ``short_every`` K, K batches of which the last is a short one
    (its first third of rows: a DataLoader's last batch of an epoch without ``drop_last``)."""
    torch.manual_seed(1)
    if not short_every:
        return [MODELS[name][1]() for _ in range(count)]
    batches = [MODELS[name][1]() for _ in range(short_every)]
    x, y = batches[-1]
    batches[-1] = (x[:max(2, x.shape[0] // 3)], y[:max(2, y.shape[0] // 3)])
    return batches


def _eager_steps(step, batches, seconds):
    """The median eager step, and the slowest step over it (the machine's own noise: on a
    shared machine a step preempted by other jobs is slow with nothing compiling)."""
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        x, y = batches[len(times) % len(batches)]
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return median, max(times[1:]) / median, _p99(times[1:]) / median


def _p99(times):
    return statistics.quantiles(times, n=100)[-1] if len(times) > 100 else max(times)


def optimized_step(name, what, **options):
    """A fresh training step of ``name`` with ``specularch.optimize(..., **options)`` applied to
    the whole step (``what="step"``) or to the model only (``"forward"``: loss, ``backward()``
    and Adam eager around it); and what ``explain`` reports on."""
    model, opt = build(name)
    if what == "forward":
        return make_step(specularch.optimize(model, **options), opt), model
    step = specularch.optimize(make_step(model, opt), **options)
    return step, step


def tiered_run(name, batches, seconds, eager_s, trace=None, what="step"):
    """Every step of a fresh tiered step for ``seconds``."""
    step, explained = optimized_step(name, what)
    first = time.perf_counter()
    rows = []  # (seconds since the first call, step seconds, compiling?)
    while time.perf_counter() - first < seconds:
        x, y = batches[len(rows) % len(batches)]
        compiling = worker.pending() > 0
        start = time.perf_counter()
        step(x, y)
        end = time.perf_counter()
        rows.append((start - first, end - start, compiling or worker.pending() > 0))
    graphs = specularch.explain(explained).graphs
    tiers = [g.tier for g in graphs if g.tier is not None]
    kept = [t.promoted_at - first for t in tiers if t.promoted_at is not None]
    while_compiling = [s for _, s, c in rows if c]
    steady = [s for t, s, c in rows if not c and t > rows[-1][0] - 10]  # the last 10 s
    return step, {
        "steps": len(rows),
        "first_call_s": rows[0][1],
        "slowest_while_compiling_over_eager": max(while_compiling) / eager_s if while_compiling else None,
        "p90_while_compiling_over_eager":
            statistics.quantiles(while_compiling, n=10)[-1] / eager_s if len(while_compiling) > 10 else None,
        "p99_while_compiling_over_eager": _p99(while_compiling) / eager_s if while_compiling else None,
        "steps_while_compiling": len(while_compiling),
        "steps_over_3x_eager_while_compiling": sum(s > 3 * eager_s for s in while_compiling),
        "final_tier_s": _since(trace.final_tier_at(tiers), first) if trace else None,
        "first_speedup_s": min(kept) if kept else None,
        "last_10s_over_eager": eager_s / statistics.median(steady) if steady else None,
        "tiers": [line for g in graphs for line in g.tiers],
        "ended_on": [g.backend for g in graphs],
        "worker_started": getattr(process._current, "started", None),  # (None: none needed)
        "malloc": _glibc_malloc._done,  # (specularch/_glibc_malloc.py; None: no compiled trial)
        **({"slowest_steps": trace.slowest(rows, first, eager_s)} if trace else {}),
    }, explained


def _since(when, first):
    return None if when is None else when - first


def _settle(step, explained, batches, budget_s=300.0):
    """Steps until no compile is pending and every hot graph's candidates are decided: the
    interleaved rounds measure the tier each graph ends on, not a trial (a trial runs half
    its calls on the candidate, e.g. Inductor at 0.5x eager on LeNet). Returns the seconds."""
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s:
        tiers = [g.tier for g in specularch.explain(explained).graphs if g.tier is not None]
        if specularch.tiering.pending() == 0 and \
                all(t.settled or t.submitted_at is None for t in tiers):
            break
        for x, y in batches:
            step(x, y)
    return time.perf_counter() - start


def interleaved(modes, batches, rounds=5, steps=20):
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, step in modes.items():
            start = time.perf_counter()
            for i in range(steps):
                step(*batches[i % len(batches)])
            times[mode].append((time.perf_counter() - start) / steps)
    return {m: statistics.median(t) for m, t in times.items()}


def bench(name, args):
    batches = _batches(name, short_every=args.short_every)
    model, opt = build(name)
    eager = make_step(model, opt)
    eager_s, eager_slowest, eager_p99 = _eager_steps(eager, batches, 10)
    print(f"[{name}] eager step {eager_s * 1e3:.2f} ms", file=sys.stderr, flush=True)
    tiered, result, explained = tiered_run(name, batches, args.seconds, eager_s,
                                           tiering_trace.Trace() if args.trace else None, args.what)
    result.update(slowest_eager_step_over_eager=eager_slowest, p99_eager_step_over_eager=eager_p99,
                  load_average=os.getloadavg())
    print(f"[{name}] tiered: {json.dumps(result, indent=1)}", file=sys.stderr, flush=True)
    result["settle_s"] = _settle(tiered, explained, batches)
    result["tiers_at_the_end"] = [line for g in specularch.explain(explained).graphs for line in g.tiers]
    modes = {"eager": eager, "tiered": tiered}
    for backend in args.pinned:
        step, _ = optimized_step(name, args.what, backend=backend)
        start = time.perf_counter()
        for i in range(6):  # profiled calls, the capture and compile, the .grad-set graph
            step(*batches[i % len(batches)])
        result[f"{backend}_warm_up_s"] = time.perf_counter() - start
        modes[backend] = step
    medians = interleaved(modes, batches)
    best = min(args.pinned, key=lambda b: medians[b])
    result.update(eager_ms=medians["eager"] * 1e3,
                  **{f"{m}_vs_eager": medians["eager"] / medians[m] for m in modes if m != "eager"},
                  best_pinned=best, tiered_vs_best_pinned=medians[best] / medians["tiered"])
    return {"model": name, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--models", default="mlp,lenet")
    parser.add_argument("--pinned", default="fx,torchscript,inductor")
    parser.add_argument("--switch-interval", type=float, default=worker.SWITCH_INTERVAL)
    parser.add_argument("--compile-in", choices=("process", "thread"), default="process")
    parser.add_argument("--worker", choices=("fork", "new"), default="fork")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--what", choices=("step", "forward"), default="step")
    parser.add_argument("--short-every", type=int, default=0)
    args = parser.parse_args()
    args.pinned = [b for b in args.pinned.split(",") if b]
    worker.SWITCH_INTERVAL = args.switch_interval
    process.ENABLED = args.compile_in == "process"
    process.FORK = args.worker == "fork"
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # (see the docstring: the modes are at different stages)
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="inductor-")
    specularch.config.compile_cache_dir = os.path.join(cache, "specularch")
    try:
        results = [bench(name, args) for name in args.models.split(",")]
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)
    print(f"torch={torch.__version__} threads=1 switch_interval={args.switch_interval} "
          f"compile_in={args.compile_in} worker={args.worker} "
          f"seconds={args.seconds}")
    for r in results:
        print(json.dumps(r, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
