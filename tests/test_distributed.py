"""Data-parallel training with the gradient all-reduce inside the captured step: two gloo
processes on this machine train an MLP and the LSTM LM for several steps, and the parameters equal
DistributedDataParallel's on the same data shards and are identical across ranks. Frozen
parameters and buffers start from rank 0's and buffers follow rank 0's like DDP's; a step
that cannot run as a graph on some rank stops every rank with the same clear error, and the
ranks stay in step afterwards. Every run has a process-group timeout and a join deadline."""
import datetime
import gc
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import specularch
from specularch.api import _state_of
from specularch.distributed import DistributedStepError
from specularch.distributed.allreduce import plan_buckets

STEPS = 6
pytestmark = [pytest.mark.slow,  # every test starts processes
              pytest.mark.skipif(not dist.is_available() or sys.platform != "linux",
                                 reason="needs gloo on Linux")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args, world=2, deadline_s=150):
    """Run ``fn(rank, world, port, *args)`` on ``world`` processes; fail (killing them) past
    the deadline instead of hanging."""
    ctx = mp.start_processes(_entry, args=(fn, world, _free_port(), args), nprocs=world,
                             start_method="spawn", join=False)
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=max(0.1, end - time.monotonic())):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed test did not finish within {deadline_s} s (a hang)")


def _entry(rank, fn, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
        # DDP holds the process group: callers free it before returning so that
        # destroy_process_group really ends gloo's threads. Otherwise a thread may still
        # release a finished collective at interpreter shutdown, which aborts the process
        # ("terminate called without an active exception"; plain DDP does it too). The same
        # for specularch's cached graphs of distributed steps: released first.
        specularch.reset()
        gc.collect()
    finally:
        dist.destroy_process_group()


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))


def _lstm(seed):
    from specularch.workloads.lstm_lm import LSTMLM
    torch.manual_seed(seed)
    return LSTMLM(vocab=30, hidden=8, layers=1, dropout=0.0)


def _lstm_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 30, (5, 3), generator=g)
    return tokens, torch.randint(0, 30, (5, 3), generator=g)


def _mlp_batch(step, rank, n=4):
    g = torch.Generator().manual_seed(100 * step + rank)  # this rank's shard
    return torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g)


def _loss(name, model, x, y):
    out = model(x)
    if name == "lstm":
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return ((out - y) ** 2).mean()


def _make(name, model, opt):
    def train_step(x, y):
        opt.zero_grad()
        loss = _loss(name, model, x, y)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_like_ddp(rank, world, out_dir, name, bucket_mb):
    # different initial weights per rank: the optimized step broadcasts rank 0's, like DDP
    build = _lstm if name == "lstm" else _model
    fast = build(rank)
    ref = nn.parallel.DistributedDataParallel(build(rank))
    fast_opt = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = specularch.optimize(_make(name, fast, fast_opt))
    ref_step = _make(name, ref, ref_opt)
    with specularch.config.patch(distributed_bucket_mb=bucket_mb):
        for i in range(STEPS):
            x, y = (_lstm_batch if name == "lstm" else _mlp_batch)(i, rank)
            step(x, y)
            ref_step(x, y)
    e = specularch.explain(step)
    torch.save({"fast": _flat(fast), "ref": _flat(ref.module), "graphs": len(e.graphs),
                "fallbacks": [str(f) for f in e.fallbacks], "hits": e.stats.graph_hits,
                "code": e.graphs[0].code if e.graphs else "",
                "released": any("RELEASE_GRADS((" in entry.entry_source  # shadow_heap/release.py
                                for entry in _state_of(step).entries)},
               os.path.join(out_dir, f"{rank}.pt"))
    del ref, ref_step


@pytest.mark.parametrize("name,bucket_mb", [("mlp", 25), ("lstm", 25), ("mlp", 1e-4)],
                         ids=["mlp", "lstm", "mlp-tiny-buckets"])
