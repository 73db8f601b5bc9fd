"""Compiling a candidate in a worker process, so that the program's thread never waits for
the GIL while a compiler holds it (TorchScript's and Inductor's C++ passes hold it for up to
a second at a time: with a compile thread, steps were up to 1400x slower; docs/tiering.md).

The background thread (``worker.py``) still runs the job, but only waits: it writes the job
(``job.py``), hands its folder to the worker process (``compile_worker.serve``: one
long-lived child, started before the first graph is hot and kept warm between jobs; forked
from the program where that is safe, ``fork.py``, else ``python -m
specularch.tiering.compile_worker``) and waits for its answer (a wait on a pipe releases the
GIL), then loads the artefact: a ``torch.jit.save``d frozen module (TorchScript) or an
AOTInductor package (Inductor; a ``standalone_compile`` artefact where AOTInductor failed),
each a few milliseconds to load. Both are kept
in the persistent compile cache, so a second run loads them without a worker. Graphs compiled
as one flattened ATen graph travel, and forward graphs whose results need autograd as two
(``fx_lower/split.py``: forward and backward, glued in the program); the others (``route``:
rolled loops, forward graphs with numbers compiled per value or with dynamic sizes but no
size most of their calls have (``hot_sizes.py``), which go through AOT autograd's own
wrappers) are compiled on the thread as before.

A worker that crashes, runs past ``TIMEOUT`` or writes an artefact that
cannot be loaded raises ``WorkerFailed``: the candidate is "compile failed", the graph stays
on its tier; a worker that crashed, hung or failed a compile is replaced by a fresh one for
the next job. The worker is killed at exit (and leaves by itself when its input closes);
each job's folder is removed. A worker that had no job for ``IDLE_SECONDS`` is stopped (the
next job, or the next graph's ``prestart``, starts another): an idle interpreter with the
compilers imported holds hundreds of MB, and a forked one a copy of each page the program
wrote since the fork.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from tempfile import TemporaryFile
from typing import Callable

import torch

from ..fx_lower import _torch_aoti as aoti, _torch_compilers as compilers, compile_cache, split
from ..fx_lower.backends import autograd_forward, specialised_numbers
from ..fx_lower.passes import example_inputs
from .. import log
from . import fork
from . import job as jobs
from . import worker  # (imported first: its exit handler must run after ours, atexit is LIFO)

COMMAND = [sys.executable, "-m", "specularch.tiering.compile_worker"]  # + the niceness
_NEW_INTERPRETER = list(COMMAND)  # what a forked worker runs (fork.py); tests set others
# Module settings, not config options (the README's option table is not ours to change):
ENABLED = True   # False: every candidate compiles on the background thread, as before
TIMEOUT = 600.0  # seconds a worker may compile one candidate before it is killed
NICENESS = 10    # the worker's, so that the program keeps its core first (docs/tiering.md)
PRESTART = True  # start the worker before the first graph is hot (``prestart``)
FORK = True      # fork the worker from the program where that is safe (``fork.py``)
IDLE_SECONDS = 30.0  # a worker without a job this long is stopped (``_stop_if_idle``)
BACKENDS = ("torchscript", "inductor")
# Variables a worker must not inherit: Inductor's address in this process, the global switch.
PRIVATE_ENV = ("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "SPECULARCH")

_children: set = set()  # subprocess.Popen or fork.Forked
_children_lock = threading.Lock()
_current: "_Worker | None" = None  # the warm worker
_worker_lock = threading.Lock()
_prestarted = False


class WorkerFailed(RuntimeError):
    """The worker process did not produce a usable artefact (its reason says why)."""


class NotSplit(WorkerFailed):
    """A forward graph the worker could not split (``fx_lower/_torch_joint.py``: it updates
    an input in place, say): it compiles through AOT autograd on the thread."""


def route(backend: str, gm: torch.fx.GraphModule, fixed_sizes: bool = False,
          counted: str = "") -> str | None:
    """None when ``backend``'s compile of ``gm`` can run in a worker process, else why not.
    ``fixed_sizes``: a forward graph with dynamic sizes, compiled for fixed ones
    (``hot_sizes.py``); ``counted``: what its calls' sizes were where none were most calls'
    (``split.refusal``)."""
    if backend not in BACKENDS:
        return f"{backend} compiles in this process"
    if gm.meta.get("rolled_loops"):
        return "its rolled loops' bodies are compiled in this process"
    if _split(gm):
        why = split.refusal(gm, fixed_sizes, counted)
        if why is not None:
            return f"its AOT-autograd form cannot be sent ({why})"
        return jobs.unsendable(gm)  # (sent to be split: its forward and backward come back)
    # What the backend wraps around the compiled graph in this process: used-up histories
    # (spent.py) and one compile per value of a number (specialise.py).
    if gm.meta.get("outputs_require_grad"):
        return "its outputs carry autograd history, attached in this process"
    if gm.meta.get("scalar_inputs") and specialised_numbers(gm):
        return "it is compiled once per value of a number input, in this process"
    return jobs.unsendable(gm)


def _split(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` travels as its forward and backward (``split.py``: a forward graph whose
    results need autograd), else as one flattened graph (whole steps; graphs whose results
    need no autograd: an inference forward is compiled as it is)."""
    return autograd_forward(gm)


