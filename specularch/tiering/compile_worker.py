"""The worker process: ``python -m specularch.tiering.compile_worker FOLDER [NICENESS]`` compiles the job
in ``FOLDER/job.pt`` (``job.py``) and writes the artefact the program loads
(``process.py``), then ``FOLDER/result.json``: ``{"meta": ...}`` or ``{"error": ...}``.

It only compiles: it never runs the graph (the compilers trace it with fake tensors) nor
imports the user's modules (``job.unsendable``). It runs at a lower priority on one thread,
so that the program's own thread keeps its core first.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback



def main(folder: str, niceness: int) -> int:
    if hasattr(os, "nice"):
        os.nice(niceness)
    import torch
    torch.set_num_threads(1)
    from specularch.fx_lower import compile_cache
    from specularch.tiering import job as jobs
    job = torch.load(os.path.join(folder, "job.pt"), weights_only=False)
    compile_cache.configure(lambda: job["cache_dir"], job["inductor_dir_chosen"])
    start = time.perf_counter()
    try:
        gm, examples = jobs.unpack(job)
        meta = _compile(job, gm, examples, os.path.join(folder, "artefact"))
    except Exception as e:
        traceback.print_exc()
        _result(folder, {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        return 1
    seconds = time.perf_counter() - start
    print(f"compiled {job['backend']} in {seconds:.2f}s", flush=True)
    _result(folder, {"meta": meta, "seconds": seconds})
    return 0


def _compile(job: dict, gm, examples: list, artefact: str) -> dict:
    from specularch.fx_lower import _torch_compilers as compilers, compile_cache
    if job["backend"] == "torchscript":
        scripted, meta = compilers.scripted_flattened(gm, examples)
        compile_cache.write_script(artefact, scripted, meta)
        if job["cache_key"]:  # the program's key: the next run loads it without a worker
            compile_cache.save_script(job["cache_key"], scripted, meta)
        return meta
    if job["backend"] == "inductor":
        return compilers.inductor_artifact(gm, examples, artefact, threads=job.get("threads"))
    raise ValueError(f"no worker compile for backend {job['backend']!r}")


def _result(folder: str, result: dict) -> None:
    path = os.path.join(folder, "result.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    code = main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is written: skip the interpreter's teardown, which waits for Inductor's
    # pool of compile processes to shut down (seconds to tens of seconds).
    os._exit(code)
