"""The commit's replayed in-place ops (``ReplayTensor``, made by ``symbolic/commit_inplace.py``)
as generated code: the same op on many tensors becomes one ``torch._foreach_*_`` call.

    s43.mul_(s38); s43.add_(R[0], alpha=1); s6.add_(s43, alpha=n0)     (parameter 0)
    s45.mul_(s38); s45.add_(R[1], alpha=1); s7.add_(s45, alpha=n0)     (parameter 1)
  →
    FOREACH_MUL_((s43, s45), s38); FOREACH_ADD_((s43, s45), (R[0], R[1]), alpha=1)
    FOREACH_ADD_((s6, s7), (s43, s45), alpha=n0)

The ops are reordered only where that cannot change what one reads: each op is placed by its
depth, after the ops that write its target or what it reads, and after the ops that read its
target (the same ordering as ``fx_lower/foreach.py``). On CPU a foreach op is the per-tensor op
run in a C++ loop: the same kernels on the same operands, so the same bits, each target's
version bumped once, as eager's per-tensor ops do (``tests/test_fx_passes.py`` checks each
form). Only plain dense CPU floating tensors of one dtype and shape are batched.
"""
from __future__ import annotations

from ..fx_lower._torch_foreach import foreach_op
from .rebuild import Scratch

# method -> (foreach op, form of its operands): "t" a tensor, "n" a number; a keyword as
# "name=n". ``same``: the operand positions that must be the same expression in a group;
# the others become lists (tensors, or numbers where the foreach op takes a scalar list).
_FOREACH = {
    ("add_", ("t",)): ("add", ()), ("add_", ("t", "alpha=n")): ("add", ("alpha",)),
    ("sub_", ("t",)): ("sub", ()), ("sub_", ("t", "alpha=n")): ("sub", ("alpha",)),
    ("add_", ("n",)): ("add", ()), ("sub_", ("n",)): ("sub", ()),
    ("mul_", ("t",)): ("mul", ()), ("mul_", ("n",)): ("mul", ()),
    ("div_", ("t",)): ("div", ()), ("div_", ("n",)): ("div", ()),
    ("lerp_", ("t", "n")): ("lerp", (1,)),
    ("addcmul_", ("t", "t", "value=n")): ("addcmul", ()),
    ("addcdiv_", ("t", "t", "value=n")): ("addcdiv", ()),
}


# A replayed tensor this large (bytes) makes the commit run its ops in program order
# (``replay_lines``): about a quarter of a typical L2 cache times the few tensors one
# parameter's update touches, so they stay cached from one op to the next.
_LARGE_BYTES = 1 << 20

# Dtypes whose foreach ops round a Python-number operand to the dtype before using it (CPU:
# ``_foreach_mul_(bf16 tensors, 0.3)`` multiplies by bfloat16(0.3); ``t.mul_(0.3)`` by 0.3):
# their ops with a number operand replay one by one, as eager's.
_ROUNDS_NUMBERS = frozenset({"torch.bfloat16", "torch.float16"})

# The foreach ops, by the names the entry calls them (``render.COMMIT_NAMESPACE``).
NAMESPACE = {f"FOREACH_{name.upper()}_": foreach_op(name, True)
             for name in sorted({rule[0] for rule in _FOREACH.values()})}


class _Op:
    """One replayed op; ``makes``: it binds a scratch target (``D0 = s57.sqrt()``, its
    first arg the tensor it reads) instead of updating it in place."""

    def __init__(self, write, method: str, args: list, kwargs: list, target: str,
                 makes: bool = False):
        self.write, self.method, self.args, self.kwargs, self.target = write, method, args, kwargs, target
        self.makes = makes

    def call(self) -> str:
        if self.makes:
            operands = self.args[1:] + [f"{k}={v}" for k, v in self.kwargs]
            return f"{self.target} = {self.args[0]}.{self.method}({', '.join(operands)})"
        operands = self.args + [f"{k}={v}" for k, v in self.kwargs]
        return f"{self.target}.{self.method}({', '.join(operands)})"


