"""Whole training steps per second: eager vs specularch (fx, torchscript, inductor) vs
torch.compile vs torch.jit.script, for a small MLP, a LeNet-size CNN and an LSTM language model
with a Python loop over time.

    python benchmarks/train_step.py [--quick] [--models mlp,lenet,lstm]
        [--backends fx,torchscript,inductor] [--no-inductor] [--warm-cache] [--json PATH]

The step is the unmodified `zero_grad(); loss = loss_fn(model(x), y); loss.backward();
opt.step(); return loss.item()` with Adam. One process, modes interleaved round by round,
``torch.set_num_threads(1)``; medians over rounds, ratios to eager, the first captured /
compiled step's time (after specularch's profiled calls; Inductor compiles into a fresh cache
directory unless ``--warm-cache``), and for specularch the backend that actually ran each
graph: a backend that refuses a graph leaves it to ``fx`` and its note says why.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import specularch


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class LSTMLM(nn.Module):
    """Embedding, an LSTMCell run by a Python loop over time, a decoder."""

    def __init__(self, vocab=200, hidden=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.LSTMCell(hidden, hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        h = torch.zeros(tokens.shape[1], self.cell.hidden_size)
        c = torch.zeros_like(h)
        outputs = []
        for t in range(tokens.shape[0]):
            h, c = self.cell(self.embed(tokens[t]), (h, c))
            outputs.append(self.decoder(h))
        return torch.stack(outputs).flatten(0, 1)


def _mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def _mlp_dropout():
    """The MLP with dropout after each hidden layer: a graph that draws random numbers."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128),
                         nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))


class SmallTransformer(nn.Module):
    """Two ``nn.TransformerEncoderLayer(64, 4, 128)`` over a sequence, mean-pooled, a
    classifier: a forward graph with 3-d linears (their results ``_unsafe_view`` aliases)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class RecurrentLM(nn.Module):
    """An ``nn.LSTM`` language model (time-major tokens, vocabulary 200): one module runs the
    whole sequence, so a varying length changes only the graph's input sizes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(200, 64)
        self.rnn = nn.LSTM(64, 128)
        self.decoder = nn.Linear(128, 200)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.decoder(out).flatten(0, 1)


MODELS = {  # name -> (builder, make a batch (x, y))
    "mlp": (_mlp, lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,)))),
    "mlp_dropout": (_mlp_dropout, lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,)))),
    "lenet": (LeNet, lambda: (torch.randn(50, 1, 28, 28), torch.randint(0, 10, (50,)))),
    "lstm": (LSTMLM, lambda: (torch.randint(0, 200, (12, 16)), torch.randint(0, 200, (12 * 16,)))),
    "rnn_lm": (RecurrentLM, lambda: (torch.randint(0, 200, (12, 16)), torch.randint(0, 200, (12 * 16,)))),
    "transformer": (SmallTransformer, lambda: (torch.randn(16, 32, 64), torch.randint(0, 10, (16,)))),
}


def build(name: str):
    torch.manual_seed(0)
    model = MODELS[name][0]()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def make_step(model, opt, counted: bool = False):
    """The training step ``(x, y) -> loss.item()``; ``counted``: it returns the batch's summed
    loss and its row count instead (``loss.item() * x.size(0), x.size(0)``, the running loss
    of PyTorch's tutorials)."""
    loss_fn = nn.CrossEntropyLoss()

    def train_step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if counted:
            return loss.item() * x.size(0), x.size(0)
        return loss.item()
    return train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-inductor", action="store_true",
                        help="skip Inductor (specularch inductor and torch.compile)")
    parser.add_argument("--backends", default="fx,torchscript,inductor",
                        help="specularch backends, comma-separated")
    parser.add_argument("--models", default="mlp,lenet,lstm")
    parser.add_argument("--warm-cache", action="store_true",
                        help="let Inductor use its usual on-disk cache (first step not cold)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cold_cache = None
    if not args.warm_cache:  # read lazily by Inductor, so setting it here is early enough
        cold_cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    try:
        results = []
        for name in args.models.split(","):
            results.append(bench(name, args))
            print()
    finally:
        if cold_cache:
            shutil.rmtree(cold_cache, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _scripted(name):
    model, opt = build(name)
    try:
        return make_step(torch.jit.script(model), opt)
    except Exception as e:
        print(f"torch.jit.script({name}) failed: {type(e).__name__}: {str(e).splitlines()[0]}",
              file=sys.stderr)
        return None


def bench(model_name: str, args) -> dict:
    rounds, steps = (3, 10) if args.quick else (5, 30)
    x, y = MODELS[model_name][1]()
    backends = [b for b in args.backends.split(",") if b and not (args.no_inductor and b == "inductor")]
    modes = {"eager": make_step(*build(model_name))}
    for backend in backends:
        modes[f"specularch {backend}"] = specularch.optimize(make_step(*build(model_name)),
                                                             backend=backend)
    scripted = _scripted(model_name)
    if scripted is not None:
        modes["torch.jit.script"] = scripted
    if not args.no_inductor:
        modes["torch.compile"] = torch.compile(make_step(*build(model_name)))
    first = {}
    for name, fn in modes.items():
        for _ in range(specularch.config.profile_calls if name.startswith("specularch") else 0):
            fn(x, y)
        start = time.perf_counter()
        try:
            fn(x, y)
        except Exception as e:  # e.g. no C++ toolchain for inductor
            print(f"{name} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        first[name] = time.perf_counter() - start
    modes = {k: v for k, v in modes.items() if k in first}
    for fn in modes.values():
        for _ in range(10):
            fn(x, y)
    times = {name: [] for name in modes}
    for _ in range(rounds):
        for name, fn in modes.items():
            start = time.perf_counter()
            for _ in range(steps):
                fn(x, y)
            times[name].append((time.perf_counter() - start) / steps)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"[{model_name}] Adam training step, batch {x.shape[0] if model_name != 'lstm' else x.shape[1]}, "
          f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"{rounds} rounds x {steps} steps, medians")
    print("| mode | steps/s | vs eager | first step | ran with |")
    print("|---|---|---|---|---|")
    result = {"model": model_name, "rounds": rounds, "steps": steps, "modes": {}}
    notes = []
    for name in modes:
        entry = {"steps_per_s": 1 / med[name], "vs_eager": med["eager"] / med[name],
                 "first_step_s": first[name]}
        if name.startswith("specularch"):
            e = specularch.explain(modes[name])
            entry.update(graphs=len(e.graphs), recompiles=e.stats.recompiles,
                         fallbacks=len(e.fallbacks),
                         backends=dict(collections.Counter(g.backend for g in e.graphs)),
                         notes=list(dict.fromkeys(g.note for g in e.graphs if g.note)))
            notes += [f"* {name}: {note}" for note in entry["notes"]]
        result["modes"][name] = entry
        ran = ", ".join(f"{b} x{n}" for b, n in entry.get("backends", {}).items()) or "-"
        print(f"| {name} | {entry['steps_per_s']:.0f} | {entry['vs_eager']:.2f}x | "
              f"{first[name] * 1e3:.0f} ms | {ran} |")
    for line in notes:
        print(line)
    return result


if __name__ == "__main__":
    main()
