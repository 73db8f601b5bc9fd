"""Rolled loops: ``for t in range(n)`` with a symbolic ``n`` is captured once, whatever ``n``.

Unrolling such a loop makes one graph per trip count (then ``cache_limit``). Instead, at its
``FOR_ITER``:

1. iteration 0 runs symbolically as any code does (``t`` is ``0``), into the graph;
2. iteration 1 runs with ``t`` a symbolic index (``LoopIndexV``) and its nodes are recorded;
3. the loop is *regular* when what iteration 1 left in the frame has the shape of what it
   found there (same Python values, tensors of the same size/dtype, the same aliasing) and
   it touched nothing else (no shadow-heap write, no assumption, no list read that grows):
   every later iteration would then record the same nodes. Tensors that changed are the
   loop-carried values; tensors appended to a list once per iteration are per-iteration
   outputs;
4. iteration 1's nodes move into a body ``GraphModule`` (index, carried values, invariants
   in; new carried values, per-iteration outputs out) and one node ``RolledLoop(n, carried,
   invariants)`` runs it for ``t = 1 .. n-1`` when the graph runs. The graph is guarded on
   ``n >= 1`` only.

Autograd records the body's ops at run time like any graph op, in eager's order, so
gradients and random draws are eager's bit for bit. A loop that is not regular, or whose
results are then used in a way the rolled form does not support, raises ``RollRefused``:
capture starts again with that loop unrolled (``capture.py``), and ``explain()`` says why.
"""
from __future__ import annotations

import collections
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ...fx_lower.op_kinds import LAYOUT_WRITES, op_name
from ...fx_lower.randomness import is_random_node
from ...records import AssumptionBroken, Unsupported
from . import (exits as rolled_exits, fast as rolled_fast, first as rolled_first,
               hoist as rolled_hoist, lists as rolled_lists)
from .match import Match, Snapshot, append_only, set_slot
from ..values.rolled import (INDEX_AS_PYTHON as _INDEX_AS_PYTHON, LoopIndexV, RolledListV,
                             RollRefused, SymRangeIterV, become_rolled)
from ..values.scalar import ScalarV
from ..values.symint import SymV, arithmetic, compare
from ..values import ConstV, TensorV, TupleV, Value

# Bytecode that makes an iteration leave the loop or write state the frame does not show.
_NOT_IN_BODY = {"RETURN_VALUE", "YIELD_VALUE", "STORE_DEREF", "DELETE_DEREF", "STORE_GLOBAL",
                "DELETE_GLOBAL", "DELETE_FAST", "IMPORT_NAME"}


@dataclass
class LoopReport:
    """One loop of a capture, for ``explain()``: rolled (with the trip count of each call
    through the graph) or unrolled (and why)."""

    where: str
    rolled: bool
    why: str = ""
    site: tuple = ()                     # (id(code), offset of FOR_ITER)
    body_ops: int = 0
    carried: int = 0
    outputs: int = 0
    hoisted: int = 0                     # body ops moved after the loop (hoist.py)
    not_hoisted: str = ""                # why an appended value is computed in the body
    faster: str = ""                     # how the body was rewritten to run faster (fast.py)
    trips: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    form: str = "range(n)"               # what the loop iterates
    within: str = ""                     # where an inner loop is, in its outer loop
    iterations: int = 0                  # of an unrolled loop noted by unrolled.py

    def __str__(self) -> str:
        form = f"{self.form}, {self.within}" if self.within else self.form
        if self.iterations:
            form += f", {self.iterations} iterations captured"
        if not self.rolled:
            return f"unrolled loop at {self.where} ({form}): {self.why}"
        hoisted = (f", {self.hoisted} ops hoisted after the loop" if self.hoisted else
                   f" (nothing hoisted: {self.not_hoisted})" if self.not_hoisted else "")
        return (f"rolled loop at {self.where} ({form}): body {self.body_ops} ops, {self.carried} carried, "
                f"{self.outputs} stacked{hoisted}{self.faster}; trip counts of the last calls: "
                f"{list(self.trips)}")


