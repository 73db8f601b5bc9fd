"""Capture cost against program size (issue 14 item 4): the first captured training step of a
stack of N ``nn.TransformerEncoderLayer(64, 4, 128)`` with Adam, for several N.

    python benchmarks/capture_cost.py [--layers 12,24,48] [--repeat 1] [--profile N]

Per N: capture seconds and the backend's "compile" seconds (from ``explain()``), the whole
first call (wall and this process's CPU seconds: on a loaded machine the CPU time is the
steadier number), the graph's lines of code and its guards; then the ratio of the largest N to the
smallest. Linear cost means the ratio is about the ratio of the sizes (4 for 48/12).
``torch.set_num_threads(1)``, ``profile_calls=0`` (the first call captures), a fresh model and
``specularch.reset()`` per measurement; with ``--repeat`` the medians. ``--profile N`` runs
that size once under cProfile and prints the top functions by own and cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch
from torch import nn

import specularch
from specularch import config

BATCH, SEQ, WIDTH, HEADS, FFN = 8, 16, 64, 4, 128


def make_step(layers: int):
    """A fresh model, optimizer and data: nothing cached from an earlier measurement."""
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, SEQ, WIDTH)
    return square_loss_step(model, opt), x


def square_loss_step(model, opt):
    """The training step ``x -> loss.item()`` with the mean squared output as the loss."""
    def train_step(x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


def measure(layers: int) -> dict:
    """One first captured call of an N-layer step."""
    specularch.reset()
    step, x = make_step(layers)
    optimized = specularch.optimize(step)
    with config.patch(profile_calls=0):
        start, cpu = time.perf_counter(), time.process_time()
        optimized(x)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
    report = specularch.explain(optimized)
    if len(report.graphs) != 1 or report.fallbacks:
        print(report, file=sys.stderr)
        raise SystemExit(f"N={layers}: expected one graph and no fallback")
    graph = report.graphs[0]
    return {"N": layers, "capture": graph.capture_seconds, "compile": graph.compile_seconds,
            "total": total, "cpu": cpu, "lines": len(graph.code.splitlines()), "guards": len(graph.guards)}


def median_row(rows: list[dict]) -> dict:
    return {key: (statistics.median(r[key] for r in rows) if isinstance(rows[0][key], float)
                  else rows[0][key]) for key in rows[0]}


def print_table(rows: list[dict]) -> None:
    print(f"{'N':>4} {'capture s':>10} {'compile s':>10} {'total s':>9} {'cpu s':>7} {'graph lines':>12} "
          f"{'guards':>7}")
    for r in rows:
        print(f"{r['N']:>4} {r['capture']:>10.2f} {r['compile']:>10.2f} {r['total']:>9.2f} {r['cpu']:>7.2f} "
              f"{r['lines']:>12} {r['guards']:>7}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"ratio N={last['N']}/N={first['N']} (sizes x{last['N'] / first['N']:.0f}): "
              f"capture {last['capture'] / first['capture']:.2f}x, "
              f"compile {last['compile'] / first['compile']:.2f}x, "
              f"total {last['total'] / first['total']:.2f}x, cpu {last['cpu'] / first['cpu']:.2f}x")


def profile(layers: int, top: int = 35) -> None:
    specularch.reset()
    step, x = make_step(layers)
    optimized = specularch.optimize(step)
    profiler = cProfile.Profile()
    with config.patch(profile_calls=0):
        profiler.enable()
        optimized(x)
        profiler.disable()
    stats = pstats.Stats(profiler)
    for order in ("tottime", "cumulative"):
        print(f"--- N={layers}, by {order} ---")
        stats.sort_stats(order).print_stats(top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24,48")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.profile:
        profile(args.profile)
        return
    sizes = [int(n) for n in args.layers.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    measure(1)  # imports and first-use set-up, which would otherwise count for the first size
    for round_ in range(args.repeat):
        for n in sizes:  # sizes interleaved per round: a load change hits every size alike
            row = measure(n)
            runs[n].append(row)
            print(f"round {round_ + 1}/{args.repeat} N={n}: total {row['total']:.2f} s "
                  f"(capture {row['capture']:.2f}, compile {row['compile']:.2f})", flush=True)
    print_table([median_row(runs[n]) for n in sizes])


if __name__ == "__main__":
    main()
