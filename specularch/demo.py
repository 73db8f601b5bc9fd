"""``python -m specularch.demo``: optimize ordinary PyTorch code and show what happened.

Runs a small transformer-style block (with a Python flag and a ModuleList loop) and an
LSTMCell loop under ``specularch.optimize``, checks every result against eager, prints
``specularch.explain`` reports (graph code, guards, a recompile, a fallback with its
reason, and the ``torch.where`` graph a tensor branch becomes once it has gone both ways),
and times a TreeLSTM training step on a new random tree every step, eager vs specularch
(median, 1 thread): the recursion is captured once, whatever the tree.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

import specularch


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.ModuleList([nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)])

    def forward(self, x, causal: bool = True):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
        if causal:
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
            att = att.masked_fill(mask, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        h = x
        for i, layer in enumerate(self.mlp):
            h = layer(h)
            if i == 0:
                h = F.gelu(h)
        return x + h


def lstm_loop(cell: nn.LSTMCell, xs: torch.Tensor):
    h = torch.zeros(xs.shape[1], cell.hidden_size)
    c = torch.zeros_like(h)
    outs = []
    for t in range(xs.shape[0]):
        h, c = cell(xs[t], (h, c))
        outs.append(h)
    return torch.stack(outs), (h, c)


def noisy(x):
    if x.sum() > 0:          # a branch on a tensor's value: speculated, checked after the graph
        return x * 2
    return -x


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = Block(32, 4).eval()
    reference = Block(32, 4).eval()
    reference.load_state_dict(block.state_dict())
    specularch.optimize(block)
    x = torch.randn(2, 8, 32)
    with torch.no_grad():  # 3 profiled eager calls, then graphs (a Python flag flips once)
        same = all(torch.allclose(block(x, c), reference(x, c))
                   for c in (True, True, True, True, False, True, False))
    print(f"transformer block: results equal eager: {same}")
    print(specularch.explain(block, verbose=True))  # with its guards and graph code

    cell = nn.LSTMCell(16, 24)
    fast_loop = specularch.optimize(lstm_loop)
    xs = torch.randn(5, 3, 16)
    with torch.no_grad():
        ok = all(torch.allclose(fast_loop(cell, xs)[0], lstm_loop(cell, xs)[0]) for _ in range(5))
    print(f"\nLSTMCell loop over time: results equal eager: {ok}; "
          f"graphs={len(specularch.explain(fast_loop).graphs)}")

    fast_noisy = specularch.optimize(noisy)
    signs = [1, 1, 1, 1, 1, -1, 1, -1]  # speculated "positive"; the 6th call goes the other way
    ok = all(torch.equal(fast_noisy(torch.ones(4) * s), noisy(torch.ones(4) * s)) for s in signs)
    print(f"\nbranch on a tensor value, speculated: equal eager on every call: {ok}")
    report = specularch.explain(fast_noisy)
    for record in report.fallbacks:
        print(f"  fallback {record}")
    merged = [g for g in report.graphs if "torch.where" in g.code]
    if merged:  # the branch went both ways: its two sides are now one graph
        print("  the next call captured both sides, selected with torch.where; calls either "
              "way are graph hits now:")
        print("\n".join(f"    {line}" for line in merged[0].code.splitlines()))

    _new_tree_every_step()


def _new_tree_every_step(steps: int = 40, after: int = 5) -> None:
    """The product's point, timed: a TreeLSTM training step (``specularch.workloads``) on a
    random tree no earlier step had, eager and specularch interleaved step by step on the
    same trees (``python -m specularch.bench``'s never-seen regime, shortened)."""
    from .bench import never_seen
    from .workloads import tree_lstm
    eager, spec = never_seen.build_modes(tree_lstm, never_seen.PRESET, "cpu", ["auto"], False)
    batches = never_seen.make_batches(tree_lstm, never_seen.PRESET, steps, "cpu")
    never_seen.run_interleaved("tree_lstm", [eager, spec], batches, "cpu", budget_s=120.0,
                               log=lambda line: None, progress_every=steps + 1)
    eager_ms, spec_ms = (statistics.median(m.times[after:]) * 1e3 for m in (eager, spec))
    _, close = never_seen.param_difference(spec.model, eager.model)
    print(f"\nTreeLSTM training step on a new random tree every step (1 thread, {steps} steps, "
          f"median after the first {after}): eager {eager_ms:.1f} ms, specularch "
          f"{spec_ms:.1f} ms, {eager_ms / spec_ms:.2f}x; {spec.graphs_made()} graph(s) for "
          f"{steps} trees; parameters equal eager's within rtol 1e-4: {close}")


if __name__ == "__main__":
    main()