class RolledLoop:
    """The graph node's target: runs the body for ``t = first .. n-1`` (iteration 0 is in
    the graph, or run by the body: ``first.py``), feeding each iteration's carried
    values to the next."""

    __name__ = "rolled_loop"

    def __init__(self, body: torch.fx.GraphModule, carried: int, outputs: int, expected: tuple,
                 report: LoopReport, assumption: tuple | None = None):
        self.body, self.carried, self.outputs, self.report = body, carried, outputs, report
        self.expected = expected  # what the body's assumptions (sizes, tensor branches) were
        self.assumption = assumption  # (where, site) of the entry's check of them
        self.prepare = None       # per call: (n, invariants) -> the body's (fast.py)
        self.run_body = None      # or the body compiled (fx_lower/rolled/compiled.py)
        self.first = 1            # 0 where iteration 0 runs in the body too
        self.exit = None          # the position of its exit check among the checks (exits.py)
        self.first_expected = True  # iteration 0's exit test's no-break outcome (exits.py)

    def __call__(self, n: int, carried: tuple, invariants: tuple, stopped=None) -> tuple:
        if self.exit is not None:
            return rolled_exits.run_until_exit(self, n, carried, invariants, stopped)
        self.report.trips.append(n)
        if self.run_body is None and self.prepare is not None:
            whole = self.prepare.whole(n, carried, invariants)  # (fast.py: a stack)
            if whole is not None:
                return (*whole, True) if self.expected else whole
        step, k, o = self.run_body or self.body.forward, self.carried, self.outputs
        invariants = self.prepare(n, invariants) if self.prepare is not None else invariants
        outs: tuple = tuple([] for _ in range(o))
        for t in range(self.first, n):
            results = step(t, *carried, *invariants)
            carried = results[:k]
            for out, value in zip(outs, results[k:k + o]):
                out.append(value)
            if not all(bool(v) is e for v, e in zip(results[k + o:], self.expected)):
                # what follows the loop must not run on partial lists: the entry's failed
                # assumption, raised (the flag below is True whenever the loop returns)
                raise AssumptionBroken(*self.assumption)
        return (*carried, *outs, True) if self.expected else (*carried, *outs)


def row_at(rows: tuple, last: torch.Tensor) -> torch.Tensor:
    """``rows[last]`` with ``last`` the 0-d index a loop that stopped early returns."""
    return rows[int(last)]


def _join(head: list, tail: list) -> list:
    return [*head, *tail]


def _plus(tracer, index: Value, c: int) -> Value:
    """``index + c`` (``enumerate``'s counter from ``c``), symbolic where ``index`` is."""
    if not c:
        return index
    if isinstance(index, ConstV):
        return ConstV(index.value + c)
    return arithmetic(tracer, operator.add, index, ConstV(c))


def _loop_index(site: tuple) -> int:  # stands for ``t`` while iteration 1 is captured
    raise RuntimeError("a rolled loop's index node was left in the graph")


# ---- where loops are rolled ------------------------------------------------------------------
def symbolic_range(tracer, args: list, kwargs: dict) -> Value | None:
    """``range(n)``, ``range(a, b)`` or ``range(a, b, step)`` with a symbolic bound, consumed
    right away by a ``for`` loop: the iterator that makes ``FOR_ITER`` roll the loop; None
    where the loop is unrolled as before."""
    rolled = _symbolic_range(tracer, args, kwargs)
    for a in args:
        if rolled is None and isinstance(a, LoopIndexV):
            a.concrete()  # an enclosing rolled loop's index as a bound: that loop is refused
    return rolled


def _symbolic_range(tracer, args: list, kwargs: dict) -> Value | None:
    if not 1 <= len(args) <= 3 or kwargs or not tracer.frames \
            or not all(isinstance(a, (SymV, ConstV)) and type(a.value) is int for a in args):
        return None
    frame = tracer.frames[-1]
    code = frame.info.instructions
    if frame.ip + 1 >= len(code) or code[frame.ip].opname != "GET_ITER" \
            or code[frame.ip + 1].opname != "FOR_ITER":
        return None
    # a constant trip count: rolled only where the loop may stop early (exits.py)
    exits = rolled_exits.exit_jump(code, frame.ip + 1, frame.info.index_of[code[frame.ip + 1].argval])
    if not any(isinstance(a, SymV) for a in args[:2]) and exits is None:
        return None
    step = args[2].concrete() if len(args) == 3 else 1  # a symbolic step: specialised
    if step == 0:
        return None  # range() raises, as in eager
    start, stop = (ConstV(0), args[0]) if len(args) == 1 else (args[0], args[1])
    site = (id(frame.code), code[frame.ip + 1].offset)
    where = f"{frame.code.co_filename}:{frame.lineno}"
    n = _trip_count(tracer, start, stop, step)
    why = _why_not_roll(tracer, site, n, exits is not None)
    if why is not None:
        if site not in tracer.assumptions.unrolled_loops:
            tracer.loops.append(LoopReport(where, False, why, site=site, form=_form(args)))
        return None
    return SymRangeIterV([], n=n, start=start, step=step, bounds=tuple(args))


def rows_form(x: TensorV, dim: int, enumerated: bool = False, count_from: int = 0,
              split: bool = False) -> str:
    """How ``explain()`` names a loop over a tensor's rows (rows.py)."""
    name = str(x.source) if x.source is not None else "<a tensor>"
    rows = f"{name}.split(1, {dim})" if split else name if dim == 0 else f"{name}.unbind({dim})"
    if enumerated:
        return f"for k, row in enumerate({rows}{f', {count_from}' if count_from else ''})"
    return f"for row in {rows}"


