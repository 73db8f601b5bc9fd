"""Compat: the locks of torch's own Python code that the program's main thread takes in its
steps and the forked worker then needs, held by the forking thread across ``os.fork`` so
that the child never starts with one of them taken by a thread it does not have.

``torch.cuda._initialization_lock``: ``torch.manual_seed`` takes it on every call (through
``torch.cuda.manual_seed_all``'s queued call, CUDA or not), and Inductor's compile in the
worker takes it (``torch.cuda.current_device`` through its code cache's system info): a fork
while the program seeded left the worker waiting on it forever (seen in a test that seeds
every step; the candidate was lost after ``process.TIMEOUT``).
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_locks_held():
    """Hold torch's fork-sensitive Python locks (above) for the ``os.fork`` inside."""
    lock = getattr(torch.cuda, "_initialization_lock", None)
    if lock is None:
        yield
        return
    with lock:
        yield
