"""A recurrence over a tensor's rows (``for x_t in x``) whose sequence length changes every
step: an LSTM-cell reader's whole training step (SGD), eager and specularch's default side by
side in one process, interleaved step by step; 1 thread, 160 steps with lengths drawn from
5-39 (one fixed sequence), medians after the first 40. Before the loop rolled
(``symbolic/rolled/rows.py``) it was one graph per length, then ``cache_limit``: eager.

    python benchmarks/rows_loop.py
"""
import statistics
import time

import torch
from torch import nn

import specularch

STEPS, SKIP = 160, 40


class Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(32, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        h = c = torch.zeros(x.size(1), 64)
        outs = []
        for x_t in x:
            h, c = self.cell(x_t, (h, c))
            outs.append(h)
        return self.out(torch.stack(outs)).mean()


def make_step():
    torch.manual_seed(0)
    model = Reader()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x):
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
        return loss
    return step


def main() -> None:
    torch.set_num_threads(1)
    eager, fast = make_step(), specularch.optimize(make_step())
    data = torch.Generator().manual_seed(1)
    lengths = [int(torch.randint(5, 40, (1,), generator=data)) for _ in range(STEPS)]
    batches = [torch.randn(n, 16, 32, generator=data) for n in lengths]
    times: dict = {"eager": [], "specularch": []}
    for x in batches:
        for name, step in (("eager", eager), ("specularch", fast)):
            start = time.perf_counter()
            step(x)
            times[name].append(time.perf_counter() - start)
    e, s = (statistics.median(times[k][SKIP:]) for k in ("eager", "specularch"))
    report = specularch.explain(fast)
    print(f"1 thread, {STEPS} steps, lengths 5-39: eager {e * 1e3:.2f} ms, specularch "
          f"{s * 1e3:.2f} ms, {e / s:.2f}x; {len(report.graphs)} graph(s), fallbacks "
          f"{[f.kind for f in report.fallbacks]}")


if __name__ == "__main__":
    main()