def _form(args: list) -> str:
    names = ["n"] if len(args) == 1 else ["a", "b", "step"][:len(args)]
    return f"range({', '.join(names)})"


def _trip_count(tracer, start: Value, stop: Value, step: int) -> Value:
    """``len(range(start, stop, step))`` as symbolic arithmetic: ``ceil((stop - start) / step)``
    (at most 0 when the range is empty; the rolled graph is guarded on ``n >= 1``)."""
    if isinstance(start, ConstV) and start.value == 0 and step == 1:
        return stop
    if isinstance(start, ConstV) and isinstance(stop, ConstV):  # (a loop that may stop early)
        return ConstV(len(range(start.value, stop.value, step)))
    if step < 0:
        start, stop, step = stop, start, -step
    span = arithmetic(tracer, operator.sub, stop, start)
    if step == 1:
        return span
    span = arithmetic(tracer, operator.add, span, ConstV(step - 1))
    return arithmetic(tracer, operator.floordiv, span, ConstV(step))


def _why_not_roll(tracer, site: tuple, n: Value, exits: bool = False) -> str | None:
    if site in tracer.assumptions.unrolled_loops:
        return "refused before"  # the report of the refusal is kept by capture
    if ("rolled_loop", *site) in tracer.unstable_sites:
        return "an assumption its body made (a size, a tensor branch, a test on a `.item()` value) failed at run time"
    if tracer.merging:
        return "inside a tensor branch whose two sides are merged"
    if tracer.template is not None:
        return "inside a recursion template (templates/)"
    if not isinstance(n, SymV) and not (exits and isinstance(n, ConstV)) \
            or not isinstance(n.value, int) or n.value < 2:
        return f"its trip count at capture ({n.value!r}) gives no second iteration to compare"
    return None


def not_here(tracer, site: tuple) -> bool:
    """A ``while`` loop at ``site`` stays unrolled: refused before, inside another rolled
    loop, a merged tensor branch or a recursion template."""
    return site in tracer.assumptions.unrolled_loops or bool(tracer.rolling) or \
        bool(tracer.merging) or tracer.template is not None


def run_rolling(tracer, loop) -> None:
    """Capture ``loop`` (its ``run()``), the tracer marked as inside a rolled loop."""
    tracer.rolling += 1
    try:
        loop.run()
    finally:
        tracer.rolling -= 1


def for_iter(frame, ins, it: SymRangeIterV):
    """``FOR_ITER`` on a ``SymRangeIterV``: runs and rolls the whole loop; returns where the
    frame goes on (after the loop)."""
    run_rolling(frame.tracer, _Loop(frame, ins, it))
    frame.pop()  # the iterator, as FOR_ITER does when it is exhausted
    return ins.argval


