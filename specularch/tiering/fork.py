"""The worker process as a fork of the program, where that is safe: it starts in milliseconds
with torch and specularch already imported, where a fresh ``python -m
specularch.tiering.compile_worker`` spends 2-3 s of CPU importing torch before it can take its
first job (on the team's 2-core VM the first TorchScript candidate of LeNet's step came 4.2 s
after it was asked for, most of it that import).

A fork copies only the forking thread (the background compile thread, ``worker.py``, which
the frame hook never covers: the hook is per thread). A lock another thread held at that
moment stays locked in the child, so the worker is forked only when no other thread of the
program can hold one the child needs (``refusal``): every thread but the program's main
thread and ours parked where it holds nothing (waiting on a ``Condition``, ``Event`` or
``Queue``, in a ``join``, or an idle thread of a pool: Inductor's compile threads), no CUDA
(a forked child cannot use a CUDA context), no ``torch.distributed`` (its threads, and its
sockets, which the child would keep open). OpenMP's pool does not survive a fork either:
the child computes on one thread, and a job that would open wider OpenMP regions (an
Inductor package's test run for a program on several threads) goes to a new interpreter
(``process.forkable``). Nor where the program holds more than ``MAX_MEMORY`` of its own
memory: the fork copies its page tables with the GIL held (measured ~25 ms per GiB, the whole
program stalled), and the child keeps the pages of that moment: each page the program writes
afterwards is copied (a page fault in the program, and the child's copy stays until it exits:
a worker forked from a 4 GiB training process would hold up to 4 GiB more). Otherwise, or with
``process.FORK = False``, the worker is started as a new interpreter, as before. The main
thread may be inside a torch op at that moment; its locks are its own (the allocator's are
fork-safe: glibc takes them across ``fork``; so is the one of torch's Python locks it takes
in a step that the child needs, ``_torch_fork.py``), and a child that hung anyway is killed at
``process.TIMEOUT`` like any hung worker: a lost candidate, never a wrong result.
"""
from __future__ import annotations

import gc
import io
import os
import signal
import sys
import threading
import traceback
from typing import BinaryIO

import torch

from ..fx_lower import _torch_compilers as compilers
from . import worker
from ._torch_fork import torch_locks_held

MAX_MEMORY = 1 << 30  # bytes of the program's own (anonymous) memory above which it is not forked
STALL_PER_GIB = 0.025  # seconds a fork stalls the program per GiB of it (measured, for the message)


def refusal() -> str | None:
    """None when the worker may be forked from the calling thread now, else why not."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "fork is used on Linux only"
    if torch.cuda.is_initialized():
        return "CUDA is initialised (a forked child cannot use it)"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "torch.distributed is initialised (its threads and sockets)"
    held = program_memory()
    if held is not None and held > MAX_MEMORY:
        gib = held / 2**30
        return (f"the program holds {gib:.1f} GiB (fork.MAX_MEMORY {MAX_MEMORY / 2**30:g} GiB): "
                f"a fork would stall it ~{gib * STALL_PER_GIB * 1e3:.0f} ms and keep a copy of "
                "each page it writes while the worker lives")
    busy = _busy_threads()
    if busy:
        return f"other threads run ({', '.join(sorted(busy)[:3])})"
    return None


def program_memory() -> int | None:
    """Bytes of this process's resident memory that are its own (not file-backed): what a fork
    copies page tables for and may copy page by page. None where ``/proc`` cannot say."""
    try:
        with open("/proc/self/statm") as f:
            _, resident, shared = (int(v) for v in f.read().split()[:3])
    except (OSError, ValueError):
        return None
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


def _parked_code() -> frozenset:
    """Where a thread waits holding nothing: a ``Condition`` (``Event``, ``Queue.get``,
    ``Semaphore``), a ``join``, or an idle pool thread waiting for work (Inductor's compile
    threads, which Inductor itself resets in a forked child)."""
    from concurrent.futures import thread as pool_thread
    return frozenset((threading.Condition.wait.__code__,
                      threading.Thread._wait_for_tstate_lock.__code__,
                      pool_thread._worker.__code__))


def _busy_threads() -> list[str]:
    """Threads other than the main one and ours that are not parked (``_parked_code``): one
    inside a torch op, or any other code, may hold a lock the child would wait on forever."""
    ours = (threading.main_thread().ident, threading.get_ident())
    others = {t.ident: t.name for t in threading.enumerate()
              if t.ident not in ours and t.name != worker.THREAD_NAME}
    if not others:
        return []
    parked, frames = _parked_code(), sys._current_frames()
    return [name for ident, name in others.items()
            if ident not in frames or frames[ident].f_code not in parked]


class Forked:
    """The forked child, as much of ``subprocess.Popen`` as ``process._Worker`` uses."""

    def __init__(self, pid: int, stdin: BinaryIO, stdout: BinaryIO):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        return self._reap(0)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped by someone else's os.wait()
                pid, status = self.pid, None
            if pid:
                self.returncode = -1 if status is None else os.waitstatus_to_exitcode(status)
                self.stdin.close()
                self.stdout.close()
        return self.returncode


def start(niceness: int, log_fd: int, drop_env: tuple[str, ...], env: dict[str, str]) -> Forked:
    """Fork the worker: it reads job folders on its stdin and answers on a pipe of its own, as
    ``compile_worker.serve`` does in a new interpreter; what it prints outside a job goes to
    ``log_fd``. ``drop_env``: variables it must not keep; ``env``: ones it sets if unset."""
    to_child, to_us = os.pipe(), os.pipe()  # (read end, write end) each
    with torch_locks_held():  # (released in both processes as the block ends)
        pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.dup2(to_child[0], 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            for fd in (*to_child, to_us[0]):
                os.close(fd)
            _after_fork(drop_env, env)
            from . import compile_worker
            code = compile_worker.serve(niceness, answers_fd=to_us[1])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(to_child[0])
    os.close(to_us[1])
    return Forked(pid, os.fdopen(to_child[1], "wb"), os.fdopen(to_us[0], "rb"))


_PROGRAMS_STREAMS: list = []  # in the child: never flushed, never freed (see _after_fork)


def _after_fork(drop_env: tuple[str, ...], env: dict[str, str]) -> None:
    """In the child: standard streams of its own, its environment, and the program's objects
    left out of its collections (scanning them would copy every page that holds one).
    The program's stream objects may hold text it has not written yet (stdout redirected to
    a file is block-buffered): flushed here, it would be written twice. They are kept alive
    (freeing one flushes it) and no longer used; a logging handler that still holds one writes
    to fds 1 and 2, this worker's log, and the answers go to a pipe of their own."""
    gc.freeze()
    _PROGRAMS_STREAMS.extend((sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False),
                                                   line_buffering=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False),
                                                   line_buffering=True)
    _program_handlers_off()
    for name in drop_env:
        os.environ.pop(name, None)
    for name, value in env.items():
        os.environ.setdefault(name, value)
    compilers.compile_threads_from_environment()


def _program_handlers_off() -> None:
    """The program's Python signal handlers are the program's: one in the child (a Ctrl-C
    handler that saves a checkpoint, say) would run the program's code on its stale copy.
    Ctrl-C reaches the whole process group: the child ignores it (it leaves when the program
    closes its input); any other signal takes its default action."""
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except (OSError, ValueError):
            continue
        if callable(handler):
            signal.signal(number, signal.SIG_IGN if number == signal.SIGINT else signal.SIG_DFL)
