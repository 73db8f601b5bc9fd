"""Compat: glibc's ``mallopt``, to fix the heap's thresholds before a compiled candidate is timed.

PyTorch allocates CPU tensors with ``malloc``. glibc serves a large block with its own
``mmap`` (unmapped again when freed) and returns free memory at the top of the heap to the
system (``trim``); both thresholds adapt to the program as it runs (up to 32 MiB and 64
MiB). How well they adapt depends on the order in which blocks are allocated and freed: for
eager's kernels it settles, but for a compiled forward and backward (``fx_lower/split.py``)
it did not, and every call mapped its memory anew. Measured on LeNet's forward and backward
(batch 50, 1 thread): TorchScript's parts 549-587 page faults per call each, 3.5 / 3.3 ms
against eager's 2.3 / 2.0 ms and no fault; with the thresholds fixed at the top of glibc's
own range, no fault and 2.5 / 2.2 ms, and pinned Inductor's forward went from 0.83-0.86x to
1.05-1.10x eager (docs/tiering.md).

``tune`` sets them (``M_MMAP_THRESHOLD`` 32 MiB, ``M_TRIM_THRESHOLD`` 64 MiB: at most 64 MiB
of freed memory stays with the process instead of going back to the system) once per
process: in the tiered mode before a graph's first compiled candidate is timed
(``tiering/trial.py``), for a pinned compiling backend when its first graph is compiled
(``dispatch/misses.py``); option ``tune_malloc``. Not where the program chose itself:
glibc's ``MALLOC_*_`` variables set, another allocator preloaded (jemalloc, tcmalloc,
mimalloc), or not glibc at all.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TRIM_THRESHOLD = 64 << 20  # twice that, as glibc's adaptive thresholds keep them
_CHOSEN = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_lock = threading.Lock()
_done: str | None = None  # what ``tune`` did or why it did nothing, once it ran


def refusal() -> str | None:
    """Why the thresholds are left as they are, or None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    preloaded = os.environ.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preloaded:
            return f"{name} is preloaded"
    chosen = [v for v in _CHOSEN if v in os.environ]
    if chosen:
        return f"the program set {', '.join(chosen)}"
    return None


def tune() -> tuple[str, bool]:
    """Fix glibc's thresholds (once per process); returns what was done, or why not, and
    whether it was this call that did it."""
    global _done
    with _lock:
        if _done is not None:
            return _done, False
        _done = _tune()
        return _done, True


def tune_logged(when: str) -> None:
    """``tune``, logged (under ``graphs``) by the call that did it, saying ``when``."""
    done, now = tune()
    if now:
        from . import log
        log.emit("graphs", f"{when}: {done}")


def _tune() -> str:
    why = refusal()
    if why is not None:
        return f"left as they are: {why}"
    try:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError) as e:
        return f"left as they are: no mallopt ({e})"
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "left as they are: mallopt refused"
    return f"glibc malloc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
