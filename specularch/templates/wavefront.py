"""Running a planned structure by wavefront: the instances of one path at one height (all
their children done) run as one batched call of the path's row-wise form.

Results are kept per batch (a tensor with one row per instance, per output); a parent's
hole input is gathered from its children's batches (``cat`` when they come from several,
then ``narrow`` or ``index_select``). A level of one instance runs the row-wise form too; a
path without one runs its instances one by one, each a batch of one row. The row-wise
forms' linears leave large weights' gradients to ``weight_grads.py`` (one per call).
Rounding may differ from eager (see rowwise.py); random ops never get here (``Family.run``
evaluates those in eager's order).
"""
from __future__ import annotations

import collections

import torch

from .family import Plan, _arguments, ctx_tensor
from .rowwise import batched_form
from .weight_grads import SharedWeights, defer


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

    def select(self, instances: list[int]) -> tuple:
        """Where the rows of ``instances`` are, in that order: ``(batches, rows)``, the
        batches they come from and ``rows`` (``(start, count)`` for a run of one batch's
        rows, else an index into the batches' outputs joined). One selection serves every
        output slot of the children (the ``h`` and ``c`` of a TreeLSTM's child)."""
        places = [self.where[i] for i in instances]
        used = sorted({b for b, _ in places})
        if len(used) == 1:
            rows = [r for _, r in places]
            start, n = rows[0], len(rows)
            if rows[-1] - start == n - 1 and rows == list(range(start, start + n)):
                return used, (start, n)
        else:
            offsets, total = {}, 0
            for b in used:
                offsets[b] = total
                total += self.batches[b][0].shape[0]
            rows = [offsets[b] + r for b, r in places]
            if rows == list(range(total)):
                return used, (0, total)
        device = self.batches[used[0]][0].device
        return used, torch.tensor(rows, device=device)

    def take(self, selection: tuple, slot: int) -> torch.Tensor:
        """Output ``slot`` of the selected rows, as one tensor: the batches' outputs joined
        whole and one ``narrow`` or ``index_select``, two ops (and their two backward
        nodes) however many batches the rows come from."""
        used, rows = selection
        outs = [self.batches[b][slot] for b in used]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if not isinstance(rows, tuple):
            return out.index_select(0, rows)
        start, n = rows
        return out if start == 0 and n == out.shape[0] else out.narrow(0, start, n)

    def result(self, i: int, arity):
        b, row = self.where[i]
        outs = tuple(o if o.shape[0] == 1 else o.narrow(0, row, 1) for o in self.batches[b])
        return outs if arity is not None else outs[0]


def run_batched(family, plan: Plan, ctx: tuple) -> list:
    store = _Store(len(plan.paths))
    levels = _levels(plan)
    weights = SharedWeights(collections.Counter(path_id for (_, path_id), _ in levels))
    for (height, path_id), instances in levels:
        path = plan.paths[instances[0]]
        form = _form(path)
        if isinstance(form, str):
            for i in instances:
                store.add([i], path.gm.forward(*_one(path, ctx, plan, i, store)))
            path.runs += len(instances)
            continue
        # a level of one instance runs the batched form too: its weights' gradients are
        # then made with the other levels' (weight_grads.py)
        args = _many(path, form, ctx, plan, instances, store, weights)
        store.add(instances, form.gm.forward(*args))
        if len(instances) > 1:
            family.stats["batches"] += 1
            family.stats["batched_instances"] += len(instances)
            family.stats["largest_batch"] = max(family.stats["largest_batch"], len(instances))
            family.last_call["batches"].append(len(instances))
        path.runs += len(instances)
    return [store.result(r, plan.paths[r].arity) for r in plan.roots]


def _form(path):
    if path.batched is None:
        form = batched_form(path)
        if not isinstance(form, str):
            ctx_inputs = {i: inp.kind == "ctx" for i, inp in enumerate(path.inputs)}
            form.gm, form.deferred = defer(form.gm, ctx_inputs)
        path.batched = form
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


def _many(path, form, ctx: tuple, plan: Plan, instances: list[int], store: _Store,
          weights: SharedWeights) -> list:
    args, rows, selections = [], [], {}
    for position, inp in enumerate(path.inputs):
        if inp.kind == "ctx":
            tensor = ctx_tensor(ctx, inp.index)
            if position in form.deferred:
                tensor, used = weights.get(inp.index, tensor, path)
                rows.append(used)
            args.append(tensor)
        elif inp.kind == "node":
            values = [plan.nodes[i][inp.index] for i in instances]
            if position in form.number_dtypes:
                dtype, device, rank = form.number_dtypes[position]
                numbers = torch.tensor(values, dtype=dtype, device=device)
                args.append(numbers if rank == 1 else numbers.view(-1, *[1] * (rank - 1)))
            else:
                args.append(torch.cat(values))
        else:
            selection = selections.get(inp.index)
            if selection is None:
                kids = [plan.kids[i][inp.index] for i in instances]
                selection = selections[inp.index] = store.select(kids)
            args.append(store.take(selection, inp.slot))
    return args + rows