# ---- one loop ----------------------------------------------------------------------------------
class _Loop:
    exit_at = None  # the index of the jump of the ``if ...: break`` ending the body (exits.py)
    rows, rows_dim = None, 0  # ``for row in x``: the tensor and the dimension (rows.py)
    rows_split = False        # ``x.split(1, d)``: its parts
    parts = None              # its ``unbind`` node (``_row``)

    def __init__(self, frame, ins, it: SymRangeIterV):
        self.frame, self.tracer, self.n = frame, frame.tracer, it.n
        self.start, self.step = it.start, it.step
        self.items = getattr(it, "of", None)          # ``for x in xs``: the TensorListV
        self.enumerated = getattr(it, "enumerated", False)
        self.count_from = getattr(it, "count_from", 0)  # ``enumerate(xs, start)``
        self.zipped = getattr(it, "zipped", ())         # ``zip(xs, ys)``: every list
        self.rows, self.rows_dim = getattr(it, "rows_of", None), getattr(it, "dim", 0)
        self.rows_split = getattr(it, "split", False)
        self.counter = None                           # the ``k`` of iteration 1
        self.exit_at = None if self.items is not None or self.enumerated else \
            rolled_exits.exit_jump(frame.info.instructions, frame.ip - 1,
                                   frame.info.index_of[ins.argval])  # its ``break`` test
        self.form = rolled_lists.form(self.items.source, self.enumerated, self.count_from,
                                      self.zipped) if self.items is not None else \
            rows_form(self.rows, it.dim, self.enumerated, self.count_from, self.rows_split) \
            if self.rows is not None else _form(it.bounds or [it.n])
        self.first = None                             # what iteration 0 bound the target to
        self.graph = self.tracer.graph
        self.head = frame.ip - 1                      # index of FOR_ITER
        self.exit = frame.info.index_of[ins.argval]
        self.site = (id(frame.code), ins.offset)
        self.where = f"{frame.code.co_filename}:{frame.lineno}"

    def refuse(self, why: str):
        raise RollRefused(self.site, self.where, why, self.form)

    def run(self) -> None:
        with rolled_exits.Exits(self.tracer, self.frame.code, self.exit_at) as self.exits:
            self._run()

    def _run(self) -> None:
        self._check_bytecode()
        if self.rows is not None:  # ``x.unbind(d)``, before the loop (``_row``)
            x, d = self.rows, self.rows_dim
            self.parts = self.graph.call_function(torch.split, (x.node, 1, d)) if self.rows_split \
                else self.graph.call_function(torch.unbind, (x.node, d))
            self.parts.meta.update(example=x.example.split(1, d) if self.rows_split
                                   else x.example.unbind(d),
                                   where=self.where, mutates=False, writes=frozenset())
        before_loop = set(self.graph.nodes)
        first = Snapshot(self.frame, self.tracer)
        reports = len(self.tracer.loops)
        before_first = _effects(self.tracer), len(self.tracer.assertions)
        self._iterate(self.start)                  # iteration 0: into the graph, as unrolled
        before_loop |= _numbers_before(self.graph, before_loop)
        self._after_first()
        self._nested(reports, f"in the first iteration of the loop at {self.where}")
        head = Snapshot(self.frame, self.tracer)
        growing = head.grown_lists(first)
        index_node = self.graph.call_function(_loop_index, (self.site,))  # the body's ``k``
        before_body = set(self.graph.nodes)
        index = self._value(self._index(index_node))
        effects, assumed = _effects(self.tracer), len(self.tracer.assertions)
        # iteration 0 may run in the body only if the graph shows all it did
        first_nodes = [] if before_first[0] != effects else \
            [n for n in self.graph.nodes if n not in before_loop and n is not index_node]
        first_checks = self.tracer.assertions[before_first[1]:assumed]
        reports = len(self.tracer.loops)
        with append_only(growing, self):
            try:
                self._iterate(index)               # iteration 1: becomes the body
            except RollRefused:
                raise
            except Unsupported as e:
                self.refuse(f"its body cannot be captured for a symbolic index ({e.explanation})")
        self._nested(reports, f"in the body of the loop at {self.where}")
        changed = [name for name, size in _effects(self.tracer).items() if effects[name] != size]
        if changed:
            self.refuse(f"its body leaves effects beyond the loop's variables ({', '.join(changed)}"
                        ": attribute/global/print writes, speculation on tensor values, ...)")
        checks = self.tracer.assertions[assumed:]  # checked in every iteration instead
        del self.tracer.assertions[assumed:]
        if any(_depends_on(pred, index_node) for pred, _, _, _ in checks):
            self.refuse(_INDEX_AS_PYTHON)
        after = Snapshot(self.frame, self.tracer)
        match = Match(head, after, index, growing, self)
        match.frame_state(self.frame)
        after.hidden_unchanged(head, match.visited, self)
        body_nodes = [n for n in self.graph.nodes if n not in before_body]
        _Roll(self, match, body_nodes, before_loop, before_body, index_node, checks,
              (first_nodes, first_checks), self.exits.found).apply()

    def _nested(self, since: int, within: str) -> None:
        """Loops met in an iteration are inner loops: their reports say of which."""
        for report in self.tracer.loops[since:]:
            report.within = report.within or within

    def _value(self, index: Value) -> Value:
        """What the loop hands out in the iteration of ``index``: the index, or ``xs[index]``."""
        if self.items is None and self.rows is None:
            return index
        if not self.enumerated:
            return self._item(index)
        k = _plus(self.tracer, index, self.count_from)
        self.counter = k if self.counter is None and isinstance(index, SymV) else self.counter
        return TupleV([k, self._item(index)])

    def _item(self, index: Value) -> Value:
        """The row of a tensor (``_row``) or the item of a list the loop walks."""
        return self._row(index) if self.rows is not None else rolled_lists.row(self, index)

    def _row(self, index: Value) -> TensorV:
        """``x.unbind(d)[index]`` (rows.py): the rows are unbound once, before the loop
        (``_run``), as eager's iterator does (autograd's view rules and ``UnbindBackward``
        are eager's)."""
        at = index.node if isinstance(index, SymV) else index.value
        node = self.graph.call_function(operator.getitem, (self.parts, at))
        node.meta["example"] = example = self.parts.meta["example"][index.value]
        return TensorV(node, example, dynamic=True)

    def _after_first(self) -> None:
        """What iteration 0 tells of the loop (``while_loops.py``: its step, its trip count)."""

    def is_next(self, h: Value, a: Value, index: Value) -> bool:
        """Whether ``h -> a`` is the loop's own counter stepping (``while_loops.py``, the
        ``k`` of ``for k, x in enumerate(xs)``)."""
        if a is not self.counter or a is None:
            return False
        if not (isinstance(h, ConstV) and h.value == self.count_from):
            self.refuse("the enumerate() counter is held only from the second iteration on")
        return True

    def is_first(self, h: Value) -> bool:
        """Whether ``h`` is what iteration 0 handed out (a slot that holds the loop's value)."""
        start = self.start
        return h is self.first or self.items is None and self.rows is None and (
            h is start or isinstance(h, ConstV) and isinstance(start, ConstV) and h.value == start.value)

    def plain(self) -> bool:
        return isinstance(self.start, ConstV) and self.start.value == 0 and self.step == 1

    def _index(self, counter: torch.fx.Node) -> LoopIndexV:
        """The index of iteration ``k`` (the body's input): ``start + k * step``, computed in
        the body (``start`` is then one of its invariants)."""
        node, value = counter, 1
        if not self.plain():
            scaled = counter
            if self.step != 1:
                scaled = self.graph.call_function(operator.mul, (counter, self.step))
            start = self.start.node if isinstance(self.start, SymV) else self.start.value
            node = self.graph.call_function(operator.add, (start, scaled))
            value = self.start.value + self.step
        return LoopIndexV(value, node, None, self.tracer, "t", site=self.site, where=self.where,
                          form=self.form)

    def last_index(self, last: Value) -> Value:
        """The index after the loop (of iteration ``n - 1``), or ``xs[n - 1]``."""
        if self.items is not None or self.rows is not None:
            return _plus(self.tracer, last, self.count_from) if self.enumerated else self._item(last)
        if self.plain():
            return last
        scaled = arithmetic(self.tracer, operator.mul, last, ConstV(self.step))
        return arithmetic(self.tracer, operator.add, self.start, scaled)

    def _check_bytecode(self) -> None:
        for ins in self.frame.info.instructions[self.head + 1:self.exit]:
            if ins.opname in _NOT_IN_BODY:
                self.refuse(f"its body has {ins.opname}")

    def _iterate(self, index: Value) -> None:
        frame = self.frame
        if self.first is None:
            index = self.first = self._value(index)
        frame.push(index)
        frame.ip = self.head + 1
        self.exits.iteration()
        while frame.ip != self.head:
            if frame.result is not None or not self.head < frame.ip < self.exit:
                self.refuse("an iteration leaves the loop (break, return or an exception)")
            at = frame.ip
            frame._step()
            self.exits.stepped(at)