def compile_candidate(backend: str, gm: torch.fx.GraphModule, examples: list, timeout: float,
                      fixed_sizes: bool = False) -> Callable:
    """``backend``'s compiled form of ``gm``, compiled by the worker process (raises
    ``WorkerFailed``), or loaded from the persistent compile cache, where an earlier run's
    worker left it. Call it on the background thread: it waits for the worker.
    ``fixed_sizes``: ``gm`` has dynamic sizes and is compiled for those of ``examples``
    (``hot_sizes.py``; the caller checks the sizes of each call, ``hot_sizes.checked``)."""
    parts = _split(gm)
    key = compile_cache.entry_key(gm, examples, backend, _path(parts, examples if fixed_sizes else None))
    cached = split.cached(backend, key, split.replay_of(gm)) if parts else _cached(backend, key, gm.forward)
    if cached is not None:
        return compile_cache.mark_cached(cached)
    folder = tempfile.mkdtemp(prefix="specularch-compile-")
    try:
        # threads: Inductor writes its C++ kernels for the program's thread count, not the
        # worker's one thread.
        # aoti: Inductor's candidate comes back as an AOTInductor package when this torch
        # can load one (no import of Inductor here).
        job = jobs.pack(gm, examples, backend=backend, cache_key=key, threads=torch.get_num_threads(),
                        aoti=aoti.loadable(), cache_dir=_cache_root(),
                        inductor_dir_chosen=compile_cache.inductor_dir_chosen(), split=parts)
        if fixed_sizes:  # (dynamic_sizes.dynamic_inputs: none)
            job["meta"]["fixed_sizes"] = True
        torch.save(job, os.path.join(folder, "job.pt"))
        meta = _run(folder, timeout, forkable(backend, torch.get_num_threads()))
        if parts:
            return _load_parts(backend, os.path.join(folder, "artefact"), meta, split.replay_of(gm))
        return _load(backend, os.path.join(folder, "artefact"), meta, gm.forward)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _path(parts: bool, fixed: list | None = None) -> str:
    """The compile cache's path of a graph's candidate (``compile_cache.entry_key``), which
    names the sizes of ``fixed`` where a graph with dynamic sizes is compiled for them (the
    key leaves its dynamic dimensions' sizes out)."""
    path = split.PATH if parts else "flattened"
    if fixed is None:
        return path
    return f"{path} for sizes {[list(x.shape) for x in fixed if isinstance(x, torch.Tensor)]}"


def _cached(backend: str, key: str, fallback: Callable) -> Callable | None:
    """``fallback``: the graph's ``fx`` code, for sizes a dynamic graph was not compiled for."""
    loaded = compilers.load_cached(backend, key, fallback)  # (the background thread)
    return None if loaded is None else loaded[0]


