"""How much a thread running Python slows the program's thread, by switch interval (issue 14's
"no step waits on a compile"; docs/tiering.md, "What the slowest steps while compiling are").

    python benchmarks/gil_handover.py [--intervals 0.005,0.0005,0.0001,0.00002,0.000002]

One torch thread. A "step" is 30 small torch ops (a 32x64 @ 64x64 matmul and a ReLU), each of
which releases the GIL while it runs. Per interval (a fresh process each, interleaving
nothing else): the median step alone, then steps while a second thread runs pure Python for
0.6 s; prints the steps that overlapped it over the median (median, p90, slowest) and how much
Python the other thread got done.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time


def _steps(seconds, y, w):
    import torch
    rows, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(30):
            torch.relu(y @ w)
        rows.append((start, time.perf_counter() - start))
    return rows


def one(interval: float) -> str:
    import torch
    torch.set_num_threads(1)
    y, w = torch.randn(32, 64), torch.randn(64, 64)
    window, done = [], [0]

    def python_beside():
        time.sleep(0.2)
        window.append(time.perf_counter())
        while time.perf_counter() - window[0] < 0.6:
            sum(i * i for i in range(200))
            done[0] += 1
        window.append(time.perf_counter())

    sys.setswitchinterval(interval)
    alone = sorted(s for _, s in _steps(0.3, y, w))
    median = alone[len(alone) // 2]
    other = threading.Thread(target=python_beside)
    other.start()
    rows = _steps(1.0, y, w)
    other.join()
    beside = sorted(s for t, s in rows if window[0] <= t <= window[1])
    return (f"interval {interval * 1e6:7.1f} µs: step alone {median * 1e3:.3f} ms; {len(beside)} steps "
            f"beside Python: median {beside[len(beside) // 2] / median:.1f}x, p90 "
            f"{beside[int(len(beside) * 0.9)] / median:.1f}x, slowest {beside[-1] / median:.1f}x; "
            f"the other thread's loops {done[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", default="0.005,0.0005,0.0001,0.00002,0.000002")
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(one(args.one), flush=True)
        return
    for interval in args.intervals.split(","):
        subprocess.run([sys.executable, __file__, "--one", interval], check=True)


if __name__ == "__main__":
    main()
