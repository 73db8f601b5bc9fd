"""Whether a rolled loop's body, once its LSTM cells are fused (``rolled_cells.fuse``), is
nothing but a stack of them: what ``stack.py`` then runs as one autograd node for
the whole loop.

Such a body reads, per iteration, a row of what the prelude computed (``symbolic/rolled/fast.py``)
and the cells' carried states; each cell's input is that row or the new ``h`` of a cell
before it; it returns the cells' new ``(h, c)`` as the carried states, other carried values
and per-iteration outputs that are some cell's ``h`` or ``c``, and size checks (the
tracer's specialisation of the sizes the cells' Python code read). Between the nodes it
may have dropouts that return their input (``p=0``). Anything else (an activation between
two cells, a random draw, a check of values) keeps the body as it is.

The checks compare sizes with the sizes at capture. In a stack every tensor's size follows
from the sizes of the loop's inputs (the cells' initial states, the rows, the weights) and
each cell's new state has the size of its old one, so the plan keeps the capture's sizes of
those inputs: where a call's inputs have them, every check of every iteration holds.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ...guards.guard import same_value
from . import cells as rolled_cells
from ..randomness import is_identity_dropout


@dataclass(frozen=True)
class Cell:
    """One cell of the stack. ``x``: ``("row", r)`` (row ``t`` of the prelude's value ``r``)
    or ``("h", i)`` (the new ``h`` of cell ``i``, an earlier one); ``h``, ``c``: positions of
    its states among the carried values; ``weights``: positions among the loop's invariants,
    ``(w_hh, b_hh)`` for a cell given its input's projection (``projected``), else
    ``(w_ih, w_hh, b_ih, b_hh)``."""
    x: tuple
    h: int
    c: int
    weights: tuple
    projected: bool


@dataclass(frozen=True)
class Plan:
    """A stack body: its cells in the order an iteration runs them; per carried output and
    per per-iteration output, where it comes from (``("h", j)``, ``("c", j)``, or
    ``("carried", k)`` unchanged); and the sizes (and dtype) a call's inputs must have."""
    cells: tuple
    carried: tuple
    outputs: tuple
    state_shapes: tuple      # per cell: the shape of its h and c
    row_shapes: dict         # prelude value r -> the shape of one row
    weight_shapes: dict      # invariant position -> shape
    dtype: torch.dtype


def plan(body: torch.fx.GraphModule, carried: int, outputs: int, expected: tuple,
         invariants: list) -> Plan | None:
    """The stack ``body`` is (``carried`` loop-carried values, ``outputs`` per-iteration
    outputs, then the checks, each expected true), or None. ``invariants``: examples of the
    values the body's ``invariant_<k>`` placeholders stand for."""
    if any(e is not True for e in expected):
        return None
    try:
        return _Reader(body.graph, invariants).read(carried, outputs, len(expected))
    except (_NotAStack, IndexError, KeyError):  # (a node with fewer arguments than its kind)
        return None


class _NotAStack(Exception):
    pass


def _need(condition) -> None:
    if not condition:
        raise _NotAStack


class _Reader:
    """One walk over the body's nodes, giving each the kind of value it is."""

    def __init__(self, graph: torch.fx.Graph, invariants: list):
        self.graph, self.invariants = graph, invariants
        self.kind: dict = {}
        self.cells: list = []
        self.users: dict = {}    # carried position -> the cells that read it

    def read(self, carried: int, outputs: int, checks: int) -> Plan:
        for node in self.graph.nodes:
            if node.op == "output":
                return self._outputs(node.args[0], carried, outputs, checks)
            self.kind[node] = self._kind(node)
        raise _NotAStack

    def _kind(self, node: torch.fx.Node) -> tuple:
        if node.op == "placeholder":
            return _placeholder(node.name)
        _need(node.op in ("call_function", "call_method"))
        args = [self.kind.get(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
        _need(not node.kwargs or is_identity_dropout(node))
        if node.target in (operator.sub, operator.add) and args[0] == ("index",) \
                and type(args[1]) is int:
            return ("index",)
        if node.target is operator.getitem and _is(args[0], "rows") and args[1] == ("index",):
            return ("row", args[0][1])
        if node.op == "call_method" and node.target == "size":
            _need(len(args) == 2 and type(args[1]) is int and _tensor(args[0]))
            return ("size",)
        if node.target is same_value:
            _need(args[0] == ("size",) and type(args[1]) is int)
            return ("check",)
        if node.target in rolled_cells.UNFUSED:
            return self._cell(node, args)
        if node.target is operator.getitem and _is(args[0], "cell") and args[1] in (0, 1):
            return ("h" if args[1] == 0 else "c", args[0][1])
        if is_identity_dropout(node):
            _need(_tensor(args[0]) and not _is(args[0], "carried"))
            return args[0]
        raise _NotAStack

    def _cell(self, node: torch.fx.Node, args: list) -> tuple:
        projected = node.target is rolled_cells.fused_projected_cell
        grads, _site, x, hc, *weights = args
        _need(grads == ("grads",) and isinstance(hc, tuple) and len(hc) == 2)
        h, c = (self.kind.get(a) for a in node.args[3])
        _need(_is(h, "carried") and _is(c, "carried") and h != c)
        _need(_is(x, "row") or _is(x, "h") and x[1] < len(self.cells) and not projected)
        _need(all(_is(w, "inv") for w in weights))
        for state in (h, c):
            _need(state[1] not in self.users)
            self.users[state[1]] = len(self.cells)
        self.cells.append((node, Cell(x, h[1], c[1], tuple(w[1] for w in weights), projected)))
        return ("cell", len(self.cells) - 1)

    def _outputs(self, results: tuple, carried: int, outputs: int, checks: int) -> Plan:
        _need(isinstance(results, tuple) and len(results) == carried + outputs + checks)
        kinds = [self.kind.get(r) if isinstance(r, torch.fx.Node) else None for r in results]
        _need(all(k == ("check",) for k in kinds[carried + outputs:]))
        _need(all(_is(k, "h") or _is(k, "c") or _is(k, "carried") for k in kinds[:carried + outputs]))
        for k, source in enumerate(kinds[:carried]):
            if k in self.users:  # a cell's state: its new value
                j = self.users[k]
                _need(source == ("h" if self.cells[j][1].h == k else "c", j))
            elif source[0] == "carried":
                _need(source[1] == k)
        for source in kinds[carried:carried + outputs]:
            _need(source[0] != "carried")
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        for k in range(carried):  # a carried value no cell holds: read by nothing
            _need(k in self.users or not placeholders[f"carried_{k}"].users)
        return self._sizes([c for _, c in self.cells], self.invariants,
                           tuple(kinds[:carried]), tuple(kinds[carried:carried + outputs]))

    def _sizes(self, cells: list, invariants: list, carried: tuple, outputs: tuple) -> Plan:
        _need(cells)
        states: dict = {}
        rows: dict = {}
        for node, kind in self.kind.items():
            example = node.meta.get("example")
            if _is(kind, "h") or _is(kind, "c"):
                _need(isinstance(example, torch.Tensor) and example.dim() == 2
                      and example.device.type == "cpu")
                states.setdefault(kind[1], set()).add((tuple(example.shape), example.dtype))
            elif _is(kind, "row"):
                _need(isinstance(example, torch.Tensor))
                rows[kind[1]] = tuple(example.shape)
        # each cell's h and c, of one size (a carried value keeps its size:
        # symbolic/rolled/match.py)
        _need(all(len(states.get(j, ())) == 1 for j in range(len(cells))))
        shapes = [next(iter(states[j])) for j in range(len(cells))]
        weights = {}
        for cell in cells:
            for p in cell.weights:
                example = invariants[p]
                _need(isinstance(example, torch.Tensor))
                weights[p] = tuple(example.shape)
                shapes.append((None, example.dtype))
        dtypes = {dtype for _, dtype in shapes}
        _need(len(dtypes) == 1)
        return Plan(tuple(cells), carried, outputs, tuple(s for s, _ in shapes[:len(cells)]),
                    rows, weights, dtypes.pop())


def _placeholder(name: str) -> tuple:
    if name == "t":
        return ("index",)
    if name == "cell_grads":
        return ("grads",)
    for prefix, kind, offset in (("carried_", "carried", 0), ("invariant_", "inv", 1),
                                 ("prelude_", "rows", 0)):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return (kind, int(name[len(prefix):]) - offset)
    raise _NotAStack


def _is(kind, name: str) -> bool:
    return isinstance(kind, tuple) and bool(kind) and kind[0] == name


def _tensor(kind) -> bool:
    return any(_is(kind, name) for name in ("row", "carried", "h", "c"))

