"""Gradient all-reduce overlap, 2 processes with gloo on this machine, side by side:

* specularch: the captured step with the bucketed all-reduce launched from parameter hooks
  during backward (``specularch/distributed/allreduce.py``);
* DDP: ``torch.nn.parallel.DistributedDataParallel`` (its own bucketed, overlapped reducer);
* no overlap: backward, then one synchronous all-reduce per gradient, then the update.

    python benchmarks/distributed_overlap.py [--steps N] [--width W] [--depth D] [--bucket-mb M]

Reports the median step time per mode and the exposed communication time: the step time
minus the time of the same step without communication, i.e. the communication the step had
to wait for. The step without communication is eager PyTorch for DDP and the no-overlap mode,
and specularch's own local step for specularch (its graph updates parameters through copies,
which costs time of its own; captured as if single-process). All modes are interleaved step
by step in the same processes, so they share the machine's contention. 1 thread per process. The default model (an MLP of 8 layers 1024 wide, 28 MiB of gradients,
batch 256 per rank) spans several buckets of ``--bucket-mb`` (both specularch's
``config.distributed_bucket_mb`` and DDP's ``bucket_cap_mb``; specularch closes its first
bucket at 1 MiB), so the first buckets travel while backward computes the rest.
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import specularch
from specularch.distributed.allreduce import plan_buckets


def model(width: int, depth: int):
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(depth - 1)
                           for layer in (nn.Linear(width, width), nn.ReLU())],
                         nn.Linear(width, 10))


def plain_step(m, average: bool = False):
    opt = torch.optim.SGD(m.parameters(), 0.01)

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        if average:
            for p in m.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        opt.step()
        return loss.item()
    return step


def measure(modes: dict, x, y, steps: int, barrier) -> dict:
    """Median seconds per step of each mode, modes interleaved step by step."""
    times = {name: [] for name in modes}
    for step in modes.values():
        for _ in range(5):
            step(x, y)
    for _ in range(steps):
        for name, step in modes.items():
            barrier()
            start = time.perf_counter()
            step(x, y)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in times.items()}


def local_specularch_step(m, x, y):
    """The same step run by specularch as in a single process (no collectives in its graph):
    the overlapped step's baseline. Every call runs while specularch is told that
    distributed mode is off (a benchmark-only switch): told so only while capturing, the
    graph's guards failed on the next call and it was captured again as the distributed
    step, so this row measured the overlapped step and its exposed communication read 0.
    Pinned to ``fx``, as distributed steps run (by default this graph would get hot inside the
    timed steps and its candidates compile in a worker process beside the two ranks)."""
    step = specularch.optimize(plain_step(m), backend="fx")

    def local(x, y):
        active = specularch.distributed.active
        specularch.distributed.active = lambda: False
        try:
            return step(x, y)
        finally:
            specularch.distributed.active = active
    with specularch.config.patch(profile_calls=0):
        local(x, y)
    return local, step


def _check_local(step) -> None:
    """After the timed steps: graphs without collectives ran every call (two: the first
    call's, with every ``.grad`` None, and the later calls')."""
    e = specularch.explain(step)
    assert e.graphs and not any("grad_and_allreduce" in g.code for g in e.graphs), str(e)
    assert e.stats.fallback_calls == 0, str(e)


def worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    specularch.config.distributed_bucket_mb = args.bucket_mb
    build = lambda: model(args.width, args.depth)  # noqa: E731
    ddp = nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=args.bucket_mb)
    spec_model = build()
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    local, local_step = local_specularch_step(build(), x, y)
    med = measure({
        "local eager step": plain_step(build()),
        "local specularch step": local,
        "specularch (overlapped)": specularch.optimize(plain_step(spec_model)),
        "DDP": plain_step(ddp),
        "all-reduce after backward": plain_step(build(), average=True),
    }, x, y, args.steps, dist.barrier)
    _check_local(local_step)
    if rank == 0:
        params = list(spec_model.parameters())
        queue.put((med, len(plan_buckets(params, int(args.bucket_mb * 2**20))),
                   sum(p.numel() * p.element_size() for p in params) / 2**20))
    del ddp  # DDP holds the process group: free it so destroy ends gloo's threads
    specularch.reset()  # and so do specularch's cached graphs of the distributed step
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].rstrip(":") + ".",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--width", type=int, default=1024, help="features per Linear layer")
    parser.add_argument("--depth", type=int, default=8, help="Linear layers")
    parser.add_argument("--batch", type=int, default=256, help="examples per rank")
    parser.add_argument("--bucket-mb", type=float, default=8.0,
                        help="gradient bucket size in MiB (specularch and DDP)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(2, port, args, queue), nprocs=2, start_method="spawn")
    med, buckets, megabytes = queue.get()
    print(f"MLP {args.depth}x{args.width} ({megabytes:.0f} MiB of gradients, {buckets} buckets "
          f"of <= {args.bucket_mb:g} MiB, first <= 1 MiB), batch {args.batch} per rank, "
          f"2 processes (gloo, CPU), 1 thread each, {args.steps} steps, medians of one run")
    print(f"{'mode':28s} {'step ms':>8s} {'exposed comm ms':>16s}")
    for name, t in med.items():
        base = med["local specularch step" if "specularch" in name else "local eager step"]
        print(f"{name:28s} {t * 1e3:8.2f} {max(0.0, t - base) * 1e3:16.2f}")


if __name__ == "__main__":
    main()
