"""The default (tiered) mode once its graphs settled, against the same backend pinned, eager and
``fx``, interleaved step by step: whether a tier costs anything beyond the code it runs.

    python benchmarks/tier_vs_pinned.py [--model lenet] [--backend torchscript] [--steps 400]

``python -m specularch.bench`` interleaves its modes round by round (a round: some steps of
one mode), and on a 4-7 ms step the shared VM's phases move a mode's round by ±10%: there the
default mode on TorchScript measured 0.93-0.98 of pinned TorchScript. Here each step of each
mode follows the last one's (same batch, the modes in turn, their order turned every step),
timed by CPU time, one thread;
the tiered mode's only candidate is ``--backend``, and the timing starts once every graph's
tier is final. Prints the median ms per step and each mode's speedup over eager, twice: with
the tiered model built before the pinned one and after it (the order alone moved the MLP's
ratio by up to 10% either way), and the mean of the two tiered/pinned ratios.
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

    pinned = f"{args.backend} pinned"
    ratios = []
    # Which model is built first moves the result by up to 10% either way on the MLP (where
    # their tensors land): each order is measured once, and the ratio is their mean.
    for first, second in (("tiered", pinned), (pinned, "tiered")):
        made = {"eager": step()}
        for name in (first, second):
            made[name] = step("auto" if name == "tiered" else args.backend)
        made["fx pinned"] = step("fx")
        medians = _measure(made, batches, args.steps)
        print(f"{args.model}, 1 thread, {args.steps} steps per mode, interleaved step by step "
              f"(CPU time), {first} built before {second}:")
        for name, median in medians.items():
            print(f"  {name:22s} {median * 1e3:8.3f} ms  {medians['eager'] / median:5.3f}x eager")
        ratios.append(medians[pinned] / medians["tiered"])
    print(f"tiered / pinned speed: {ratios[0]:.3f} and {ratios[1]:.3f}, "
          f"mean {statistics.fmean(ratios):.3f}")


def _measure(modes: dict, batches: list, steps: int) -> dict:
    """Each mode's median CPU seconds per step, the tiered mode settled first."""
    print(f"tiered: {_settle(modes['tiered'], batches)}")
    for name, fn in modes.items():  # (the pinned modes' first calls: capture, compile)
        for batch in batches:
            fn(*batch)
    times = {name: [] for name in modes}
    names = list(modes)
    for i in range(steps):
        batch = batches[i % len(batches)]
        # the order turns every step: each mode follows each other mode as often
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.thread_time()
            modes[name](*batch)
            times[name].append(time.thread_time() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


if __name__ == "__main__":
    main()
