"""The default (tiered) mode once its graphs settled, against the same backend pinned, eager and
``fx``, interleaved step by step: whether a tier costs anything beyond the code it runs.

    python benchmarks/tier_vs_pinned.py [--model lenet] [--backend torchscript] [--steps 400]

``python -m specularch.bench`` interleaves its modes round by round (a round: some steps of
one mode), and on a 4-7 ms step the shared VM's phases move a mode's round by ±10%: there the
default mode on TorchScript measured 0.93-0.98 of pinned TorchScript. Here each step of each
mode follows the last one's (same batch, the modes in turn), timed by CPU time, one thread;
the tiered mode's only candidate is ``--backend``, and the timing starts once every graph's
tier is final. Prints the median ms per step and each mode's speedup over eager.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specularch
from specularch import tiering
from specularch.tiering import policy
from train_step import MODELS, make_step  # (this script's folder is on sys.path)


def _settle(fn, batches, seconds: float = 120.0) -> list:
    """Calls ``fn`` on ``batches`` until every graph's tier is final; returns the tier lines."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for batch in batches:
            fn(*batch)
        tiering.wait(timeout=seconds)
        report = specularch.explain(fn)
        if report.graphs and all(g.tier is not None and g.tier.settled for g in report.graphs):
            return [g.tiers[0] for g in report.graphs]
    raise SystemExit(f"the tiered mode did not settle within {seconds} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lenet", choices=sorted(MODELS))
    parser.add_argument("--backend", default="torchscript")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    policy.CANDIDATES = (args.backend,)
    make_model, make_batch = MODELS[args.model]
    torch.manual_seed(1)
    batches = [make_batch() for _ in range(4)]

    def step(backend=None):
        """A fresh model's training step: eager (None), or optimized with ``backend``."""
        torch.manual_seed(0)
        model = make_model()
        fn = make_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
        return fn if backend is None else specularch.optimize(fn, backend=backend)

    modes = {"eager": step(), "tiered": step("auto"), f"{args.backend} pinned": step(args.backend),
             "fx pinned": step("fx")}
    print(f"tiered: {_settle(modes['tiered'], batches)}")
    for name, fn in modes.items():  # (the pinned modes' first calls: capture, compile)
        for batch in batches:
            fn(*batch)
    times = {name: [] for name in modes}
    for i in range(args.steps):
        batch = batches[i % len(batches)]
        for name, fn in modes.items():
            start = time.thread_time()
            fn(*batch)
            times[name].append(time.thread_time() - start)
    eager = statistics.median(times["eager"])
    print(f"{args.model}, 1 thread, {args.steps} steps per mode, interleaved step by step (CPU time):")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:22s} {median * 1e3:8.3f} ms  {eager / median:5.3f}x eager")


if __name__ == "__main__":
    main()
