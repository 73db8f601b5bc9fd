"""Deferred writes: nothing that outlives a call changes before the call is known to succeed.

``heap.py``: the log kept during capture and the read-your-writes overlay of attributes and
globals; ``views.py``: the read-your-writes view of a written list or dict; ``writes.py``: one
record per kind of write; ``rebuild.py``: how the values they store (and the return value)
are rebuilt after the graph; ``render.py``: the commit as generated code; ``checks.py``:
what the commit checks before its first write (all-or-nothing)."""
from .checks import CommitRefused
from .heap import DELETED, ShadowHeap
from .views import ContainerView
from .rebuild import MalformedRebuild, Rebuild, lint
from .writes import Write, lint_writes

__all__ = ["CommitRefused", "ContainerView", "DELETED", "MalformedRebuild", "Rebuild", "ShadowHeap", "Write", "lint", "lint_writes"]
