"""A rolled loop's iteration 0 run by its body too, where it is the body's own work.

``loops.py`` captures iteration 0 into the outer graph (it tells the loop-carried
values apart) and rolls iteration 1 into the body, run for ``t = 1 .. n-1``. Left in the
graph, iteration 0 is a second copy of the body's ops outside the body's rewrites
(``fast.py``): its own embedding lookup and gradient, its cells as unfused autograd
ops with their own weight-gradient products and accumulations. Where iteration 0's nodes
are the body's nodes one for one, with ``t`` as ``start`` and each carried input as the
value the loop found before its first iteration, the body runs for ``t = 0 .. n-1`` from
those values instead and iteration 0's nodes leave the graph.

Only where iteration 0 did nothing the graph does not show (no shadow-heap write, no
assumption: ``_Loop.run`` checks), and where nothing but the loop reads its values. The
body runs the same ops on the same values in the same order, so results stay eager's up to
the body's rewrites' rounding; ``templates="exact"`` keeps iteration 0 in the graph.
"""
from __future__ import annotations

import torch
import torch.fx

_PASS = ("placeholder", "get_attr")


class Folded:
    """What running iteration 0 in the body changes: the carried values' initial nodes
    (None for a carried input the body does not read) and iteration 0's nodes to drop."""

    def __init__(self, initial: list, nodes: list, checks: list):
        self.initial, self.nodes, self.checks = initial, nodes, checks


def fold(first_nodes: list, first_checks: list, body_nodes: list, index_node: torch.fx.Node,
         start: int, entries: list, appends: list, assertions: list,
         body_checks: list) -> Folded | None:
    """``Folded`` where iteration 0 (``first_nodes``, which assumed ``first_checks``) is the
    body (``body_nodes``, iteration 1, which checks ``body_checks`` per iteration) for
    ``t = start``; None where it is not (it then stays in the graph)."""
    first = [n for n in first_nodes if n.op not in _PASS]
    body = [n for n in body_nodes if n.op not in _PASS]
    work0, work1 = [n for n in first if not _aux(n)], [n for n in body if not _aux(n)]
    if not work0 or len(work0) != len(work1):
        return None
    heads = {h.node: k for k, (h, _, _) in enumerate(entries)}
    pairing = _Pairing(set(first), heads, index_node, start)
    if not all(pairing.same(a0, a1) for a0, a1 in zip(work0, work1)):
        return None
    checked = {c[0] for c in first_checks}
    if not all(pairing.aux(a0, [n for n in body if _aux(n)]) or not a0.users and a0 not in checked
               for a0 in first if _aux(a0)):
        return None
    pair = pairing.pair
    # each carried value iteration 0 leaves must be what the body computes for it
    if any(pair.get(a.node) is not h.node for h, a, _ in entries):
        return None
    # an appended value: iteration 0's is its list's last head item, which the body gives now
    if any(not items or pair.get(a.node) is not getattr(items[-1], "node", None)
           for _, items, a in appends):
        return None
    if not _checked_by_body(first_checks, body_checks, pair):
        return None
    if any(pred in pairing.first for pred, *_ in assertions
           if not any(pred is c[0] for c in first_checks)):
        return None
    if not _read_only_by_loop(first, pairing.first, set(body_nodes)):
        return None
    in_body = set(body_nodes)
    if any(k not in pairing.initial and any(u in in_body for u in h.node.users)
           for k, (h, _, _) in enumerate(entries)):
        return None  # a carried input the body reads but iteration 0 showed no value for
    return Folded([pairing.initial.get(k) for k in range(len(entries))], first, first_checks)


class _Pairing:
    """Iteration 0's node for each body node, and the values the body's carried inputs
    stand for in iteration 0."""

    def __init__(self, first: set, heads: dict, index_node, start: int):
        self.first, self.heads, self.index, self.start = first, heads, index_node, start
        self.pair: dict = {}     # body node -> iteration 0's
        self.initial: dict = {}  # carried k -> the node it held before the loop

    def same(self, a0: torch.fx.Node, a1: torch.fx.Node) -> bool:
        if a0.op != a1.op or a0.target != a1.target or a0.kwargs.keys() != a1.kwargs.keys():
            return False
        if not self._args(a0.args, a1.args) or \
                not all(self._args(a0.kwargs[k], a1.kwargs[k]) for k in a1.kwargs):
            return False
        self.pair[a1] = a0
        return True

    def aux(self, a0: torch.fx.Node, candidates: list) -> bool:
        """Pair a size read or a check of iteration 0 with the body's like one, if any."""
        for a1 in candidates:
            initial = dict(self.initial)
            if a1 not in self.pair and self.same(a0, a1):
                return True
            self.initial = initial
        return False

    def _args(self, x0, x1) -> bool:
        if isinstance(x1, (tuple, list)):
            return type(x0) is type(x1) and len(x0) == len(x1) and \
                all(self._args(a, b) for a, b in zip(x0, x1))
        if isinstance(x1, dict):
            return isinstance(x0, dict) and x0.keys() == x1.keys() and \
                all(self._args(x0[k], x1[k]) for k in x1)
        if not isinstance(x1, torch.fx.Node):
            return type(x0) is type(x1) and x0 == x1
        return self._node(x0, x1)

    def _node(self, x0, x1: torch.fx.Node) -> bool:
        if x1 is self.index:
            return type(x0) is int and x0 == self.start
        if x1 in self.pair:
            return x0 is self.pair[x1]
        if x1 in self.heads:  # a carried input: in iteration 0, the value before the loop
            k = self.heads[x1]
            if not isinstance(x0, torch.fx.Node) or x0 in self.first:
                return False
            return self.initial.setdefault(k, x0) is x0
        return x0 is x1 and x1 not in self.first  # an invariant: the same node


def _aux(node: torch.fx.Node) -> bool:
    """A size read or a check (no tensor): iteration 0 and the body make them apart from the
    work (the body checks its carried values' sizes, iteration 0's were guards)."""
    example = node.meta.get("example")
    if isinstance(example, (torch.Tensor, tuple, list)):
        return False
    return node.op == "call_method" and node.target in ("size", "dim", "numel") \
        or example is not None or getattr(node.target, "__module__", "").startswith("specularch.guards")


def _checked_by_body(first_checks: list, body_checks: list, pair: dict) -> bool:
    """Whether each assumption iteration 0 made is one the body checks in every iteration
    (so in iteration 0 too once it runs it)."""
    of_first = {a0: a1 for a1, a0 in pair.items()}
    checked = {(pred, expected) for pred, expected, *_ in body_checks}
    return all((of_first.get(pred), expected) in checked for pred, expected, *_ in first_checks)


def _read_only_by_loop(first: list, in_first: set, in_body: set) -> bool:
    """Whether iteration 0's values reach nothing but iteration 0 and iteration 1 (which
    leaves the graph; the rolled node and the lists' joins are not made yet)."""
    return all(u in in_first or u in in_body for node in first for u in node.users)


def drop(graph: torch.fx.Graph, folded: Folded, assertions: list) -> None:
    """Erase iteration 0's nodes (last first), now that nothing reads them, and its
    assumptions, now that the body checks them."""
    assertions[:] = [a for a in assertions if not any(a is c for c in folded.checks)]
    for node in reversed(folded.nodes):
        if node.users:
            raise RuntimeError(f"iteration 0's {node.name} is still read after the fold")
        graph.erase_node(node)


def first_row(folded: Folded | None) -> int:
    """The first iteration the body runs."""
    return 1 if folded is None else 0