def _cache_root() -> str | None:
    folder = compile_cache.directory("torchscript")
    return os.path.dirname(folder) if folder else None


def prestart(gm: torch.fx.GraphModule, backends: tuple[str, ...] = BACKENDS,
             skipped: Callable[[], set[str]] = set) -> None:
    """Start the worker process now, on the background thread (starting a process is not for
    the program's step to wait on), so that the first candidate of ``gm`` finds it warm.
    Once. Not when every one of ``backends`` that would compile ``gm`` in a worker finds it
    in the persistent compile cache (a second run), or is ``skipped()`` (called on that
    thread: the candidates an earlier run rejected): the worker, seconds of CPU and hundreds
    of MB, is then started by the first job that needs one."""
    global _prestarted
    if _prestarted or not ENABLED or not PRESTART:
        return
    _prestarted = True
    worker.soon(lambda: _prestart(gm, backends, skipped))


def _prestart(gm: torch.fx.GraphModule, backends: tuple[str, ...],
              skipped: Callable[[], set[str]] = set) -> None:
    examples = example_inputs(gm)
    gone = skipped()
    needed = [b for b in backends if b not in gone and route(b, gm) is None
              and not _in_cache(b, examples, gm)]
    if needed:  # started as the first job will need it
        _worker(forkable(needed[0], torch.get_num_threads()))


def forkable(backend: str, threads: int) -> bool:
    """Whether a forked worker may compile ``backend``'s candidate for a program computing
    on ``threads`` threads. Inductor's job runs the package it compiled once (``_torch_aoti.
    test_run``), and its kernels open OpenMP regions of ``threads`` threads: in a child forked
    from a program whose OpenMP pool exists (it computed on more than one thread), such a
    region never starts (libgomp's pool does not survive a fork; measured: a hang). The
    worker itself computes on one thread, which a fork leaves working."""
    return backend != "inductor" or threads <= 1


def _in_cache(backend: str, examples: list, gm: torch.fx.GraphModule) -> bool:
    if _split(gm):
        return split.in_cache(backend, compile_cache.entry_key(gm, examples, backend, _path(True)))
    return compilers.has_cached(backend, compile_cache.entry_key(gm, examples, backend, _path(False)))


class _Worker:
    """The long-lived child (``compile_worker.py``): a job's folder in, its status out.
    ``started`` says how: ``"forked"`` or ``"new interpreter (<why not forked>)"``."""

    def __init__(self, command: list[str], may_fork: bool = True):
        self.command = command
        self.log = TemporaryFile()  # what it prints outside a job (its start)
        # One compile thread: Inductor's default pool (a process per core, each running a
        # C++ compiler) would take the cores the program runs on.
        own = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
        why_not = _fork_refusal(command) if may_fork else \
            "an Inductor job for a program on several threads (process.forkable)"
        if why_not is None:
            self.child = fork.start(int(command[-1]), self.log.fileno(), PRIVATE_ENV, own)
            self.started = "forked"
        else:
            env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
            for name, value in own.items():
                env.setdefault(name, value)
            self.child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self.log, env=env)
            self.started = f"new interpreter ({why_not})"
        with _children_lock:
            _children.add(self.child)
        self.last_used = time.monotonic()
        worker.when_idle(_stop_if_idle)

    def run(self, folder: str, timeout: float) -> int:
        """The job's status; raises ``WorkerFailed`` when the child died or ran past
        ``timeout`` (it is killed: the next job starts a fresh one)."""
        try:
            self.child.stdin.write(f"{folder}\n".encode())
            self.child.stdin.flush()
        except OSError:
            pass  # it died: its status tells why, below
        # A wait on a pipe releases the GIL.
        if not select.select([self.child.stdout], [], [], timeout)[0]:
            self.close()
            raise WorkerFailed(f"the worker process ran past {timeout:g}s and was killed")
        answer = self.child.stdout.readline()
        if not answer.strip():  # its output closed: it died
            why = f"exited with status {self.child.wait()}: {_last_line(folder) or self._last_line()}"
            self.close()
            raise WorkerFailed(f"the worker process {why}")
        self.last_used = time.monotonic()
        return int(answer)

    def close(self) -> None:
        self.child.kill()
        self.child.wait()
        with _children_lock:
            _children.discard(self.child)
        self.log.close()

    def _last_line(self) -> str:
        self.log.seek(0)
        lines = [line.strip() for line in self.log.read().decode(errors="replace").splitlines()
                 if line.strip()]
        return lines[-1] if lines else "no output"