def test_two_process_training_matches_ddp(tmp_path, name, bucket_mb):
    """The LSTM LM keeps its hidden state on `self` across batches (a Python loop over time);
    tiny buckets (config.distributed_bucket_mb) exchange each parameter on its own."""
    _spawn(_train_like_ddp, str(tmp_path), name, bucket_mb)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for r in results:
        assert r["fallbacks"] == [] and r["graphs"] <= 2 and r["hits"] >= STEPS - 2, r  # + momentum init
        assert "grad_and_allreduce" in r["code"]
        assert r["released"]  # last step's gradients dropped before the graph, as eager
        torch.testing.assert_close(r["fast"], r["ref"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["fast"], results[1]["fast"], rtol=0, atol=0)  # identical ranks


def test_buckets_fill_last_parameters_first_with_a_small_first_bucket():
    params = [torch.zeros(1024, 1024) for _ in range(3)]  # 4 MiB each
    assert plan_buckets(params, 25 * 2**20) == [[2], [1, 0]]  # first bucket closes at 1 MiB
    assert plan_buckets(params, 8 * 2**20) == [[2], [1, 0]]
    assert plan_buckets(params, 2**20 // 2) == [[2], [1], [0]]
    assert plan_buckets([torch.zeros(10)] * 4, 25 * 2**20) == [[3, 2, 1, 0]]
    mixed = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10)]
    assert plan_buckets(mixed, 25 * 2**20) == [[2], [1], [0]]  # one dtype per bucket


