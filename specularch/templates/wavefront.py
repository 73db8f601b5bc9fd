"""Running a planned structure by wavefront: the instances of one path at one height (all
their children done) run as one batched call of the path's row-wise form.

Results are kept per batch (a tensor with one row per instance, per output); a parent's
hole input is gathered from its children's batches with ``index_select`` (and ``cat`` when
they come from several batches). A path without a row-wise form runs its instances one by
one, each a batch of one row. Rounding may differ from eager (see rowwise.py); random ops
never get here (``Family.run`` evaluates those in eager's order).
"""
from __future__ import annotations

import torch

from .family import Plan, _arguments, ctx_tensor
from .rowwise import batched_form


class _Store:
    """Outputs of the batches run so far: ``batches[b]`` is a tuple of tensors (one per
    output of the path), ``where[i] = (b, row)`` for instance ``i``."""

    def __init__(self, count: int):
        self.batches: list[tuple] = []
        self.where: list = [None] * count

    def add(self, instances: list[int], outputs) -> None:
        b = len(self.batches)
        self.batches.append(outputs if isinstance(outputs, tuple) else (outputs,))
        for row, i in enumerate(instances):
            self.where[i] = (b, row)

    def gather(self, instances: list[int], slot: int) -> torch.Tensor:
        """Rows of output ``slot`` of ``instances``, in that order, as one tensor."""
        where = self.where
        first = where[instances[0]][0]
        rows = []
        for i in instances:
            b, r = where[i]
            if b != first:
                return self._from_batches(instances, slot)
            rows.append(r)
        return self._rows(first, slot, rows)

    def _from_batches(self, instances: list[int], slot: int) -> torch.Tensor:
        places = [self.where[i] for i in instances]
        order: dict[int, list[int]] = {}
        for b, r in places:
            order.setdefault(b, []).append(r)
        pieces = [self._rows(b, slot, rows) for b, rows in order.items()]
        position, offset = {}, 0
        for b, rows in order.items():
            for k, r in enumerate(rows):
                position[(b, r)] = offset + k
            offset += len(rows)
        joined = torch.cat(pieces)
        perm = [position[p] for p in places]
        if perm == list(range(len(perm))):
            return joined
        return joined.index_select(0, torch.tensor(perm, device=joined.device))

    def _rows(self, b: int, slot: int, rows: list[int]) -> torch.Tensor:
        out = self.batches[b][slot]
        n, start = len(rows), rows[0]
        if rows[-1] - start == n - 1 and rows == list(range(start, start + n)):
            return out if n == out.shape[0] else out.narrow(0, start, n)
        return out.index_select(0, torch.tensor(rows, device=out.device))

    def result(self, i: int, arity):
        b, row = self.where[i]
        outs = tuple(o if o.shape[0] == 1 else o.narrow(0, row, 1) for o in self.batches[b])
        return outs if arity is not None else outs[0]


def run_batched(family, plan: Plan, ctx: tuple) -> list:
    store = _Store(len(plan.paths))
    for (height, path_id), instances in _levels(plan):
        path = plan.paths[instances[0]]
        form = _form(path)
        if isinstance(form, str) or len(instances) == 1:
            for i in instances:
                store.add([i], path.gm.forward(*_one(path, ctx, plan, i, store)))
        else:
            store.add(instances, form.gm.forward(*_many(path, form, ctx, plan, instances, store)))
            family.stats["batches"] += 1
            family.stats["batched_instances"] += len(instances)
            family.stats["largest_batch"] = max(family.stats["largest_batch"], len(instances))
            family.last_call["batches"].append(len(instances))
        path.runs += len(instances)
    return [store.result(r, plan.paths[r].arity) for r in plan.roots]


def _form(path):
    if path.batched is None:
        path.batched = batched_form(path)
    return path.batched


def _levels(plan: Plan) -> list:
    groups: dict = {}
    for i, (path, height) in enumerate(zip(plan.paths, plan.heights)):
        groups.setdefault((height, id(path)), []).append(i)
    return sorted(groups.items(), key=lambda kv: kv[0][0])


def _one(path, ctx: tuple, plan: Plan, i: int, store: _Store) -> list:
    return _arguments(path, ctx, plan.nodes[i], plan.kids[i], _HoleOutputs(store, plan))


class _HoleOutputs:
    def __init__(self, store: _Store, plan: Plan):
        self.store, self.plan = store, plan

    def __getitem__(self, i):
        return self.store.result(i, self.plan.paths[i].arity)


def _many(path, form, ctx: tuple, plan: Plan, instances: list[int], store: _Store) -> list:
    args = []
    for position, inp in enumerate(path.inputs):
        if inp.kind == "ctx":
            args.append(ctx_tensor(ctx, inp.index))
        elif inp.kind == "node":
            values = [plan.nodes[i][inp.index] for i in instances]
            if position in form.number_dtypes:
                dtype, device, rank = form.number_dtypes[position]
                numbers = torch.tensor(values, dtype=dtype, device=device)
                args.append(numbers if rank == 1 else numbers.view(-1, *[1] * (rank - 1)))
            else:
                args.append(torch.cat(values))
        else:
            kids = [plan.kids[i][inp.index] for i in instances]
            args.append(store.gather(kids, inp.slot))
    return args
