"""Training steps whose batch size changes every step (issue 14 item 2: dynamic sizes where
the backend supports them): eager, specularch's default (tiered) and each pinned backend,
and torch.compile, side by side in one process.

    python benchmarks/dynamic_batch.py [--models mlp,lenet] [--sizes 8-64] [--warmup 60]
        [--rounds 7] [--steps 40] [--modes auto,fx,torchscript,inductor,torch.compile]
        [--what step|forward|counted]

Models: ``train_step.py``'s MLP (``mlp_dropout``: with dropout, a graph that draws random
numbers), LeNet and LSTM LM (``lstm``: its sequence length drawn from 8-16 each step too, the
Python loop over time rolled; ``rnn_lm``: the same batches for an ``nn.LSTM`` language model,
one module over the whole sequence, so only the graph's input sizes change). The step is ``train_step.py``'s
(Adam, unmodified), optimized whole (``--what step``; ``counted``: the step returns the
batch's summed loss and row count, ``loss.item() * x.size(0), x.size(0)``) or only
its model (``forward``: loss, backward and optimizer step eager around the optimized model,
whose result needs autograd); each step draws its batch size from
``--sizes`` (uniform, one fixed sequence for every mode). ``torch.set_num_threads(1)``.
Inductor and the compile cache start from empty directories. Per mode: the wall time of
the warm-up (the same ``--warmup`` seconds of steps for the tiered mode, which compiles in
the background, and for the others: their first steps compile in the call), then
``--rounds`` rounds in which every mode runs the same ``--steps`` steps in turn; the median
round's µs per step and its ratio to eager's. Then each specularch mode's graphs (the backend
that ran each, and for a graph compiled for every size the calls that ran ``fx``) and
torch.compile's count of compiled graphs.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specularch  # noqa: E402
from train_step import build, make_step  # noqa: E402

def _tokens(n: int, rng: random.Random):
    """The LSTM LM's batch: ``n`` sequences of a length drawn from 8-16 (time-major)."""
    length = rng.randint(8, 16)
    return torch.randint(0, 200, (length, n)), torch.randint(0, 200, (length * n,))


SHAPES = {"mlp": lambda n, rng: (torch.randn(n, 64), torch.randint(0, 10, (n,))),
          "mlp_dropout": lambda n, rng: (torch.randn(n, 64), torch.randint(0, 10, (n,))),
          "lenet": lambda n, rng: (torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))),
          "lstm": _tokens, "rnn_lm": _tokens}


def _batches(model: str, sizes: tuple[int, int], count: int, seed: int) -> list:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    return [SHAPES[model](rng.randint(*sizes), rng) for _ in range(count)]


def _forward_step(model, opt, wrap):
    """The same step with only the model optimized (``wrap(model)``): its loss, backward and
    optimizer step eager around it. The step, and what ``wrap`` returned."""
    forward = wrap(model)
    return make_step(forward, opt), forward


def _modes(model: str, names: list[str], what: str) -> tuple[dict, dict]:
    """The steps to time, by mode, and what each mode optimized (for ``explain()``)."""
    counted = what == "counted"
    modes, optimized = {"eager": make_step(*build(model), counted=counted)}, {}
    for name in names:
        if name == "torch.compile":
            wrap = torch.compile
        else:
            def wrap(fn, backend=name):
                return specularch.optimize(fn, backend=backend)
            name = f"specularch {name}"
        if what in ("step", "counted"):
            modes[name] = wrap(make_step(*build(model), counted=counted))
            optimized[name] = modes[name]
        else:
            modes[name], optimized[name] = _forward_step(*build(model), wrap)
    return modes, optimized


def _warm_up(modes: dict, batches: list, seconds: float) -> dict:
    """Each mode's steps for ``seconds`` (at least every batch once); the wall time each took
    for its first pass over ``batches`` (its compiles), then until the time is spent."""
    first = {}
    for name, step in modes.items():
        start = time.perf_counter()
        for x, y in batches:
            step(x, y)
        first[name] = time.perf_counter() - start
        end = start + seconds
        i = 0
        while time.perf_counter() < end:
            step(*batches[i % len(batches)])
            i += 1
        specularch.tiering.wait(timeout=600)
    return first


def _timed(modes: dict, batches: list, rounds: int) -> dict:
    times = {name: [] for name in modes}
    for _ in range(rounds):
        for name, step in modes.items():
            start = time.perf_counter()
            for x, y in batches:
                step(x, y)
            times[name].append((time.perf_counter() - start) / len(batches))
    return {name: statistics.median(t) for name, t in times.items()}


def _graphs(step) -> str:
    e = specularch.explain(step)
    parts = []
    for g in e.graphs:
        part = g.backend
        if g.sizes:
            part += f" ({g.sizes.rsplit('; ', 1)[-1]})"
        parts.append(part)
    return ", ".join(parts) + f"; {e.stats.recompiles} recompiles"


def _torch_compile_graphs() -> str:
    counters = sys.modules.get("torch._dynamo.utils")
    if counters is None:
        return "-"
    stats = counters.counters["stats"]
    return f"{stats['unique_graphs']} graphs compiled"


def bench(model: str, args) -> None:
    sizes = tuple(int(v) for v in args.sizes.split("-"))
    modes, optimized = _modes(model, args.modes.split(","), args.what)
    warm = _batches(model, sizes, 16, seed=1)
    first = _warm_up(modes, warm, args.warmup)
    timed = _batches(model, sizes, args.steps, seed=2)
    med = _timed(modes, timed, args.rounds)
    what = {"step": "whole step optimized", "forward": "model only optimized",
            "counted": "whole step optimized, returning its summed loss and row count"}
    print(f"[{model}] Adam step ({what[args.what]}), batch size drawn from {sizes[0]}-{sizes[1]} each step, "
          f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"{args.rounds} rounds x {args.steps} steps, median round")
    print("| mode | µs/step | vs eager | first 16 steps | graphs |")
    print("|---|---|---|---|---|")
    for name, step in modes.items():
        graphs = _graphs(optimized[name]) if name.startswith("specularch") else (
            _torch_compile_graphs() if name == "torch.compile" else "-")
        print(f"| {name} | {med[name] * 1e6:.0f} | {med['eager'] / med[name]:.2f}x | "
              f"{first[name]:.2f} s | {graphs} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,lenet")
    parser.add_argument("--sizes", default="8-64", help="batch sizes, LOW-HIGH")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of steps per mode")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", default="auto,fx,torchscript,inductor,torch.compile")
    parser.add_argument("--what", choices=("step", "forward", "counted"), default="step",
                        help="optimize the whole training step, the step returning its summed "
                             "loss and row count (counted), or only the model (forward)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="dynamic-batch-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    try:
        with specularch.config.patch(compile_cache_dir=os.path.join(folder, "specularch")):
            for model in args.models.split(","):
                bench(model, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
