"""The worker process: ``python -m specularch.tiering.compile_worker [NICENESS]`` is one
long-lived child of the program that compiles jobs one after another. It reads a job's folder
per line on its standard input, compiles ``FOLDER/job.pt`` (``job.py``), writes the artefact
the program loads (``process.py``) and ``FOLDER/result.json`` (``{"meta": ...}`` or
``{"error": ...}``), then answers the job's status (0: compiled) as a line on its standard
output. What a job prints goes to ``FOLDER/log.txt``. It leaves when its input closes.

Kept warm between jobs (stopped after ``process.IDLE_SECONDS`` without one) so that a
candidate does not pay for starting Python and importing torch (2-3 s of CPU, far more at a
low priority on a busy machine): the program starts it before its first graph is hot
(``process.prestart``; where it is safe, as a fork of the program, ``fork.py``, with torch
already imported), and while no job is waiting it imports what the compilers import on first
use (``PRELOAD``), one module at a time.

It compiles (the compilers trace with fake tensors) and runs nothing of the program's but
an AOTInductor package once, on zero-filled inputs of the graph's layout, to find one that
compiles and then fails when it runs (``_torch_aoti.test_run``); it never imports the user's
modules (``job.unsendable``). It runs at a lower priority on one thread,
so that the program's own thread keeps its core first.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import sys
import time
import traceback

# Imported while idle: first the flattening and TorchScript path, which the first candidate
# (TorchScript, the cheapest compile) needs; Inductor's (1-2 s of imports each) only once a
# job was served. An import is not interrupted: a job that arrived during Inductor's would
# wait for it (LeNet's first TorchScript job, a 0.33 s compile, waited 1.1 s).
PRELOAD = ("specularch.fx_lower._torch_compilers", "specularch.tiering.job",
           "torch.fx.experimental.proxy_tensor")
PRELOAD_AFTER_A_JOB = ("torch._inductor.compile_fx", "torch.export",
                       "torch._inductor.standalone_compile")


def serve(niceness: int, answers_fd: int | None = None) -> int:
    """Compile the jobs named on stdin until it closes; answer each on ``answers_fd`` (a
    forked worker's own pipe), or on stdout (a new interpreter's)."""
    if hasattr(os, "nice"):
        os.nice(niceness)
    import torch
    torch.set_num_threads(1)
    # fd 1 and 2 go to each job's log
    answers = os.fdopen(os.dup(1) if answers_fd is None else answers_fd, "w")
    preload, later = list(PRELOAD), list(PRELOAD_AFTER_A_JOB)
    while True:
        folder = _next_job(preload)
        if folder is None:
            return 0
        with _output_to(os.path.join(folder, "log.txt")):
            code = compile_job(folder)
        answers.write(f"{code}\n")
        answers.flush()
        preload.extend(later)
        later.clear()


def _next_job(preload: list[str]) -> str | None:
    """The next job's folder (None: the program closed our input), importing ``preload``
    while none is waiting."""
    line = b""
    while not line.endswith(b"\n"):
        if preload and not select.select([0], [], [], 0)[0]:
            _preload(preload.pop(0))
            continue
        chunk = os.read(0, 4096)
        if not chunk:
            return None
        line += chunk
    return line.decode().strip()


def _preload(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception:  # a job that needs it will say why
        pass


@contextlib.contextmanager
def _output_to(path: str):
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def compile_job(folder: str) -> int:
    import torch
    from specularch.fx_lower import compile_cache
    from specularch.tiering import job as jobs
    start = time.perf_counter()
    try:
        job = torch.load(os.path.join(folder, "job.pt"), weights_only=False)
        compile_cache.configure(lambda: job["cache_dir"], job["inductor_dir_chosen"])
        gm, examples = jobs.unpack(job)
        meta = _compile(job, gm, examples, os.path.join(folder, "artefact"))
    except Exception as e:
        traceback.print_exc()
        # A forward graph AOT autograd must wrap (fx_lower/_torch_joint.py): the program
        # compiles it on its thread instead.
        from specularch.fx_lower._torch_joint import NotSplit
        _result(folder, {"error": compile_cache.error_line(e), "not_split": isinstance(e, NotSplit)})
        return 1
    seconds = time.perf_counter() - start
    print(f"compiled {job['backend']} in {seconds:.2f}s", flush=True)
    _result(folder, {"meta": meta, "seconds": seconds, "pid": os.getpid()})
    return 0


def _compile(job: dict, gm, examples: list, artefact: str) -> dict:
    from specularch.fx_lower import _torch_compilers as compilers, compile_cache
    if job.get("split"):  # a forward graph: its forward and backward (fx_lower/split.py)
        from specularch.fx_lower import split
        return split.compile_parts(job["backend"], gm, examples, artefact, job["cache_key"],
                                   job.get("threads"), job.get("aoti", False))
    if job["backend"] == "torchscript":
        scripted, meta = compilers.scripted_flattened(gm, examples)
        compile_cache.write_script(artefact, scripted, meta)
        if job["cache_key"]:  # the program's key: the next run loads it without a worker
            compile_cache.save_script(job["cache_key"], scripted, meta)
        return meta
    if job["backend"] == "inductor":
        meta = compilers.inductor_artifact(gm, examples, artefact, threads=job.get("threads"),
                                           aoti=job.get("aoti", False))
        if job["cache_key"]:
            compile_cache.save_artifact(job["cache_key"], artefact, meta)
        return meta
    raise ValueError(f"no worker compile for backend {job['backend']!r}")


def _result(folder: str, result: dict) -> None:
    path = os.path.join(folder, "result.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    code = serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown, which waits for Inductor's pool of compile processes
    # to shut down (seconds to tens of seconds).
    os._exit(code)