_EFFECTS = {"shadow-heap writes": lambda t: t.heap, "clock reads": lambda t: t.clock_reads,
            "draws from Python's random module": lambda t: t.draws, "view writes": lambda t: t.view_writes,
            "distributed leaves": lambda t: t.distributed_leaves,
            "inference regions": lambda t: t.inference_regions,
            "optimizer state": lambda t: t.opt_state, "generators": lambda t: t.generators,
            "recursion template calls": lambda t: t.template_calls,
            "object inputs": lambda t: t.object_inputs}


def _numbers_before(graph: torch.fx.Graph, before_loop: set) -> set:
    """The nodes iteration 0 made that are numbers of values from before the loop: a
    ``.item()`` value read before it (its graph number is made where it is first used, but
    reads the tensor where ``.item()`` was called: ``speculation/item_args._read``) and
    Python arithmetic on such numbers only. They are the same in every iteration (loop
    invariants, not iteration 0's values)."""
    found = set()
    for node in graph.nodes:
        if node in before_loop or node.op != "call_function" and not (
                node.op == "call_method" and node.target == "item"):
            continue
        if type(node.meta.get("example")) in (int, float, bool) and not node.meta.get("mutates") \
                and all(n in before_loop or n in found for n in node.all_input_nodes):
            found.add(node)
    return found


def _depends_on(node: torch.fx.Node, on: torch.fx.Node) -> bool:
    """Whether ``node`` is Python arithmetic on ``on`` (a tensor in between, a size read of a
    tensor made from the index, does not count: its value is not the index's)."""
    seen, pending = set(), [node]
    while pending:
        n = pending.pop()
        if n is on:
            return True
        if n in seen or isinstance(n.meta.get("example"), torch.Tensor) or n.target == "size":
            continue
        seen.add(n)
        pending += n.all_input_nodes
    return False


def _effects(tracer) -> dict:
    """What an iteration must leave as it found it (anything else outlives the loop body)."""
    return {name: len(get(tracer)) for name, get in _EFFECTS.items()}


