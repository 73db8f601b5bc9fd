"""Compiling backends on graphs with rolled loops: the loop's body compiled once, run from the
loop.

A compiling backend flattens a whole training step into one static-shape graph; a rolled
loop's trip count changes per call, so flattening would unroll it at one count. Instead the
graph around the loop runs as ``fx`` does, with autograd, and each loop body is compiled by
the backend on its first run, for its input shapes (the same in every iteration and for every
trip count), as an autograd-aware forward/backward pair (AOT autograd; TorchScript or
Inductor). Per iteration the loop then calls the compiled body.

What the body computes from the loop index (``prelude[t - 1]``, ``tokens[t]``) is Python
indexing: it stays outside and its results become the compiled body's inputs, so the body
does not specialise on ``t``. The body's in-graph checks must be size checks (constant for
the shapes it was compiled for: they are evaluated once, by the ``fx`` body, per shapes);
a body that checks tensor values, draws random numbers or uses the index otherwise keeps
running as ``fx``, and ``explain()`` says why.
"""
from __future__ import annotations

import copy
import operator
import threading

import torch
import torch.fx

from . import cells as rolled_cells
from .._torch_background import background_tracing, compile_later, compiling_in_background
from ..op_kinds import writes_in_place, wrote_an_input
from ..randomness import is_identity_dropout, is_random_node

_INDEX_OPS = {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
              operator.neg}
_SIZE_METHODS = {"size", "dim", "numel"}


