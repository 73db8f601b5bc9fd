"""In-place updates applied by the commit itself: no copy tax (issue 14).

Capture computes a write into a tensor that outlives the call on a copy
(``Tracer._functionalize``): ``c = p.clone(); c.add_(g, alpha=a)``, and the commit copies
``c`` into ``p``. When nothing in the graph reads the new value (only the commit does: an
optimizer step, a step counter, ``num_batches_tracked``), that round trip is pure overhead:
an allocation, a pass over ``p`` and the copy back. ``replay_updates`` drops the clone and
its ops from the graph, outputs the ops' operands instead, and turns the ``UpdateTensor``
into a ``ReplayTensor``: the commit runs ``p.add_(R[i], alpha=n0)`` — the op eager runs, on
the same operands, so the same bits and the same version bumps — once every guard and
in-graph assertion passed, like any deferred write (a graph that raises or whose assumption
fails still leaves ``p`` untouched). A chain (``buf.mul_(m).add_(g)`` with nothing reading
``buf`` afterwards) is replayed as its sequence of ops.

The write stays functional (the copy and the copy-back) when:
* the graph reads the new value (Adam's ``exp_avg``, a momentum buffer read by the
  parameter's update, a parameter read after ``opt.step()``), or a view of the copy is taken;
* an op is not one of ``_REPLAYABLE`` (elementwise ops that cannot raise on values: a
  ``batch_norm`` updating running stats stays functional), or records autograd;
* an operand shares memory with a tensor the commit writes, or is written in place later
  in the graph (what it holds when the commit runs would not be what the op read);
* an operand is a number the graph computes from anything but number inputs and constants;
* the write bumps fewer versions than the ops would (a write through ``.data``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..shadow_heap import rebuild as rb
from ..shadow_heap.writes import ReplayTensor, UpdateTensor
from ._torch_dispatch import storage_key

# In-place methods the commit may run itself: elementwise, and unable to raise on values
# (shapes and dtypes are guarded, and they worked at capture).
_REPLAYABLE = {"add_", "sub_", "mul_", "lerp_", "addcmul_", "addcdiv_", "copy_", "zero_",
               "fill_", "clamp_", "clamp_min_", "clamp_max_", "neg_"}
_FLOAT_ONLY = {"div_", "sqrt_"}  # integer division by zero raises
_NUMBER_OPS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
               operator.neg, operator.floordiv, operator.mod}  # may raise: before any write
_LITERALS = (int, float, bool, type(None))


def replay_updates(tracer, specs, writes: list, spec: rb.Rebuild, assertions: list) -> list:
    """``writes`` with every tensor update the commit can run in place as a ``ReplayTensor``;
    the graph (not yet given its output node) loses those copies and their ops, and
    ``specs.outputs`` gains their operands."""
    updates = [w for w in writes if isinstance(w, UpdateTensor)]
    if not updates:
        return writes
    graph = Graph(tracer, specs, spec, writes, assertions)
    replaced = {}
    for w in updates:
        replay = graph.replay(w)
        if replay is not None:
            replaced[id(w)] = replay
    return [replaced.get(id(w), w) for w in writes]


class Graph:
    """What deciding on the updates of one capture needs, computed once (linear in the
    graph's size): output uses, input sources, written memory, where memory is written."""

    def __init__(self, tracer, specs, spec: rb.Rebuild, writes: list, assertions: list):
        self.specs = specs
        self.uses = _output_uses(spec, writes, assertions)
        nodes = list(tracer.graph.nodes)
        self.sources = dict(zip([n for n in nodes if n.op == "placeholder"], tracer.input_sources))
        self.written = {key for key, v in tracer._external.items() if v.updated}
        self.order = {n: i for i, n in enumerate(nodes)}
        self.last_write: dict = {}  # storage -> position of the last node writing it
        self.last_unknown = -1      # position of the last node writing memory it did not say
        for i, n in enumerate(nodes):
            if n.meta.get("mutates") and n.all_input_nodes:
                if n.meta.get("writes"):
                    self.last_write.update(dict.fromkeys(n.meta["writes"], i))
                else:
                    self.last_unknown = i
        self.numbers: dict = {}
        self.read: set = set()  # nodes a replay reads: they stay in the graph as they are

    def operand(self, node: torch.fx.Node) -> rb.GraphOutput:
        """``node`` as a graph output a replay reads: counted as a use of that output, so the
        update it may be the value of stays a copy the graph makes."""
        self.read.add(node)
        out = self.specs.out(node, as_value=False)
        self.uses[out.index] = self.uses.get(out.index, 0) + 1
        return out

    def replay(self, w: UpdateTensor) -> ReplayTensor | None:
        specs = self.specs
        clone = specs.outputs[w.value.index]
        chain = _chain(clone, self.uses.get(w.value.index, 0), self.order)
        if chain is None or w.bumps < len(chain) or any(n in self.read for n in [clone, *chain]):
            return None
        operands = [a for op in chain for a in op.all_input_nodes if a is not clone]
        if any(not self._stable(a, self.order[chain[-1]]) for a in operands
               if isinstance(a.meta.get("example"), torch.Tensor)):
            return None
        try:
            ops = tuple(_lower_op(op, clone, w.target, self) for op in chain)
        except _Keep:
            return None
        for op in reversed(chain):
            op.graph.erase_node(op)
        # The slot keeps its number (rebuild records refer to outputs by position): it passes
        # the input through, which costs nothing and is not read.
        specs.outputs[w.value.index] = clone.args[0]
        specs.as_values.discard(w.value.index)
        clone.graph.erase_node(clone)
        return ReplayTensor(w.target, ops, w.bumps - len(chain), w.where)

    def _stable(self, node: torch.fx.Node, last: int) -> bool:
        """Whether the commit reads in ``node`` what the op read: memory no deferred write
        touches, and that no later node of the graph writes in place."""
        key = storage_key(node.meta["example"])
        return key not in self.written and self.last_write.get(key, -1) < last and \
            self.last_unknown < last


def _chain(clone: torch.fx.Node, output_uses: int, order: dict) -> list | None:
    """The in-place ops on the copy, in graph order, when they are all it is used for."""
    source = clone.args[0] if clone.op == "call_method" and clone.target == "clone" and \
        len(clone.args) == 1 and not clone.kwargs else None
    if output_uses != 1 or not isinstance(source, torch.fx.Node) or source.op != "placeholder" \
            or not isinstance(source.meta.get("example"), torch.Tensor):
        return None
    chain = sorted(clone.users, key=order.__getitem__)
    for op in chain:
        example = op.meta.get("example")
        if op.op != "call_method" or not op.args or op.args[0] is not clone or op.users or \
                not _replayable(op.target, source.meta["example"]) or \
                not isinstance(example, torch.Tensor) or example.requires_grad:
            return None
    return chain or None


def _replayable(method: str, target: torch.Tensor) -> bool:
    return method in _REPLAYABLE or (method in _FLOAT_ONLY and target.dtype.is_floating_point)


class _Keep(Exception):
    """An operand the commit cannot read: the write stays functional."""


def _lower_op(op: torch.fx.Node, clone: torch.fx.Node, target: rb.Rebuild, graph: Graph) -> tuple:
    def arg(a):
        if a is clone:
            return target  # `p.mul_(p)`: the tensor as the ops before left it, as in eager
        if isinstance(a, torch.fx.Node):
            if isinstance(a.meta.get("example"), torch.Tensor):
                return graph.operand(a)
            return _number(a, graph.sources, graph.numbers)
        if isinstance(a, _LITERALS) or isinstance(a, (torch.dtype, torch.memory_format)):
            return rb.Constant(a)
        raise _Keep
    return (op.target, tuple(arg(a) for a in op.args[1:]),
            tuple((k, arg(v)) for k, v in op.kwargs.items()))


def _number(node: torch.fx.Node, sources: dict, numbers: dict) -> rb.Rebuild:
    """A Python number the graph computed from number inputs (``0 - lr``), computed by the
    entry before any write instead (``rebuild.Number``: one that raises leaves every object
    untouched). One record per node, and per equal arithmetic on the same inputs."""
    if ("node", node) in numbers:
        return numbers[("node", node)]
    if node.op == "placeholder" and type(node.meta.get("example")) in (int, float) \
            and node in sources:
        record = rb.FromSource(sources[node])
        node.meta["read_by_commit"] = True  # stays a graph input: explain() lists it
    elif node.op == "call_function" and node.target in _NUMBER_OPS and not node.kwargs:
        args = tuple(_number(a, sources, numbers) if isinstance(a, torch.fx.Node)
                     else _literal_number(a) for a in node.args)
        key = (node.target, tuple(_key(a) for a in args))
        if key not in numbers:  # uids of deferred.py's numbers are ids: positive
            numbers[key] = rb.Number(node.target, args, -1 - len(numbers))
        record = numbers[key]
    else:
        raise _Keep
    numbers[("node", node)] = record
    return record


def _literal_number(a) -> rb.Constant:
    if type(a) not in (int, float):
        raise _Keep
    return rb.Constant(a)


def _key(record: rb.Rebuild):
    if isinstance(record, rb.Constant):
        return ("const", type(record.value), record.value)
    return ("record", id(record))  # sources and numbers: one record each (see numbers above)


def _output_uses(spec: rb.Rebuild, writes: list, assertions: list) -> dict:
    """How many rebuild records (and assertions) read each graph output."""
    uses: dict = {}
    roots = [spec, *(r for w in writes for r in w.rebuilds())]
    for root in roots:
        for record in rb.walk(root):
            if isinstance(record, (rb.GraphOutput, rb.GraphItem)):
                uses[record.index] = uses.get(record.index, 0) + 1
    for index, *_ in assertions:
        uses[index] = uses.get(index, 0) + 1
    return uses