# ---- from iteration 1 to a body and one graph node -----------------------------------------
class _Roll:
    def __init__(self, loop: _Loop, match: Match, new_nodes: list, before_loop: set,
                 before_body: set, index_node: torch.fx.Node, checks: list, first: tuple,
                 exits: list = ()):
        self.loop, self.match, self.tracer = loop, match, loop.tracer
        self.graph = loop.graph
        self.body_nodes = [n for n in new_nodes if n.op not in ("placeholder", "get_attr")]
        self.in_body = set(self.body_nodes)
        self.before_loop, self.before_body = before_loop, before_body
        self.index_node = index_node
        self.checks = checks  # (predicate node, expected, where, site) assumed in iteration 1
        for node in self.body_nodes:  # (its layout after the loop would be one trip count's)
            if op_name(node) in LAYOUT_WRITES:
                loop.refuse(f"its body changes a tensor's shape or strides in place "
                            f"(`{op_name(node)}`)")
        if any(pred not in self.in_body for pred, _, _, _ in checks):
            loop.refuse("its body makes an assumption about a value from before the loop")
        for lst, _, _ in match.appends:
            if getattr(lst, "source", None) is not None:  # (its commit writes items one by one)
                loop.refuse(f"its body appends to {lst.source}, a list that existed before the "
                            "call (its new items are committed to it one by one)")
        self.entries = list(match.carried.values())
        self.heads = {h.node: k for k, (h, _, _) in enumerate(self.entries)}
        if len(self.heads) != len(self.entries):
            loop.refuse("two carried values share one graph node")
        self.invariants: list = []
        appended = [t.node for _, _, t in match.appends]
        self.hoist = rolled_hoist.plan(
            self.body_nodes, index_node, [a.node for _, a, _ in self.entries] + [
                pred for pred, _, _, _ in checks], appended, set(self.heads),
            exact=self.tracer.assumptions.exact_loops)
        self.kept = [n for n in self.body_nodes if n not in set(self.hoist.nodes)]
        # erasing a node clears its args: what the copies after the loop are made from
        self.hoisted_ops = [(n, n.op, n.target, *rolled_hoist.from_the_end(n))
                            for n in self.hoist.nodes]
        # what the body returns per iteration: appended values computed in it, then the
        # values hoisted ops read
        self.per_iteration = [a for a in appended if a not in self.hoist.appended]
        self.per_iteration += self.hoist.boundaries
        self.folded = None  # iteration 0 run by the body (first.py)
        if first[0] and not self.tracer.assumptions.exact_loops and loop.items is None \
                and loop.plain():
            self.folded = rolled_first.fold(*first, new_nodes, index_node, 0, self.entries,
                                            match.appends, self.tracer.assertions, checks)
        self.first = rolled_first.first_row(self.folded)
        self._exits(list(exits) + [None, None])

    def _exits(self, found: list) -> None:
        """The exit check's position among the body's checks, and iteration 0's exit test
        where the graph runs it before the loop (``exits.py``)."""
        body = found[1]
        self.exit = next((i for i, c in enumerate(self.checks) if c is body), None)
        self.first_exit = None
        if self.exit is None:
            return
        if self.match.row_slots:
            self.loop.refuse(rolled_exits.EARLY_ROWS)
        if self.folded is None and found[0] is not None:
            self.first_exit = found[0]  # (taken out of the entry's checks in ``apply``)

    def apply(self) -> None:
        body, outputs = self._body()
        n = self.loop.n
        if isinstance(n, SymV):  # (a constant one, of a loop that may stop early, is >= 2)
            compare(self.tracer, operator.ge, n, ConstV(1))  # iteration 0 is in the graph
        report = LoopReport(self.loop.where, True, site=self.loop.site, form=self.loop.form,
                            body_ops=len(self.kept),
                            carried=len(self.entries), outputs=len(self.match.appends),
                            hoisted=len(self.hoist.nodes), not_hoisted=self.hoist.why_not)
        for node in reversed(self.body_nodes):
            if any(user not in self.in_body for user in node.users):
                self.loop.refuse("a value of the body is used after the loop other than "
                                 "through the loop's variables")
            self.graph.erase_node(node)
        self.graph.erase_node(self.index_node)
        site = ("rolled_loop", *self.loop.site)
        target = RolledLoop(body, len(self.entries), len(self.per_iteration),
                            tuple(expected for _, expected, _, _ in self.checks), report,
                            (self.loop.where, site))
        target.first = self.first
        stopped = ()
        if self.exit is not None:
            target.exit = self.exit
            report.faster += "; stops where its `break` test says so"
            if self.first_exit is not None:  # iteration 0's test: the runner's, not the entry's
                self.tracer.assertions[:] = [a for a in self.tracer.assertions
                                             if a is not self.first_exit]
                target.first_expected = self.first_exit[1]
                stopped = (self.first_exit[0],)
        if not self.tracer.assumptions.exact_loops:
            target.prepare = rolled_fast.speed_up(body, self.invariants, report, self.first,
                                                  (target.carried, target.outputs, target.expected),
                                                  every_row=self.exit is None)
        carried = tuple(h.node for h, _, _ in self.entries) if self.folded is None \
            else tuple(self.folded.initial)
        node = self.graph.call_function(target, (n.node if isinstance(n, SymV) else n.value, carried,
                                                 tuple(self.invariants), *stopped))
        node.meta["where"] = self.loop.where
        node.meta["draws_random"] = any(m.meta.get("draws_random") or _random(m)
                                        for m in body.graph.nodes)
        _writes_like(node, [m for m in body.graph.nodes if m.meta.get("writes_input")])
        self._rebind(node, outputs)
        if self.folded is not None:
            rolled_first.drop(self.graph, self.folded, self.tracer.assertions)
            report.faster += "; iteration 0 run by the body"
        if self.checks:  # the body's assumptions held in every iteration
            ok = self.graph.call_function(operator.getitem, (node, len(outputs) - len(self.checks)))
            self.tracer.assertions.append((ok, True, self.loop.where, site))
        self.tracer.loops.append(report)

    def _input(self, node, env: dict, graph: torch.fx.Graph):
        """The body's version of ``node``, read from outside iteration 1."""
        if node in env:
            return env[node]
        if node in self.heads:
            return env.setdefault(node, self._carried_inputs[self.heads[node]])
        if node not in self.before_loop and node in self.before_body \
                and node.op not in ("placeholder", "get_attr"):  # inputs first read in iteration 0
            if _size_of(node, self.heads):
                return self._carried_size(node, env, graph)
            self.loop.refuse("its body reads a value of the previous iteration that no loop "
                             f"variable holds ({node.name})")
        self.invariants.append(node)
        env[node] = graph.placeholder(f"invariant_{len(self.invariants)}")
        return env[node]

    def _carried_size(self, node: torch.fx.Node, env: dict, graph: torch.fx.Graph):
        """A size of a carried value that iteration 0 read and iteration 1 reads again (the
        tracer keeps one size node per tensor and dim): the body reads it from its carried
        input in every iteration, so the checks on it run per iteration too."""
        tensor = self._input(node.args[0], env, graph)
        env[node] = graph.call_method("size", (tensor, *node.args[1:]), dict(node.kwargs))
        env[node].meta = dict(node.meta)
        return env[node]

    def _body(self) -> tuple:
        graph = torch.fx.Graph()
        env = {self.index_node: graph.placeholder("t")}
        self._carried_inputs = [graph.placeholder(f"carried_{k}") for k in range(len(self.entries))]
        for node in self.body_nodes:  # hoisted ones too: their invariants stay inputs
            for arg in node.all_input_nodes:
                if arg not in self.in_body:
                    self._input(arg, env, graph)
        # invariants are placeholders too: they must come after the carried ones
        for node in self.kept:
            env[node] = graph.node_copy(node, lambda x: env[x])
        results = [a.node for _, a, _ in self.entries] + self.per_iteration
        results += [pred for pred, _, _, _ in self.checks]
        outputs = [self._input(r, env, graph) if r not in env else env[r] for r in results]
        graph.output(tuple(outputs))
        _placeholders_first(graph)
        graph.lint()
        body = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="RolledBody")
        body.meta["constructed_by"] = "specularch.symbolic.rolled.loops"
        return body, outputs

    def _rebind(self, node: torch.fx.Node, outputs: list) -> None:
        """The loop's variables after the loop: the rolled node's results."""
        for k, (_, a, slots) in enumerate(self.entries):
            out = self.graph.call_function(operator.getitem, (node, k))
            out.meta["example"] = a.example
            value = TensorV(out, a.example, dynamic=True)
            for holder, key in slots:
                set_slot(holder, key, value)
        if self.exit is not None:  # where it stopped: a number the graph produces
            last = self.graph.call_function(operator.getitem, (
                node, len(self.entries) + len(self.per_iteration) + 1))
            last.meta["example"] = torch.tensor(self.loop.n.value - 1)
            index = self._stopped_at(last)
            if self.loop.rows is not None:  # ``x.unbind(d)[stopped]`` (rows.py)
                index = self._row_at(last) if self.match.index_slots else None
        else:
            last = arithmetic(self.tracer, operator.sub, self.loop.n, ConstV(1))
            index = self.loop.last_index(last) if self.match.index_slots else None
        for holder, key in self.match.index_slots:
            set_slot(holder, key, index)
        for (holder, key), (lst, part) in self.match.row_slots:
            set_slot(holder, key, rolled_lists.item(self.loop, last, lst) if part is None else
                     rolled_lists.part_of(self.loop, last, (lst, part)))
        stacked = self._hoisted(node)
        rolled = self.loop.n.value - self.first  # iterations the body runs
        for lst, head_items, appended in self.match.appends:
            head_items = head_items[:len(head_items) - 1 + self.first]  # iteration 0's: the body's
            head_nodes = [_fx(v) for v in head_items]
            if appended.node in stacked:
                joined = self.graph.call_function(rolled_hoist.join_stacked,
                                                  (head_nodes, stacked[appended.node]))
            else:
                j = self.per_iteration.index(appended.node)
                tail = self.graph.call_function(operator.getitem, (node, len(self.entries) + j))
                joined = self.graph.call_function(_join, (head_nodes, tail))
            length = self._length(last, len(head_items) + 1 - self.first)
            examples = [v.concrete() for v in head_items] + [appended.example] * rolled
            become_rolled(lst, RolledListV(joined, examples, length, self.loop.where))


    def _stopped_at(self, last: torch.fx.Node) -> ScalarV:
        """The loop's variable after a loop that may stop early: ``start + last * step`` of the
        last iteration run (``last``, a 0-d tensor the runner returns), computed in the graph."""
        start, step, k = self.loop.start, self.loop.step, int(last.meta["example"])
        node = last
        if step != 1:
            node = self.graph.call_function(operator.mul, (node, step))
            node.meta["example"] = last.meta["example"] * step
        if not (isinstance(start, ConstV) and start.value == 0):
            example = node.meta["example"] + start.value
            node = self.graph.call_function(operator.add, (node, start.node if isinstance(start, SymV)
                                                           else start.value))
            node.meta["example"] = example
        return ScalarV(node, start.value + k * step, read_after=node)

    def _row_at(self, last: torch.fx.Node) -> TensorV:
        """The row a loop over a tensor's rows that may stop early hands out last."""
        parts = self.loop.parts
        node = self.graph.call_function(row_at, (parts, last))
        node.meta["example"] = example = parts.meta["example"][int(last.meta["example"])]
        return TensorV(node, example, dynamic=True)

    def _length(self, last, more: int) -> Value:
        """The length of a list the loop appended to: ``last`` (the last iteration's index)
        plus ``more``; where the loop may stop early, a number the graph produces (``len`` of
        the list: captured, as a ``.item()`` value is)."""
        if self.exit is None:
            return arithmetic(self.tracer, operator.add, last, ConstV(more))
        node = self.graph.call_function(operator.add, (last, more))
        node.meta["example"] = last.meta["example"] + more
        return ScalarV(node, int(node.meta["example"]), read_after=node)

    def _hoisted(self, node: torch.fx.Node) -> dict:
        """The hoisted ops, once after the loop on the stacked per-iteration values they
        read; appended node -> its values of iterations 1 .. n-1 stacked."""
        if not self.hoist:
            return {}
        k = len(self.entries)
        lists = tuple(self.graph.call_function(operator.getitem, (node, k + self.per_iteration.index(b)))
                      for b in self.hoist.boundaries)
        tail, invariants = rolled_hoist.tail(self.hoisted_ops, self.hoist)
        call = self.graph.call_function(tail, (lists, tuple(invariants)))
        call.meta["where"] = self.loop.where
        stacked = {}
        for i, appended in enumerate(tail.appended):
            stacked[appended] = self.graph.call_function(operator.getitem, (call, i))
            example = appended.meta["example"]
            stacked[appended].meta["example"] = example.unsqueeze(0).expand(
                self.loop.n.value - self.first, *example.shape)
        return stacked