class RunningCenter(nn.Module):
    """Subtracts a running mean kept in a buffer: the buffer steers the training forward."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.mean


def _frozen_bn(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), RunningCenter(8), nn.Tanh(),
                      nn.Linear(8, 2))
    m[0].weight.requires_grad_(False)  # frozen: broadcast too, never averaged
    m[2].mean.add_(seed)               # buffers differ per rank before the broadcast
    return m


def _frozen_and_buffers(rank, world, out_dir):
    fast, ref_model = _frozen_bn(rank), _frozen_bn(rank)
    ref = nn.parallel.DistributedDataParallel(ref_model)  # broadcast_buffers=True (default)
    fast_opt = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = specularch.optimize(_make("mlp", fast, fast_opt))
    ref_step = _make("mlp", ref, ref_opt)
    for i in range(STEPS):
        x, y = _mlp_batch(i, rank)
        step(x, y)
        ref_step(x, y)
    e = specularch.explain(step)
    torch.save({"fast": _flat(fast), "ref": _flat(ref.module), "fallbacks": e.fallbacks,
                "buffers": [b.clone() for b in fast.buffers()],
                "ref_buffers": [b.clone() for b in ref.module.buffers()]},
               os.path.join(out_dir, f"{rank}.pt"))
    del ref, ref_step


def test_frozen_parameters_and_buffers_follow_rank_0_like_ddp(tmp_path):
    """DDP broadcasts every parameter and buffer at construction and rank 0's buffers before
    every forward; the optimized step broadcasts them at its first capture and after every
    step. Parameters equal DDP's on every rank; buffers equal DDP's rank 0's on every rank
    (DDP's other ranks hold their own last update until their next forward)."""
    _spawn(_frozen_and_buffers, str(tmp_path))
    results = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    for r in results:
        assert r["fallbacks"] == []
        torch.testing.assert_close(r["fast"], r["ref"], rtol=1e-5, atol=1e-6)
        for got, want in zip(r["buffers"], results[0]["ref_buffers"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["fast"], results[1]["fast"], rtol=0, atol=0)


def _outcome(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except DistributedStepError as e:
        return f"DistributedStepError: {e}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _disagreements(rank, world, out_dir):
    """Each scenario on both ranks at once, then a good step: the ranks stay in step."""
    out = {}

    # A: every rank's capture fails after backward() (a branch on a tensor value): nothing
    # runs anywhere, every rank raises naming the reason.
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @specularch.optimize
    def branchy_step(x, y):
        opt.zero_grad()
        loss = _loss("mlp", model, x, y)
        loss.backward()
        if loss > 0:
            opt.step()

    before = _flat(model)
    out["A"] = _outcome(branchy_step, *_mlp_batch(0, rank))
    out["A_untouched"] = torch.equal(_flat(model), before) and all(
        p.grad is None for p in model.parameters())

    # B..E: one step function; rank 1 alone takes a path that cannot be captured before
    # backward() (`slow`), a new batch size, or a bad index, while rank 0 runs the graph.
    fast, ref = _model(rank), nn.parallel.DistributedDataParallel(_model(rank))
    fast_opt = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def train_step(x, y, slow=False, column=0):
        fast_opt.zero_grad()
        if slow:
            dist.get_rank()  # a torch.distributed call: cannot be captured
        loss = _loss("mlp", fast, x, y) + 0 * x[:, column].sum()
        loss.backward()
        fast_opt.step()
        return loss.item()

    step = specularch.optimize(train_step)
    ref_step = _make("mlp", ref, ref_opt)
    out["B"] = _outcome(step, *_mlp_batch(0, rank), slow=rank == 1)  # first call
    out["B_untouched"] = all(p.grad is None for p in fast.parameters())
    for i in range(3):
        out[f"good{i}"] = _outcome(step, *_mlp_batch(i, rank))
        ref_step(*_mlp_batch(i, rank))
    after_good = _flat(fast)
    out["C"] = _outcome(step, *_mlp_batch(3, rank), slow=rank == 1)  # later, rank 1 only
    out["C_untouched"] = torch.equal(_flat(fast), after_good)
    # D: a different batch size on rank 1 only: it captures again, rank 0 hits its graph
    out["D"] = _outcome(step, *_mlp_batch(4, rank, n=3 if rank else 4))
    ref_step(*_mlp_batch(4, rank, n=3 if rank else 4))
    # E: the user's error (index out of range) on rank 1 only
    after_d = _flat(fast)
    out["E"] = _outcome(step, *_mlp_batch(5, rank), column=7 if rank else 0)
    out["E_untouched"] = torch.equal(_flat(fast), after_d)
    # F: ranks with different bucket sizes would exchange mismatched buckets
    with specularch.config.patch(distributed_bucket_mb=1e-4 if rank else 25):
        out["F"] = _outcome(step, *_mlp_batch(6, rank))
    out["G"] = _outcome(step, *_mlp_batch(7, rank))
    ref_step(*_mlp_batch(7, rank))
    out["fast"], out["ref"] = _flat(fast), _flat(ref.module)

    # H: an optimized function without backward() that runs eagerly (a value read in Python),
    # on rank 0 only: no collective, no hang.
    @specularch.optimize
    def evaluate(x):
        return float(fast(x).sum()) * 2

    if rank == 0:
        out["H"] = _outcome(evaluate, *_mlp_batch(0, rank)[:1])

    # I: a step whose model is wrapped in DDP cannot be captured; it runs eagerly and DDP
    # averages its gradients, exactly as the original program.
    ddp_fast, ddp_ref = (nn.parallel.DistributedDataParallel(_model(rank)) for _ in range(2))
    ddp_step = specularch.optimize(_make("mlp", ddp_fast, torch.optim.SGD(ddp_fast.parameters(), lr=0.1)))
    ddp_ref_step = _make("mlp", ddp_ref, torch.optim.SGD(ddp_ref.parameters(), lr=0.1))
    for i in range(3):
        out[f"I{i}"] = _outcome(ddp_step, *_mlp_batch(i, rank))
        ddp_ref_step(*_mlp_batch(i, rank))
    out["I_fast"], out["I_ref"] = _flat(ddp_fast.module), _flat(ddp_ref.module)
    out["I_fallbacks"] = [f.kind for f in specularch.explain(ddp_step).fallbacks]
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    del ref, ref_step, ddp_fast, ddp_ref, ddp_step, ddp_ref_step


def test_ranks_agree_when_a_step_cannot_run_on_some_rank(tmp_path):
    _spawn(_disagreements, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    for r in (r0, r1):  # A: on every rank, before anything ran
        assert r["A"].startswith("DistributedStepError") and "[data_dependent_branch]" in r["A"], r["A"]
        assert "test_distributed.py" in r["A"] and r["A_untouched"]
    # B (first call) and C (later): rank 1 names its reason, rank 0 names rank 1
    for key in "BC":
        assert "cannot run on rank 1: [unsupported_call]" in r1[key], r1[key]
        assert "rank 1 could not run it ([unsupported_call]" in r0[key], r0[key]
    assert r0["B_untouched"] and r1["B_untouched"] and r0["C_untouched"] and r1["C_untouched"]
    assert all(r[f"good{i}"] == "ok" for r in (r0, r1) for i in range(3))
    assert r0["D"] == r1["D"] == "ok"
    assert r1["E"].startswith("IndexError"), r1["E"]
    assert "rank 1 could not run it ([error]" in r0["E"], r0["E"]
    assert r0["E_untouched"] and r1["E_untouched"]
    for r in (r0, r1):
        assert "ranks disagree" in r["F"] and "distributed_bucket_mb" in r["F"], r["F"]
        assert r["G"] == "ok"
        torch.testing.assert_close(r["fast"], r["ref"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r0["fast"], r1["fast"], rtol=0, atol=0)
    assert r0["H"] == "ok"
    for r in (r0, r1):
        assert all(r[f"I{i}"] == "ok" for i in range(3)) and r["I_fallbacks"] == ["unsupported_call"]
        torch.testing.assert_close(r["I_fast"], r["I_ref"], rtol=0, atol=0)