def with_own_loops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose rolled loops (its nodes' ``RolledLoop`` targets) are its own:
    ``compile_bodies`` sets a compiled body on each, which must not reach the graph it was
    copied from — the ``fx`` tier's own graph, still run while the candidate is on trial,
    and again for good if it is rejected."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if _is_loop(node):
            node.target = copy.copy(node.target)
    own = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    own.meta = dict(gm.meta)
    return own


def _is_loop(node: torch.fx.Node) -> bool:
    """A node running a ``RolledLoop`` (``symbolic/rolled/loops.py``, above this layer: known
    by what it has)."""
    return node.op == "call_function" and hasattr(node.target, "run_body") and \
        hasattr(node.target, "body")


def compile_bodies(gm: torch.fx.GraphModule, backend: str) -> None:
    """Give every rolled loop of ``gm`` a body compiled by ``backend`` on its first run
    (``gm``'s loops must be its own: ``with_own_loops``). Built by the tier compiler on its
    background thread, a body compiles only on that thread (its warm-up runs: their input
    shapes), never in a call of the program: there other shapes run the ``fx`` body, and the
    first other shapes of a kind ask that thread for a compile for every size of what varies,
    which serves them once it is done."""
    for node in gm.graph.nodes:
        loop = node.target
        if _is_loop(node):
            if getattr(loop.prepare, "stack", None) is not None:
                loop.report.faster += f"; body not compiled by {backend}: it runs as one node"
                continue
            compiled = CompiledBody.of(loop.body, backend)
            if isinstance(compiled, str):
                loop.report.faster += f"; body not compiled by {backend}: {compiled}"
            else:
                loop.run_body = compiled
                loop.report.faster += (f"; body compiled by {backend} (for its first input shapes, then "
                                        "once for every size that varies)")


def _value_dependent(check: torch.fx.Node) -> bool:
    """Whether a check reads tensor values (not only sizes, which the compiled shapes fix)."""
    seen, pending = set(), [check]
    while pending:
        n = pending.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        if n.op == "call_method" and n.target in _SIZE_METHODS:
            continue
        if isinstance(n.meta.get("example"), torch.Tensor):
            return True
        pending += n.all_input_nodes
    return False


class CompiledBody:
    """Stands for ``body.forward`` (``(t, *carried, *invariants) -> results``)."""

    def __init__(self, index_gm, compute_gm, tensor_inputs: list, layout: list, backend: str,
                 body: torch.fx.GraphModule):
        self.index_gm, self.compute_gm = index_gm, compute_gm
        self.tensor_inputs, self.layout = tensor_inputs, layout  # layout: per result, ("out", k) or ("check", k)
        self.backend, self.body = backend, body
        self.by_shapes: dict = {}
        self.every_size: dict = {}  # per kind of shapes: compiled for every size, or False
        # the thread that may compile new shapes (None: any, the calling one; see compile_bodies)
        self.compiles_on = threading.get_ident() if compiling_in_background() else None
        self.later = compile_later() if compiling_in_background() else None
        self.asked: set = set()  # kinds whose compile for every size was asked of that thread

    @classmethod
    def of(cls, body: torch.fx.GraphModule, backend: str):
        """The compiled form of ``body``, or why it cannot be compiled."""
        graph = body.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        index = placeholders[0]
        results = list(next(n for n in graph.nodes if n.op == "output").args[0])
        index_part, numbers = [], {index}  # numbers: the index and Python arithmetic on it
        for n in graph.nodes:
            if n.op in ("placeholder", "output") or not any(a in numbers for a in n.all_input_nodes):
                continue
            picks = n.target is operator.getitem and n.args[0] in placeholders
            if n.op != "call_function" or n.target not in _INDEX_OPS or not picks and \
                    isinstance(n.meta.get("example"), torch.Tensor):
                return f"it uses the loop index in `{n.name}`, not only to pick rows of an input"
            index_part.append(n)
            if not isinstance(n.meta.get("example"), torch.Tensor):
                numbers.add(n)
        for n in graph.nodes:
            if is_random_node(n) and not is_identity_dropout(n):
                return f"it draws random numbers (`{n.name}`)"
            if wrote_an_input(n) or writes_in_place(n):  # (the compiled part keeps what
                return f"it writes in place (`{n.name}`)"  # its results need, no write)
        checks = [r for r in results if isinstance(r, torch.fx.Node)
                  and not isinstance(r.meta.get("example"), torch.Tensor)]
        if any(_value_dependent(c) for c in checks):
            return "it checks an assumption on tensor values in every iteration"
        if any(r in index_part for r in results):
            return "it returns a value it computes from the loop index"
        return cls._split(body, placeholders, index_part, results, checks, backend)

    @classmethod
    def _split(cls, body, placeholders, index_part, results, checks, backend):
        in_index = set(index_part)
        rows = [n for n in index_part if any(u not in in_index for u in n.users)]
        index_graph = torch.fx.Graph()
        env = {p: index_graph.placeholder(p.name) for p in placeholders}
        for n in index_part:
            env[n] = index_graph.node_copy(n, lambda x: env[x])
        index_graph.output(tuple(env[r] for r in rows))
        index_gm = torch.fx.GraphModule(torch.nn.Module(), index_graph, class_name="RolledIndex")
        graph = torch.fx.Graph()
        env, tensor_inputs = {}, []
        for k, p in enumerate(placeholders[1:], start=1):
            if any(u not in in_index for u in p.users):
                env[p] = graph.placeholder(p.name)
                tensor_inputs.append(k)
        for k, r in enumerate(rows):
            env[r] = graph.placeholder(f"row_{k}")
        outs = [r for r in results if r not in checks]
        needed = _ancestors(outs)
        for n in body.graph.nodes:
            if n.op in ("placeholder", "output") or n in in_index or n not in needed:
                continue
            env[n] = graph.node_copy(n, lambda x: env[x])
            if n.target in rolled_cells.UNFUSED:  # autograd of the compiled body instead
                env[n].target, env[n].args = rolled_cells.UNFUSED[n.target], env[n].args[2:]
        graph.output(tuple(env[r] for r in outs))
        graph.eliminate_dead_code()
        for p in [n for n in graph.nodes if n.op == "placeholder" and not n.users]:
            graph.erase_node(p)
        compute_gm = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="RolledCompiled")
        compute_gm.meta["constructed_by"] = "specularch.fx_lower.rolled.compiled"
        used = {n.name for n in graph.nodes if n.op == "placeholder"}
        tensor_inputs = [k for k in tensor_inputs if placeholders[k].name in used]
        rows_used = [k for k, _ in enumerate(rows) if f"row_{k}" in used]
        layout = [("check", checks.index(r)) if r in checks else ("out", outs.index(r))
                  for r in results]
        compiled = cls(index_gm, compute_gm, tensor_inputs, layout, backend, body)
        compiled.rows_used = rows_used
        return compiled

    def forward(self, t, *inputs):
        rows = self.index_gm(t, *inputs)
        args = [inputs[k - 1] for k in self.tensor_inputs] + [rows[k] for k in self.rows_used]
        key = tuple((a.shape, a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for a in args)
        entry = self.by_shapes.get(key)
        if entry is None and self.compiles_on not in (None, threading.get_ident()):
            return self._in_the_program(key, t, inputs, args)  # (no compile in its calls)
        if entry is None:  # this iteration runs as fx, and tells the checks' values
            results = self.body.forward(t, *inputs)
            checks = [r for r, (kind, _) in zip(results, self.layout) if kind == "check"]
            self.by_shapes[key] = (self._for_every_size(key, args) or self._compile(args), checks)
            return results
        compiled, checks = entry
        outs = compiled(*args)
        return tuple(outs[k] if kind == "out" else checks[k] for kind, k in self.layout)

    __call__ = forward

    def _in_the_program(self, key: tuple, t, inputs: tuple, args: list):
        """A call of the program meeting input shapes a tier-built body has no compiled form
        for: the ``fx`` body runs. Where the background thread compiled the body for every
        size of their kind, that form serves these shapes from the next iteration on; else
        the first such shapes of a kind ask that thread for it (on blank copies of the
        inputs: only their shapes, dtypes and strides are read)."""
        results = self.body.forward(t, *inputs)
        kind = _kind(key)
        every = self.every_size.get(kind)
        if every:
            checks = [r for r, (k, _) in zip(results, self.layout) if k == "check"]
            self.by_shapes[key] = (every, checks)
        elif kind not in self.every_size and kind not in self.asked and self.later is not None:
            self.asked.add(kind)
            blanks = [torch.zeros_like(a).requires_grad_(a.requires_grad)
                      if isinstance(a, torch.Tensor) else a for a in args]
            self.later(lambda: self._for_every_size(key, blanks))
        return results

    def _compile(self, args: list, dynamic: list | None = None):
        from ..backends import BACKENDS, COMPILE_LOCK, get_backend
        for n, a in zip([n for n in self.compute_gm.graph.nodes if n.op == "placeholder"], args):
            n.meta["example"] = a
        self.compute_gm.meta["dynamic_inputs"] = dynamic or []
        if self.compiles_on != threading.get_ident():
            return get_backend(self.backend).compile(self.compute_gm, list(args))
        # On the tier compiler's thread (its warm-up, a compile it was asked for): beside the
        # program, so without the random-number state put back after it (the program draws
        # meanwhile) and with the tracer's process-wide patches skipped (``background_tracing``).
        with COMPILE_LOCK, background_tracing(self.later):
            return BACKENDS[self.backend].compile.__wrapped__(self.compute_gm, list(args))

    def _for_every_size(self, key: tuple, args: list):
        """At a second shapes of one kind (ranks, dtypes and ``requires_grad`` the same: a
        batch size that changed): the body compiled once for every size of the dimensions
        that differ from the first shapes' of that kind (``dynamic_sizes``: checked per call,
        other sizes run the body's ``fx`` code), kept for later shapes of that kind; None
        for the first shapes of a kind, or where that compile failed."""
        kind = _kind(key)
        if kind in self.every_size:
            return self.every_size[kind] or None
        first = next((k for k in self.by_shapes if _kind(k) == kind), None)
        if first is None:
            return None
        dynamic = [[i, [d for d, (m, n) in enumerate(zip(a[0], b[0])) if m != n]]
                   for i, (a, b) in enumerate(zip(first, key)) if isinstance(a, tuple)]
        try:  # (a varying size of 0 or 1 here is traced as 2: ``_torch_shapes.hinted``)
            self.every_size[kind] = self._compile(args, [p for p in dynamic if p[1]])
        except Exception:  # (this shape's own compile follows, as before)
            self.every_size[kind] = False
        return self.every_size[kind] or None


def _kind(key: tuple) -> tuple:
    """What of a body's input shapes a compile for every size keeps: ranks, dtypes,
    ``requires_grad`` (and non-tensor inputs themselves)."""
    return tuple((len(k[0]), *k[1:]) if isinstance(k, tuple) else k for k in key)


def _ancestors(outs: list) -> set:
    seen, pending = set(), [o for o in outs if isinstance(o, torch.fx.Node)]
    while pending:
        n = pending.pop()
        if n not in seen:
            seen.add(n)
            pending += n.all_input_nodes
    return seen