def _writes_like(node: torch.fx.Node, writers: list) -> None:
    """``node`` (a rolled loop) writes in place what its body's ``writers`` write: kept by
    dead-code elimination though nothing reads its results (``z[t] = 5`` in every
    iteration of a loop that carries nothing), and ordered with the graph's other writes."""
    if not writers:
        return
    written = [m.meta.get("writes") for m in writers]
    node.meta["mutates"] = node.meta["writes_input"] = True
    node.meta["writes"] = frozenset().union(*written) if all(written) else frozenset()


def _size_of(node: torch.fx.Node, heads: dict) -> bool:
    """Whether ``node`` is ``h.size(dim)`` of a carried value ``h`` (as it is at an
    iteration's start)."""
    return node.op == "call_method" and node.target == "size" and len(node.args) == 2 \
        and not node.kwargs and node.args[0] in heads and isinstance(node.args[1], int)


def _fx(v: Value):
    if isinstance(v, TensorV):
        return v.node
    if isinstance(v, ConstV):
        return v.value
    raise Unsupported("unsupported_call", f"a list a rolled loop appends to holds {v!r}")


def _placeholders_first(graph: torch.fx.Graph) -> None:
    """Placeholders made while copying (invariants) go before the first computing node."""
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if first is None:
        return
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(node)


def _random(node: torch.fx.Node) -> bool:
    return is_random_node(node)
