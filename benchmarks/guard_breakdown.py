"""Where a cached call's check goes (issue 14 item 5): one line of the breakdown per kind of
generated guard line, timed inside real cached calls of the training step of
``guard_cost.py`` (an Adam step of an N-layer MLP or Transformer stack, ``backend="fx"``).

    python benchmarks/guard_breakdown.py [--model mlp] [--layers 1] [--calls 300] [--top 25]

The entry function of the steady-state graph is rebuilt with a ``perf_counter()`` read after
each line of its check (``instrumented``); the graph and the commit run as usual, so the
caches are as cold as in a real step. Lines are grouped by kind (the line with its variable
and constant names blanked: ``s = s._parameters['x']``); per kind: the sum over its lines of
each line's median µs, and how many lines it has. "dispatch" is the time from calling the
optimized step until its entry function starts. Each timestamp costs ~0.05 µs, so the sum
of the lines is above ``guard_cost.py``'s overhead by about that much per line.
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import torch

import specularch
from specularch import config
from specularch.guards.slots import compact_locals

from guard_cost import _entry_namespace, make_step  # this folder's guard-cost benchmark

_GUARD_START = "    try:"
_GUARD_END = "    except Exception:"


def instrumented(source: str) -> tuple[str, list[str]]:
    """``source`` (an entry function's text) with ``_T.append(_PC())`` after the start of its
    check and after each of the check's lines; and the line each timestamp follows."""
    out, labels, inside = [], [], False
    for line in source.splitlines():
        if not labels and line == _GUARD_START:
            out += [line, "        _T.append(_PC())"]
            labels.append("<entry start>")
            inside = True
            continue
        if line.startswith(_GUARD_END):
            inside = False
        out.append(line)
        if inside:
            out.append("        _T.append(_PC())")
            labels.append(line.strip())
    return "\n".join(out) + "\n", labels


def kind(line: str) -> str:
    """A guard line with its names blanked: lines of one kind differ only in those."""
    if re.match(r"if not TG\d+\(", line):
        return "C++ tensor check (TensorGuards)"
    line = re.sub(r"\(\(s\d+.*", "((written...), (others...))", line)
    line = re.sub(r"'[^']*'", "'x'", line)
    line = re.sub(r"\b([sK])\d+\b", r"\1", line)
    return re.sub(r"\bs\[\d+\]", "s[i]", line)


class Breakdown:
    """Per-line durations of ``calls`` cached calls of ``optimized(x)``."""

    def __init__(self, optimized, x, calls: int) -> None:
        from specularch.api import _state_of  # the benchmark looks inside the cache
        entry = _state_of(optimized).entries[0]
        ns = _entry_namespace(entry.fn)
        text, self.labels = instrumented(entry.entry_source)
        stamps: list[float] = []
        code: dict = {}
        exec(compile(text, "<instrumented entry>", "exec"), {}, code)
        fn, original = ns["entry"], ns["entry"].__code__
        # The wrappers around the entry (commit lock, tiering) hold the function: swap its code.
        ns.update(_T=stamps, _PC=time.perf_counter)
        fn.__code__ = compact_locals(code["entry"].__code__)  # as the entry itself is
        self.dispatch, self.lines = [], collections.defaultdict(list)
        try:
            for _ in range(calls):
                stamps.clear()
                start = time.perf_counter()
                self.result = optimized(x)
                self.dispatch.append((stamps[0] - start) * 1e6)
                for i in range(1, len(stamps)):
                    self.lines[i].append((stamps[i] - stamps[i - 1]) * 1e6)
        finally:
            fn.__code__ = original
            del ns["_T"], ns["_PC"]

    def by_kind(self) -> list[tuple[str, float, int]]:
        """``(kind, µs, lines)``, the costliest first."""
        total, count = collections.Counter(), collections.Counter()
        for i, samples in self.lines.items():
            k = kind(self.labels[i])
            total[k] += statistics.median(samples)
            count[k] += 1
        return [(k, us, count[k]) for k, us in total.most_common()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    specularch.reset()
    step, x = make_step(args.model, args.layers)
    optimized = specularch.optimize(step, backend="fx")
    with config.patch(profile_calls=0):
        for _ in range(2):  # Adam's first step (no state yet) is a graph of its own
            optimized(x)
    b = Breakdown(optimized, x, args.calls)
    rows = b.by_kind()
    print(f"{args.model} N={args.layers}: {len(b.labels) - 1} check lines; dispatch "
          f"{statistics.median(b.dispatch):.1f} µs; lines {sum(us for _, us, _ in rows):.1f} µs")
    print("| µs | lines | kind |\n|---|---|---|")
    for k, us, n in rows[:args.top]:
        print(f"| {us:.2f} | {n} | `{k[:110]}` |")


if __name__ == "__main__":
    main()
