"""The copy tax of optimizer updates (issue 14): whole training steps, eager vs specularch, on
models whose step is dominated by the update's memory traffic.

    python benchmarks/copy_tax.py [--workloads embedding-sgd,mlp-sgd,...] [--rounds 7] [--steps 10]

One process, ``torch.set_num_threads(1)``; eager and specularch interleaved round by round
(identical models and batches), medians of the per-step time per round; prints each
workload's eager ms/step, specularch ms/step and the speedup (eager / specularch). To compare
two versions of specularch, run this script once per version, alternately, and compare the
speedups (each is measured against eager in its own process).
"""
from __future__ import annotations

import argparse
import copy
import statistics
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


def _time(fn, batches) -> float:
    start = time.perf_counter()
    for x, y in batches:
        fn(x, y)
    return (time.perf_counter() - start) / len(batches)


def bench(name: str, rounds: int, steps: int) -> tuple[float, float]:
    model_name, opt_name = name.split("-")
    make_model, make_batch = _MODELS[model_name]
    torch.manual_seed(0)
    model = make_model()
    ref_model = copy.deepcopy(model)
    fast = specularch.optimize(make_step(model, _OPTIMIZERS[opt_name](model.parameters())))
    eager = make_step(ref_model, _OPTIMIZERS[opt_name](ref_model.parameters()))
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(steps)]
    _time(fast, batches[:6])  # profiled calls and the capture
    _time(eager, batches[:6])
    times = {"eager": [], "specularch": []}
    for _ in range(rounds):
        times["eager"].append(_time(eager, batches))
        times["specularch"].append(_time(fast, batches))
    report = specularch.explain(fast)
    assert report.fallbacks == [], str(report)
    return statistics.median(times["eager"]), statistics.median(times["specularch"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="embedding-sgd,embedding-adam,mlp-sgd,mlp-momentum,"
                                               "mlp-adam,lenet-sgd,lenet-adam")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'workload':16} {'eager ms':>9} {'specularch ms':>14} {'speedup':>8}")
    for name in args.workloads.split(","):
        eager, fast = bench(name, args.rounds, args.steps)
        print(f"{name:16} {eager * 1e3:9.3f} {fast * 1e3:14.3f} {eager / fast:7.3f}x", flush=True)


if __name__ == "__main__":
    main()
