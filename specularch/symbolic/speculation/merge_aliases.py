"""What a merged branch must not let anyone observe: that its result is a copy.

``branch_merge`` replaces the value a branch leaves behind with ``torch.where(c, a, b)``, a
new tensor. Eager hands out ``a`` or ``b`` itself, so the select is right only while nobody
can tell the two apart::

    if x.abs().max() > 10:      # merged: x = where(c, x / 10, x)
        x = x / 10
    return self.fc(x)           # fine: the merged x is only read
    return x                    # not fine: eager may return the argument itself

Every merged result is linked, by storage, to the tensors it selects between; the links form
classes of storages that eager may hold as one tensor and the graph holds as several. A class
is *live* in the storages that can still be reached after the branch: those that existed
before the (outermost) branch, tensors from outside the call, and the merged results (what
a side made and handed out is reachable only through the merged values). The capture is
refused (``data_dependent_branch``, the call runs eagerly) when the difference shows:

* ``a is b`` between two different tensors of one class;
* an in-place write, after the branch, into a class with two live storages (eager would
  write through both, or read what the other was given);
* a tensor from outside the call handed out by a side and written in place after the branch;
* two different storages of a class seen after the call, by return value or stored state,
  one of them a merged result (tensors from outside the call are always seen): identity or
  shared memory would differ.

Layout (strides, offset, type, inference flag) is checked when the select is made.
"""
from __future__ import annotations

import torch
import torch.fx

from .._torch_dispatch import storage_key
from ..values import TensorV


class MergedAliases:
    """The storage classes of one capture's merged branches (see the module docstring)."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        self.live: set[int] = set()
        self.visible: set[int] = set()          # storages of tensors from outside the call
        self.merged: dict[int, tuple] = {}      # merged result's storage -> (where node, branch)
        self.outside_sides: list[tuple] = []    # (TensorV, its node at the branch, branch)
        self._before: set[int] | None = None    # storages before the outermost merged branch
        self.what: dict[tuple, str] = {}        # branch -> what it tests (branch_merge.merge)

    # ---- while merging ------------------------------------------------------------------
    def begin(self, tracer) -> None:
        """An outermost branch is about to be merged: remember which storages exist."""
        if tracer.merging == 0:
            self._before = {storage_key(n.meta["example"]) for n in tracer.graph.nodes
                            if isinstance(n.meta.get("example"), torch.Tensor)}

    def record(self, tracer, result: TensorV, sides: tuple, outlives, at: tuple) -> None:
        r = storage_key(result.example)
        self.merged[r] = (result.node, at)
        self._find(r)
        if tracer.merging == 1:  # an inner branch's result is reached only through the outer's
            self.live.add(r)
        for t in sides:
            s = storage_key(t.example)
            self._union(r, s)
            if s in self._before or s in tracer._external:
                self.live.add(s)
            if outlives(tracer, t):
                self.visible.add(s)
                self.outside_sides.append((t, t.node, at))

    # ---- observations -------------------------------------------------------------------
    def identity(self, a, b) -> tuple | None:
        """The branch whose merge ``a is b`` would see through, or None."""
        if a is b or not (isinstance(a, TensorV) and isinstance(b, TensorV)) or not self.merged:
            return None
        ka, kb = storage_key(a.example), storage_key(b.example)
        if ka in self._parent and kb in self._parent and self._find(ka) == self._find(kb):
            return self._branch_of(self._find(ka))
        return None

    def at_end(self, tracer, escaping: list) -> tuple[str, tuple] | None:
        """(why, branch) when the finished capture lets a merge be seen; ``escaping`` are
        the example tensors that the return value and the stored state hand out."""
        if not self.merged:
            return None
        return self._outside_rewritten() or self._written(tracer) or self._escapes(escaping)

    def _outside_rewritten(self):
        for t, node, at in self.outside_sides:
            if t.node is not node:  # the shadow heap's functional copy replaced it
                return ("a tensor from outside the call that a side hands back is written in "
                        "place after the branch", at)
        return None

    def _written(self, tracer):
        order = {n: i for i, n in enumerate(tracer.graph.nodes)}
        for node in tracer.graph.nodes:
            if not node.meta.get("mutates"):
                continue
            for k in node.meta.get("writes") or _tensor_keys(node):
                if k not in self._parent or len(self._members(k) & self.live) < 2:
                    continue
                root = self._find(k)
                if any(order.get(n, -1) < order[node]
                       for m, (n, _) in self.merged.items() if self._find(m) == root):
                    return ("the merged tensor, or a tensor it may be in eager, is written in "
                            "place after the branch", self._branch_of(root))
        return None

    def _escapes(self, escaping: list):
        seen = self.visible | {storage_key(t) for t in escaping}
        for root in {self._find(k) for k in self.merged}:
            shown = self._members(root) & seen
            if len(shown) >= 2 and shown & self.merged.keys():
                return ("the merged tensor (or a view of it) is returned or stored, and eager "
                        "may hand out a tensor the caller also sees (identity and memory would "
                        "differ)", self._branch_of(root))
        return None

    # ---- union-find over storage keys ---------------------------------------------------
    def _find(self, k: int) -> int:
        self._parent.setdefault(k, k)
        while self._parent[k] != k:
            self._parent[k] = self._parent[self._parent[k]]
            k = self._parent[k]
        return k

    def _union(self, a: int, b: int) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self._parent[rb] = ra

    def _members(self, k: int) -> set[int]:
        root = self._find(k)
        return {m for m in list(self._parent) if self._find(m) == root}

    def _branch_of(self, root: int) -> tuple:
        return next(at for m, (_, at) in self.merged.items() if self._find(m) == root)


def _tensor_keys(node) -> set[int]:
    keys = set()
    for arg in (*node.args, *node.kwargs.values()):
        for a in (arg if isinstance(arg, (tuple, list)) else (arg,)):
            example = a.meta.get("example") if isinstance(a, torch.fx.Node) else None
            if isinstance(example, torch.Tensor):
                keys.add(storage_key(example))
    return keys
