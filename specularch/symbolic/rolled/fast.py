"""A rolled loop's body made cheaper to run, outside ``config.templates == "exact"``.

Two rewrites of the body ``GraphModule`` that ``loops.py`` built, each with a per-call
part that runs before the first rolled iteration (``RolledLoop.prepare``):

* **prelude**: what an iteration computes from the loop index and loop invariants alone
  (``embedding(tokens[t])``) runs once for all rolled iterations before the loop, on the
  rows ``1 .. n-1`` (``0 .. n-1``: ``first.py``) of the indexed tensor, and the body picks its row per iteration. An
  embedding looked up per iteration costs a full-table gradient (zeros plus a scatter) and
  a full-table addition per iteration in backward; looked up once it costs one.
  Only ops that act on each row independently and compute each row's numbers as they would
  alone move (``rolled_hoist.why_not_row_wise`` without the matrix products: elementwise ops,
  embeddings), never a random draw (dropout with ``p=0`` draws nothing and moves), and
  nothing at all from a body that writes in place (``rolled_hoist.body_writes``: ``buf.add_``
  per iteration, ``embedding(..., max_norm=)``): row ``t`` must be read as iteration ``t``
  finds it. An op that raises (an index past the end, out of an embedding's range) raises
  before the first rolled iteration instead of in iteration ``t``: the graph raised, so the
  call runs eagerly and raises eager's error (nothing was committed).
* **projections**: an ``lstm_cell`` whose input the prelude computes has its input
  projection ``x @ w_ih.T + b_ih`` computed in the prelude too, one product for all
  iterations (``project.py``: the one matrix product the prelude takes).
* **cells**: ``torch.lstm_cell`` with invariant weights becomes one autograd node per
  iteration, with one weight-gradient product per call (``fx_lower/rolled/cells.py``).
* **stack**: a body that is then nothing but a stack of such cells (each one's input the
  prelude's row or the previous one's ``h``: ``fx_lower/rolled/stack_plan.py``) runs as one
  autograd node for all iterations (``fx_lower/rolled/stack.py``, ``Prepare.whole``).

Forward values stay eager's bit for bit but for the projections (a product over all rows
may round differently); gradients are eager's up to rounding (summed in another order).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ...fx_lower.rolled import (cells as rolled_cells, stack as rolled_stack,
                                stack_plan as rolled_stack_plan)
from ...fx_lower.randomness import is_identity_dropout
from . import hoist as rolled_hoist, project as rolled_project


def _rows(tensor: torch.Tensor, n: int, first: int = 1) -> torch.Tensor:
    """``tensor[t]`` for ``t = first .. n-1`` (the rolled iterations), stacked; eager's
    IndexError when a row is missing. ``tensor`` may be the tuple of a tensor's rows
    (``rows.py``: ``x.unbind(d)``)."""
    if isinstance(tensor, tuple):
        if len(tensor) < n:
            raise IndexError(f"tuple index {n - 1} out of range")
        return torch.stack(tensor[first:n])
    if tensor.dim() == 0 or tensor.shape[0] < n:
        raise IndexError(f"index {n - 1} is out of bounds for dimension 0 with size "
                         f"{tensor.shape[0] if tensor.dim() else 0}")
    return tensor[first:n]


class Prepare:
    """Per call: the prelude's per-iteration rows, then the cells' weight sinks."""

    def __init__(self, prelude: torch.fx.GraphModule | None, reads: list,
                 cells: rolled_cells.FusedCells | None, projected: int = 0, first: int = 1,
                 stack: rolled_stack.Stack | None = None):
        self.prelude, self.reads, self.cells, self.first = prelude, reads, cells, first
        self.projected = projected  # cells whose input projection runs in the prelude
        self.stack = stack          # the body is a stack of those cells

    def __str__(self) -> str:
        done = []
        if self.prelude is not None:
            done.append(f"{len(self.prelude.frontier)} per-iteration values computed before the "
                        f"loop ({', '.join(self.prelude.frontier)})")
        if self.projected:
            done.append(f"{self.projected} LSTM input projections computed before the loop")
        if self.cells is not None:
            done.append(f"{len(self.cells.sites)} LSTM cells fused (one weight-gradient product "
                        "per call)")
        if self.stack is not None:
            done.append("the cells' stack run as one autograd node per call")
        return "; ".join(done)

    def whole(self, n: int, carried: tuple, invariants: tuple) -> tuple | None:
        """The loop's carried values and per-iteration outputs, all iterations run at once by
        the stack; None where the body must run per iteration instead."""
        if self.stack is None or n <= self.first:
            return None
        rows = () if self.prelude is None else \
            self.prelude(n, *[invariants[k] for k in self.reads])
        return self.stack(n - self.first, carried, invariants, rows)

    def __call__(self, n: int, invariants: tuple) -> tuple:
        if self.prelude is not None and n > self.first:
            stacked = self.prelude(n, *[invariants[k] for k in self.reads])
            invariants = (*invariants, *(s.unbind(0) for s in stacked))
        elif self.prelude is not None:  # no rolled iteration: nothing reads the rows
            invariants = (*invariants, *[()] * len(self.prelude.frontier))
        return self.cells(invariants) if self.cells is not None else invariants


def speed_up(body: torch.fx.GraphModule, invariants: list, report, first: int = 1,
             results: tuple = (0, 0, ()), every_row: bool = True) -> Prepare | None:
    """Rewrite ``body`` in place (see the module docstring) and say so in the loop's
    ``report``; ``invariants``: the outer graph's nodes the body's ``invariant_<k>``
    placeholders stand for; ``first``: the first iteration the body runs; ``results``: how
    many carried values and per-iteration outputs the body returns, and what its checks are
    expected to be; ``every_row``: whether the loop runs to its trip count (a loop that may
    stop early, ``exits.py``, gets no prelude: rows past where it stops may not exist, and
    eager never reads them). None when nothing changed."""
    names = [f"invariant_{k + 1}" for k in range(len(invariants))]
    split = every_row and rolled_project.split(body.graph, names)
    prelude, reads = _prelude(body, names, first) if every_row else (None, ())
    projected = rolled_project.unsplit(body.graph) if split else 0
    if split:
        body.recompile()
    cells = rolled_cells.fuse(body, names)
    if prelude is None and cells is None:
        return None
    stack = None if cells is None else rolled_stack_plan.plan(
        body, *results, [n.meta.get("example") for n in invariants])
    prepare = Prepare(prelude, reads, cells, projected, first,
                      None if stack is None else rolled_stack.Stack(stack))
    report.faster = f", {prepare}"
    return prepare


def _is_product(node: torch.fx.Node) -> bool:
    """A matrix product: on all rows at once it may round differently from row by row, and
    the loop's other ops do not (``_accumulate`` in test_rolled_loops.py is bit-equal)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in ("linear", "matmul", "mm", "bmm", "einsum") or node.target is operator.matmul