def _fork_refusal(command: list[str]) -> str | None:
    if not FORK:
        return "process.FORK is off"
    if command[:-1] != _NEW_INTERPRETER:
        return "another worker command"
    return fork.refusal()


def _worker(may_fork: bool = True) -> _Worker:
    """The warm worker, started if there is none (or it was started with other settings, or
    forked where the job needs a new interpreter: ``forkable``)."""
    global _current
    command = [*COMMAND, str(NICENESS)]
    with _worker_lock:
        if _current is not None and (_current.command != command or _current.child.poll() is not None
                                     or (_current.started == "forked" and not may_fork)):
            _current.close()
            _current = None
        if _current is None:
            _current = _Worker(command, may_fork)
        return _current


def _stop_if_idle() -> bool:
    """(An idle hook of the background thread, ``worker.when_idle``.) Stop the worker if it
    had no job for ``IDLE_SECONDS``; True while there is one to watch."""
    global _current, _prestarted
    with _worker_lock:
        current = _current
        if current is None:
            return False
        idle = time.monotonic() - current.last_used
        if idle < IDLE_SECONDS:
            return True
        _current, _prestarted = None, False  # (the next graph's prestart starts another)
    current.close()
    log.emit("graphs", f"stopped the worker process ({current.started}) after {idle:.0f} s "
             "without a job; the next job starts another")
    return False


def shut_down() -> None:
    """Stop the warm worker (the next job, or ``prestart``, starts a fresh one)."""
    global _current, _prestarted
    with _worker_lock:
        current, _current, _prestarted = _current, None, False
    if current is not None:
        current.close()


def _run(folder: str, timeout: float, may_fork: bool = True) -> dict:
    child = _worker(may_fork)
    try:
        code = child.run(folder, timeout)
    except WorkerFailed:
        _retire(child)
        raise
    result = _result(folder)
    if result.get("not_split"):  # (refused before anything was compiled)
        raise NotSplit(result["error"].removeprefix("NotSplit: "))
    if "error" in result or code != 0:
        _retire(child)  # a compile that raised may have left the child's state half-done
    if "error" in result:
        raise WorkerFailed(f"in the worker process: {result['error']}")
    if code != 0 or "meta" not in result:
        raise WorkerFailed(f"the worker process answered status {code}: {_last_line(folder)}")
    return result["meta"]


def _retire(child: _Worker) -> None:
    global _current
    with _worker_lock:
        if _current is child:
            _current = None
    child.close()


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
        return ""
    return lines[-1] if lines else ""


def _load_parts(backend: str, path: str, meta: dict, replay: Callable | None) -> Callable:
    try:
        return split.load_parts(backend, path, meta, replay)
    except Exception as e:
        raise WorkerFailed(f"the worker's artefacts could not be loaded "
                           f"({compile_cache.error_line(e)})") from e


def _load(backend: str, path: str, meta: dict, fallback: Callable) -> Callable:
    try:
        if backend == "torchscript":
            return compilers.run_scripted(*compile_cache.read_script(path, quiet=False), fallback)
        return compilers.load_inductor_artifact(path, meta, fallback)
    except Exception as e:
        raise WorkerFailed(f"the worker's artefact could not be loaded "
                           f"({compile_cache.error_line(e)})") from e


@atexit.register
def _kill_children() -> None:
    """At exit: a compile still running is of no use any more."""
    with _children_lock:
        children = list(_children)
    for child in children:
        child.kill()
