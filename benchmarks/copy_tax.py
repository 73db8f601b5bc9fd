"""The copy tax of optimizer updates (issue 14): whole training steps, eager vs specularch, on
models whose step is dominated by the update's memory traffic.

    python benchmarks/copy_tax.py [--workloads big-adam,mlp-sgd,...] [--rounds 7] [--steps 10]
                                  [--cpu-time]

Workloads are ``model-optimizer``: models ``embedding``, ``mlp`` (4 x 1024, batch 16),
``big`` (8 x Linear(1024), batch 256: issue 14's) and ``lenet``; optimizers ``sgd``,
``momentum``, ``adam``, ``adamw``. One process, ``torch.set_num_threads(1)``; eager and
specularch interleaved step by step (identical models and batches); prints each workload's
median eager and specularch ms/step and the median of the per-step speedups (eager /
specularch) with their quartiles. ``--cpu-time`` times steps by CPU time, which leaves out
the time a loaded machine keeps the process waiting. ``--separate`` runs each side in its own
process instead, alternately: in one process the two share the allocator, and on large
models one side's memory peak changes how often the other's fresh allocations fault pages in. To compare two versions of specularch,
run this script once per version, alternately, and compare the speedups (each is measured
against eager in its own process).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

import specularch
from train_step import LeNet, make_step  # (this script's folder is on sys.path)


class EmbeddingBag(nn.Module):
    """A 5000 x 300 embedding (a TreeRNN's vocabulary) read a few rows per step: the dense
    gradient and the update touch the whole table."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(5000, 300), nn.Linear(300, 5)

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx).mean(1)))


def _mlp():
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def _big_mlp():
    """8 x Linear(1024) (8.4M parameters; issue 14 item 6, distributed_overlap.py's model):
    the update's memory traffic is most of the step."""
    layers = []
    for _ in range(7):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}
_MODELS = {  # name -> (model, batch maker)
    "embedding": (EmbeddingBag, lambda g: (torch.randint(0, 5000, (16, 8), generator=g),
                                           torch.randint(0, 5, (16,), generator=g))),
    "mlp": (_mlp, lambda g: (torch.randn(16, 1024, generator=g), torch.randint(0, 10, (16,), generator=g))),
    "big": (_big_mlp, lambda g: (torch.randn(256, 1024, generator=g),
                                 torch.randint(0, 10, (256,), generator=g))),
    "lenet": (LeNet, lambda g: (torch.randn(50, 1, 28, 28, generator=g),
                                torch.randint(0, 10, (50,), generator=g))),
}


def _step_times(fast, eager, batches, clock) -> tuple[list, list]:
    """Each batch's step, eager then specularch, alternately: both see the same load."""
    times = [], []
    for x, y in batches:
        for fn, into in ((eager, times[0]), (fast, times[1])):
            start = clock()
            fn(x, y)
            into.append(clock() - start)
    return times


def bench(name: str, rounds: int, steps: int, clock=time.perf_counter) -> dict:
    """Medians of the per-step times and of the per-pair speedups (eager / specularch),
    with the speedups' quartiles."""
    model, opt, batches = _setup(name, steps)
    ref_model = copy.deepcopy(model)
    fast = specularch.optimize(make_step(model, opt))
    eager = make_step(ref_model, _OPTIMIZERS[name.split("-")[1]](ref_model.parameters()))
    _step_times(fast, eager, batches[:6], clock)  # profiled calls and the capture
    eager_t, fast_t = [], []
    for _ in range(rounds):
        e, f = _step_times(fast, eager, batches, clock)
        eager_t += e
        fast_t += f
    report = specularch.explain(fast)
    assert report.fallbacks == [], str(report)
    ratios = sorted(e / f for e, f in zip(eager_t, fast_t))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return dict(eager=statistics.median(eager_t), fast=statistics.median(fast_t),
                speedup=statistics.median(ratios), q1=q[0], q3=q[-1])


def _setup(name: str, steps: int):
    model_name, opt_name = name.split("-")
    make_model, make_batch = _MODELS[model_name]
    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(0)
    return model, _OPTIMIZERS[opt_name](model.parameters()), [make_batch(g) for _ in range(steps)]


def alone(name: str, side: str, rounds: int, steps: int, clock) -> float:
    """Median seconds per step of one side, alone in this process."""
    model, opt, batches = _setup(name, steps)
    step = make_step(model, opt)
    if side == "specularch":
        step = specularch.optimize(step)
    for x, y in batches[:6]:  # profiled calls and the capture
        step(x, y)
    times = []
    for _ in range(rounds):
        for x, y in batches:
            start = clock()
            step(x, y)
            times.append(clock() - start)
    return statistics.median(times)


def separate(name: str, rounds: int, steps: int, cpu_time: bool) -> dict:
    """Eager and specularch each in its own process, the processes alternating ``rounds``
    times: neither side's memory use changes what the allocator gives the other (in one
    process, the allocator's state is shared)."""
    times = {"eager": [], "specularch": []}
    for _ in range(rounds):
        for side in times:
            cmd = [sys.executable, __file__, "--alone", side, "--workloads", name, "--rounds", "1",
                   "--steps", str(steps)] + ["--cpu-time"] * cpu_time
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
            times[side].append(float(done.stdout.split()[-1]))
    ratios = sorted(e / f for e, f in zip(times["eager"], times["specularch"]))
    return dict(eager=statistics.median(times["eager"]), fast=statistics.median(times["specularch"]),
                speedup=statistics.median(ratios), q1=ratios[0], q3=ratios[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="embedding-sgd,embedding-adam,mlp-sgd,mlp-momentum,"
                                               "mlp-adam,lenet-sgd,lenet-adam")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each step by the process's CPU time, not the wall clock (on "
                             "a machine shared with other work: time spent descheduled is left out)")
    parser.add_argument("--separate", action="store_true",
                        help="each side in its own process, alternately (--rounds processes "
                             "each); the range printed is the lowest and highest speedup")
    parser.add_argument("--alone", choices=["eager", "specularch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.alone:
        print(alone(args.workloads, args.alone, args.rounds, args.steps, clock))
        return
    print(f"{'workload':16} {'eager ms':>9} {'specularch ms':>14} {'speedup':>8}  (range)")
    for name in args.workloads.split(","):
        r = separate(name, args.rounds, args.steps, args.cpu_time) if args.separate else \
            bench(name, args.rounds, args.steps, clock)
        print(f"{name:16} {r['eager'] * 1e3:9.3f} {r['fast'] * 1e3:14.3f} {r['speedup']:7.3f}x"
              f"  ({r['q1']:.3f}-{r['q3']:.3f})", flush=True)


if __name__ == "__main__":
    main()