def _prelude_nodes(graph: torch.fx.Graph, index, invariants: set) -> list:
    pre: list = []
    row: set = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        inputs = node.all_input_nodes
        if node.target is operator.getitem and node.op == "call_function" \
                and len(node.args) == 2 and node.args[1] is index and node.args[0] in invariants \
                and isinstance(node.meta.get("example"), torch.Tensor):
            pass
        elif not inputs or not all(a in row or a in invariants for a in inputs) \
                or not any(a in row for a in inputs):
            continue
        elif rolled_project.is_projection(node):
            pass  # a product, but allowed to round differently (project.py)
        elif _is_product(node) or not is_identity_dropout(node) and \
                rolled_hoist.why_not_row_wise(node, row, index) is not None:
            continue
        pre.append(node)
        row.add(node)
    return pre


def _prelude(body: torch.fx.GraphModule, names: list, first: int) -> tuple:
    graph = body.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    index = placeholders.get("t")
    invariants = {placeholders[name] for name in names if name in placeholders}
    if rolled_hoist.body_writes(graph.nodes) is not None:
        return None, []  # the prelude would read the invariants before earlier iterations' writes
    pre = _prelude_nodes(graph, index, invariants)
    in_pre = set(pre)
    frontier = [n for n in pre if any(u not in in_pre for u in n.users)]
    if index is None or not frontier or all(n.target is operator.getitem for n in pre) \
            or not all(isinstance(n.meta.get("example"), torch.Tensor) for n in frontier):
        return None, []
    prelude, reads = _prelude_module(pre, frontier, index, [placeholders[name] for name in names],
                                     first)
    _pick_rows(graph, index, frontier, pre, first)
    body.recompile()
    return prelude, reads


def _prelude_module(pre: list, frontier: list, index, invariant_nodes: list, first: int) -> tuple:
    """The prelude as its own graph: ``(n, *invariants it reads) -> frontier values stacked``."""
    graph = torch.fx.Graph()
    n = graph.placeholder("n")
    env: dict = {}
    reads: list = []

    def arg(node):
        if node not in env:
            reads.append(invariant_nodes.index(node))
            env[node] = graph.placeholder(f"invariant_{len(reads)}")
        return env[node]
    for node in pre:
        if node.target is operator.getitem and node.args[1] is index:
            env[node] = graph.call_function(_rows, (arg(node.args[0]), n, first))
            continue
        args, kwargs = rolled_hoist.from_the_end(node)
        args, kwargs = torch.fx.map_arg((args, kwargs), arg)
        env[node] = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
    graph.output(tuple(env[f] for f in frontier))
    _placeholders_first(graph)
    graph.lint()
    gm = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="RolledPrelude")
    gm.meta["constructed_by"] = "specularch.symbolic.rolled.fast"
    gm.frontier = [f.name for f in frontier]
    return gm, reads


def _pick_rows(graph: torch.fx.Graph, index, frontier: list, pre: list, start: int) -> None:
    """The body reads row ``t - start`` of each frontier value's per-iteration list (its
    last inputs) instead of computing it."""
    lists = [graph.placeholder(f"prelude_{k}") for k in range(len(frontier))]
    _placeholders_first(graph)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        row = graph.call_function(operator.sub, (index, start))
        for node, rows in zip(frontier, lists):
            picked = graph.call_function(operator.getitem, (rows, row))
            picked.meta = dict(node.meta)
            node.replace_all_uses_with(picked)
    for node in reversed(pre):
        if not node.users:
            graph.erase_node(node)
    graph.lint()


def _placeholders_first(graph: torch.fx.Graph) -> None:
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(node)
