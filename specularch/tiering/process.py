"""Compiling a candidate in a worker process, so that the program's thread never waits for
the GIL while a compiler holds it (TorchScript's and Inductor's C++ passes hold it for up to
a second at a time: with a compile thread, steps were up to 1400x slower; docs/tiering.md).

The background thread (``worker.py``) still runs the job, but only waits: it writes the job
(``job.py``), starts ``python -m specularch.tiering.compile_worker`` and waits for it (a
wait on a child process releases the GIL), then loads the artefact: a ``torch.jit.save``d
frozen module (TorchScript) or a saved ``standalone_compile`` artefact (Inductor), each a
few milliseconds to load. Only graphs compiled as one flattened ATen graph travel
(``route``); the others (forward graphs through AOT autograd, whose forward and backward
are glued by Python, and rolled loops) are compiled on the thread as before.

A worker that crashes, runs past ``TIMEOUT`` or writes an artefact that
cannot be loaded raises ``WorkerFailed``: the candidate is "compile failed", the graph stays
on its tier. Children still running at exit are killed; each job's folder is removed.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Callable

import torch

from ..fx_lower import _torch_compilers as compilers, compile_cache
from ..fx_lower.backends import flattened, specialised_numbers
from . import job as jobs
from . import worker  # noqa: F401  (its exit handler must run after ours: atexit is LIFO)

COMMAND = [sys.executable, "-m", "specularch.tiering.compile_worker"]  # + the job's folder
# Module settings, not config options (the README's option table is not ours to change):
ENABLED = True   # False: every candidate compiles on the background thread, as before
TIMEOUT = 600.0  # seconds a worker may compile one candidate before it is killed
NICENESS = 10    # the worker's, so that the program keeps its core first (docs/tiering.md)
BACKENDS = ("torchscript", "inductor")
# Variables a worker must not inherit: Inductor's address in this process, the global switch.
PRIVATE_ENV = ("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "SPECULARCH")

_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()


class WorkerFailed(RuntimeError):
    """The worker process did not produce a usable artefact (its reason says why)."""


def route(backend: str, gm: torch.fx.GraphModule) -> str | None:
    """None when ``backend``'s compile of ``gm`` can run in a worker process, else why not."""
    if backend not in BACKENDS:
        return f"{backend} compiles in this process"
    if gm.meta.get("rolled_loops") or not flattened(gm):
        return "its AOT-autograd form (forward and backward glued by Python) cannot be sent"
    # What the backend wraps around the compiled graph in this process: used-up histories
    # (spent.py) and one compile per value of a number (specialise.py).
    if gm.meta.get("outputs_require_grad"):
        return "its outputs carry autograd history, attached in this process"
    if gm.meta.get("scalar_inputs") and specialised_numbers(gm):
        return "it is compiled once per value of a number input, in this process"
    return jobs.unsendable(gm)


def compile_candidate(backend: str, gm: torch.fx.GraphModule, examples: list, timeout: float) -> Callable:
    """``backend``'s compiled form of ``gm``, compiled by a worker process (raises
    ``WorkerFailed``). Call it on the background thread: it waits for the worker."""
    key = None
    if backend == "torchscript":
        key = compile_cache.entry_key(gm, examples, "torchscript", "flattened")
        cached = compile_cache.load_script(key)
        if cached is not None:
            return compile_cache.mark_cached(compilers.run_scripted(*cached))
    folder = tempfile.mkdtemp(prefix="specularch-compile-")
    try:
        # threads: Inductor writes its C++ kernels for the program's thread count, not the
        # worker's one thread.
        job = jobs.pack(gm, examples, backend=backend, cache_key=key, threads=torch.get_num_threads(),
                        cache_dir=_cache_root(), inductor_dir_chosen=compile_cache.inductor_dir_chosen())
        torch.save(job, os.path.join(folder, "job.pt"))
        meta = _run(folder, timeout)
        return _load(backend, os.path.join(folder, "artefact"), meta)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _cache_root() -> str | None:
    folder = compile_cache.directory("torchscript")
    return os.path.dirname(folder) if folder else None


def _run(folder: str, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    # One compile thread: Inductor's default pool (a process per core, each running a C++
    # compiler) would take the cores the program runs on.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with open(os.path.join(folder, "log.txt"), "wb") as log:
        with _children_lock:
            child = subprocess.Popen([*COMMAND, folder, str(NICENESS)], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
            _children.add(child)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise WorkerFailed(f"the worker process ran past {timeout:g}s and was killed") from None
        finally:
            with _children_lock:
                _children.discard(child)
    result = _result(folder)
    if "error" in result:
        raise WorkerFailed(f"in the worker process: {result['error']}")
    if code != 0 or "meta" not in result:
        raise WorkerFailed(f"the worker process exited with status {code}: {_last_line(folder)}")
    return result["meta"]


def _result(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "result.json")) as f:
            result = json.load(f)
        return result if isinstance(result, dict) else {}
    except (OSError, ValueError):
        return {}


def _last_line(folder: str) -> str:
    try:
        with open(os.path.join(folder, "log.txt"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


def _load(backend: str, path: str, meta: dict) -> Callable:
    try:
        if backend == "torchscript":
            return compilers.run_scripted(*compile_cache.read_script(path))
        return compilers.load_inductor_artifact(path, meta)
    except Exception as e:
        raise WorkerFailed(f"the worker's artefact could not be loaded "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


@atexit.register
def _kill_children() -> None:
    """At exit: a compile still running is of no use any more."""
    with _children_lock:
        children = list(_children)
    for child in children:
        child.kill()