def replay_lines(render, writes: list, plain: bool) -> list[str]:
    """The replayed ops under no_grad (the results need no autograd: checked at capture), on
    one line (the entry indents commit lines once), then the extra version bumps."""
    if not writes:
        return []
    ops, extra = [], []
    for w in writes:
        target = render.expr(w.target)
        for method, args, kwargs in w.ops:
            ops.append(_Op(w, method, [render.expr(a) for a in args],
                           [(k, render.expr(v)) for k, v in kwargs], target, w.makes))
        if not isinstance(w.target, Scratch):  # (a scratch tensor has no version to keep)
            extra += [target] * w.bumps
    # Large tensors run in program order, one op at a time, as eager's per-parameter loop:
    # a parameter's few tensors stay in the cache from one op to the next, where one
    # foreach call per op (or the same op on every tensor, reordered) streams them all
    # through memory once per op; a scratch tensor is freed after its last use.
    large = any(w.nbytes >= _LARGE_BYTES for w in writes)
    groups = [[op] for op in ops] if large else _groups(ops, plain)
    calls = [_group_call(render, g) if len(g) > 1 else g[0].call() for g in groups]
    lines = [f"with NO_GRAD(): {'; '.join(_freeing(calls, groups))}"]
    if extra:
        lines.append(f"BUMP_VERSIONS(({', '.join(extra)}, ))")
    return lines


def _freeing(calls: list[str], groups: list[list[_Op]]) -> list[str]:
    """``calls`` with each scratch tensor deleted after the last call that uses it (the
    entry's locals live until it returns)."""
    scratch = {op.target for g in groups for op in g if op.makes}
    last = {}
    for i, g in enumerate(groups):
        for op in g:
            for name in {op.target, *op.args, *(v for _, v in op.kwargs)} & scratch:
                last[name] = i
    freed = {}
    for name, i in last.items():
        freed.setdefault(i, []).append(name)
    out = []
    for i, call in enumerate(calls):
        out.append(call)
        if i in freed:
            out.append(f"del {', '.join(sorted(freed[i]))}")
    return out


def _groups(ops: list[_Op], plain: bool) -> list[list[_Op]]:
    """The ops in an order with the same reads and writes, in groups of one foreach call."""
    targets = {op.target for op in ops}
    depth, written, read = {}, {}, {}  # target -> depth of its last writer / last reader
    for i, op in enumerate(ops):
        reads = {a for a in [*op.args, *(v for _, v in op.kwargs)] if a in targets}
        depth[i] = max(1 + max([written.get(op.target, -1), *(written.get(r, -1) for r in reads)]),
                       read.get(op.target, -1) + 1)
        written[op.target] = depth[i]
        for r in reads:
            read[r] = max(read.get(r, -1), depth[i])
    # Ops of one depth touch nothing another of them does: any order among them is eager's
    buckets: dict = {}
    for i in sorted(range(len(ops)), key=depth.__getitem__):  # stable: program order
        key = _key(ops[i], depth[i]) if plain else None
        bucket = buckets.setdefault((depth[i], i) if key is None else key, [])
        if any(op.target == ops[i].target for op in bucket):  # (a target twice: not batched)
            bucket = buckets.setdefault((depth[i], i), [])
        bucket.append(ops[i])
    return list(buckets.values())


def _key(op: _Op, depth: int):
    """Ops with equal keys are one foreach call; None: not batchable."""
    form = op.write.form  # (operand kinds, dtype), or () where not batchable
    rule = _FOREACH.get((op.method, form[0])) if form and not op.makes else None
    if rule is None or form[1] in _ROUNDS_NUMBERS and any("n" in kind for kind in form[0]):
        return None
    same = tuple(op.args[s] if isinstance(s, int) else dict(op.kwargs)[s] for s in rule[1])
    return depth, op.method, form, same


def _group_call(render, group: list[_Op]) -> str:
    first = group[0]
    name, same = _FOREACH[(first.method, first.write.form[0])]
    fn = f"FOREACH_{name.upper()}_"
    parts = [f"({', '.join(op.target for op in group)}, )"]
    for i, kind in enumerate(first.write.form[0][:len(first.args)]):
        values = [op.args[i] for op in group]
        if i in same or (kind == "n" and len(set(values)) == 1):
            parts.append(values[0])
        else:
            parts.append(f"({', '.join(values)}, )" if kind == "t" else f"[{', '.join(values)}]")
    for j, (k, v) in enumerate(first.kwargs):
        values = [op.kwargs[j][1] for op in group]
        if k in same or len(set(values)) == 1:
            parts.append(f"{k}={v}" if k in same else v)
        else:
            parts.append(f"[{', '.join(values)}]")  # addcdiv_'s value: a scalar list
    return f"{fn}({', '.join(parts)})"
