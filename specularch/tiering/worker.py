"""The background compiler: one daemon thread that runs compile jobs one after another, so
that no call of the user's program waits for a compile.

While it compiles, the thread switch interval is lowered (``SWITCH_INTERVAL``): a compiler
runs long stretches of Python (``make_fx``, TorchScript's frontend, Inductor's lowering), and
with CPython's default of 5 ms the user's thread, once it asks for the GIL, waits up to that
long each time the worker holds it. The thread runs at the program's own priority
(``NICENESS`` 0): at a lower one, on a busy machine the OS takes the core from it while it
holds the GIL (loading an artefact, packing a job), and the program's thread then waits for
a thread that is not running — a 1 ms job pack took 1.0 s and a step 1.6 s at load 13 on
two cores. The CPU-heavy part of a compile runs in the worker process, at niceness 10.
Flattened graphs are compiled in a worker process (``process.py``): the job on this thread
then only waits for the child and loads its artefact, so the GIL stays with the program.

A compiled candidate is warmed here before its trial (``warm_up``): the first calls of a
compiled graph do work of their own — TorchScript's profiling executor profiles the graph and
then optimises it, Inductor's first call loads its kernels and allocates — which, left to the
trial, would run inside the program's steps (tens to hundreds of times a step's time).
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
from typing import Callable

import torch

from .. import log

THREAD_NAME = "specularch-tier-compiler"
SWITCH_INTERVAL = 0.0005  # seconds, while a compile runs (CPython's default: 0.005)
NICENESS = 0  # this thread's (see above); > 0 lowers it (Linux setpriority on the thread)
# Calls of a compiled candidate on copies of its inputs before its trial: TorchScript profiles
# on the first (torch._C._jit_get_num_profiled_runs() is 1), optimises on the second and may
# bail out to a re-optimised plan on the third; Inductor loads its kernels on the first.
WARM_CALLS = 3
IDLE_POLL = 5.0  # seconds without a job between two calls of the idle hooks (``when_idle``)

_jobs: "queue.Queue[tuple[Callable[[], None], bool]]" = queue.Queue()  # (job, counted)
_idle = threading.Condition()
_busy = 0  # jobs submitted and not finished
_thread: threading.Thread | None = None
_start_lock = threading.Lock()
_saved_interval: float | None = None  # the user's switch interval while compiles run
_idle_hooks: list[Callable[[], bool]] = []  # (only this thread reads or changes it)


def submit(job: Callable[[], None]) -> None:
    """Run ``job()`` on the background thread (it must not raise: it records its failures)."""
    global _busy
    with _idle:
        _busy += 1
    _ensure_thread()
    _jobs.put((job, True))


def soon(job: Callable[[], None]) -> None:
    """Run ``job()`` on the background thread, not counted as a pending compile (preparing
    one: starting the worker process)."""
    _ensure_thread()
    _jobs.put((job, False))


def when_idle(hook: Callable[[], bool]) -> None:
    """Call ``hook()`` on the background thread each time no job came for ``IDLE_POLL``
    seconds, until it returns False (process.py stops an idle worker process this way).
    Submitted as a job, so that only the thread touches the hooks; while none is registered
    the thread sleeps until the next job."""
    soon(lambda: _idle_hooks.append(hook))


def start() -> None:
    """Start the background thread now. Called when a graph is captured (a call that costs far
    more than this): starting a thread takes milliseconds on a busy machine, since
    ``Thread.start`` waits until the new thread has run, which a later step would pay."""
    _ensure_thread()


def pending() -> int:
    """Jobs submitted and not finished."""
    return _busy


def wait(timeout: float | None = None) -> bool:
    """Block until every submitted compile finished (True), or ``timeout`` seconds passed
    (False). For tests and benchmarks: the program itself never needs to."""
    with _idle:
        return _idle.wait_for(lambda: _busy == 0, timeout)


@atexit.register
def _drain() -> None:
    """At exit: forget the compiles not started, and let the running one finish (a thread
    stopped inside a C++ compiler when the interpreter goes away aborts the process)."""
    global _busy
    while True:
        try:
            _, counted = _jobs.get_nowait()
        except queue.Empty:
            break
        if counted:
            with _idle:
                _busy -= 1
    wait()


def warm_up(graph_fn: Callable, examples: list) -> None:
    """Call ``graph_fn`` ``WARM_CALLS`` times (or its ``warm_calls``: an AOTInductor
    package's, one) on copies of ``examples`` (the captured graph's
    example inputs), on this thread. Copies: a compiled graph may update its inputs in place,
    and the examples are the program's own tensors. Graphs taking anything but tensors and
    numbers are not warmed (a copy of another object could behave differently). A call that
    raises ends the warm-up: the trial decides what a raising candidate means."""
    inputs = _copies(examples)
    if inputs is None:
        return
    for _ in range(getattr(graph_fn, "warm_calls", WARM_CALLS)):
        try:
            graph_fn(*inputs)
        except Exception:
            return


def _copies(examples: list) -> list | None:
    out = []
    for value in examples:
        if isinstance(value, torch.Tensor):
            if value.is_meta or type(value) not in (torch.Tensor, torch.nn.Parameter):
                return None  # a fake or subclass tensor: nothing to run on
            out.append(value.detach().clone().requires_grad_(value.requires_grad))
        elif value is None or isinstance(value, (bool, int, float)):
            out.append(value)
        else:
            return None
    return out


def _ensure_thread() -> None:
    global _thread
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name=THREAD_NAME, daemon=True)
            _thread.start()


def _run() -> None:
    global _busy, _saved_interval
    _lower_priority()
    while True:
        try:
            job, counted = _jobs.get(timeout=IDLE_POLL if _idle_hooks else None)
        except queue.Empty:
            _call_idle_hooks()
            continue
        if _saved_interval is None:
            _saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved_interval, SWITCH_INTERVAL))
        try:
            job()
        except Exception as e:  # a job records its own failures; this is a bug in one
            log.emit("graphs", f"background compile job failed: {type(e).__name__}: {e}")
        finally:
            if _jobs.empty():
                sys.setswitchinterval(_saved_interval)
                _saved_interval = None
            if counted:
                with _idle:
                    _busy -= 1
                    _idle.notify_all()


def _call_idle_hooks() -> None:
    for hook in list(_idle_hooks):
        try:
            again = hook()
        except Exception as e:  # a bug in the hook: not called again
            log.emit("graphs", f"background idle hook failed: {type(e).__name__}: {e}")
            again = False
        if not again:
            _idle_hooks.remove(hook)


def _lower_priority() -> None:
    if NICENESS > 0 and hasattr(os, "setpriority") and sys.platform.startswith("linux"):
        try:  # on Linux a thread id is a process id for setpriority: this thread only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except OSError:
            pass
