"""Guard cost against program size (issue 14 item 5): a training step of an N-layer MLP or a
stack of N ``nn.TransformerEncoderLayer(64, 4, 128)`` with Adam, for several N.

    python benchmarks/guard_cost.py [--layers 1,12,48] [--calls 300]

Per model and N: the step's guards and checked tensors, the guard check's µs per call (as
``explain()`` reports it: timed at compile time on the capturing call), and the cached-call
overhead: the µs from calling the optimized step until its graph starts (dispatch, guards,
reads of the graph's inputs; the graph and the commit excluded), median over ``--calls``
cached calls, then per graph input (parameters, their gradients and optimizer state: the
tensors the guards check), and how the overhead grows per extra input from the smallest to
the largest N. ``torch.set_num_threads(1)``. The step runs with ``backend="fx"``: the default
tiers a hot graph onto a compiled backend in the background, which would change what is
timed (the check before the graph is the same on every tier).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import specularch
from specularch import config

from capture_cost import square_loss_step  # this folder's capture-cost benchmark

BATCH, SEQ, WIDTH, HEADS, FFN = 8, 16, 64, 4, 128


def mlp(layers: int) -> tuple[nn.Module, torch.Tensor]:
    blocks = [m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 10)), torch.randn(32, WIDTH)


def transformer(layers: int) -> tuple[nn.Module, torch.Tensor]:
    block = nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(block, layers, enable_nested_tensor=False), torch.randn(BATCH, SEQ, WIDTH)


MODELS = {"mlp": mlp, "transformer": transformer}


def make_step(kind: str, layers: int):
    torch.manual_seed(0)
    model, x = MODELS[kind](layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return square_loss_step(model, opt), x


def _entry_namespace(fn):
    """The globals of the generated entry function inside ``fn`` (wrappers, e.g. the commit
    lock, hold it in their closure)."""
    if "GRAPH" in getattr(fn, "__globals__", {}):
        return fn.__globals__
    if callable(getattr(fn, "fn", None)):  # a tiered graph (tiering/trial.py): its current tier
        return _entry_namespace(fn.fn)
    for cell in fn.__closure__ or ():
        if callable(cell.cell_contents):
            found = _entry_namespace(cell.cell_contents)
            if found is not None:
                return found
    return None


def overhead_us(optimized, x, calls: int) -> float:
    """Median µs from the call until the graph starts, over ``calls`` cached calls of the
    newest graph (the steady-state step)."""
    from specularch.api import _state_of  # the benchmark looks inside the cache
    entry = _state_of(optimized).entries[0]
    ns = _entry_namespace(entry.fn)
    graph, started = ns["GRAPH"], []

    def timed_graph(*args):
        started.append(time.perf_counter())
        return graph(*args)

    ns["GRAPH"] = timed_graph
    samples = []
    try:
        for _ in range(calls):
            start = time.perf_counter()
            optimized(x)
            samples.append((started[-1] - start) * 1e6)
    finally:
        ns["GRAPH"] = graph
    return statistics.median(samples)


def measure(kind: str, layers: int, calls: int) -> dict:
    specularch.reset()
    step, x = make_step(kind, layers)
    optimized = specularch.optimize(step, backend="fx")  # no background compile: guards only
    with config.patch(profile_calls=0):
        for _ in range(2):  # Adam's first step (no state yet) is a graph of its own
            optimized(x)
    report = specularch.explain(optimized)
    if len(report.graphs) != 2 or report.fallbacks:
        raise SystemExit(f"{kind} N={layers}: expected two graphs and no fallback:\n{report}")
    graph = report.graphs[-1]  # the newest: the steady-state step
    row = {"model": kind, "N": layers, "guards": len(graph.guards), "inputs": len(graph.inputs),
           "guard_us": getattr(graph, "guard_us", None), "overhead_us": overhead_us(optimized, x, calls)}
    row["per_input_us"] = row["overhead_us"] / max(row["inputs"], 1)
    return row


def print_table(rows: list[dict]) -> None:
    print("| model | N | guards | graph inputs | guard µs (explain) | cached-call overhead µs | µs per input |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        guard = "-" if r["guard_us"] is None else f"{r['guard_us']:.1f}"
        print(f"| {r['model']} | {r['N']} | {r['guards']} | {r['inputs']} | {guard} | "
              f"{r['overhead_us']:.1f} | {r['per_input_us']:.3f} |")
    for kind in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == kind]
        if len(mine) > 1:
            a, b = mine[0], mine[-1]
            slope = (b["overhead_us"] - a["overhead_us"]) / max(b["inputs"] - a["inputs"], 1)
            print(f"{kind}: overhead grows {slope:.3f} µs per extra graph input "
                  f"(N={a['N']} -> N={b['N']})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,12,48")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(kind, int(n), args.calls) for kind in args.models.split(",")
            for n in args.layers.split(",")]
    print_table(rows)


if __name__ == "__main__":
    main()
