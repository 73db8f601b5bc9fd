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
``buf`` afterwards) is replayed as its sequence of ops; a value read only by other replayed
ops (a momentum buffer read by its parameter's update) is replayed too, the commit running
all ops in graph order. A tensor the graph makes elementwise from replayed values and that
only replayed ops read (Adam's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``) becomes a
*scratch* tensor the commit computes itself, between the updates (``D0 = s57.sqrt()``):
Adam's whole step then runs in the commit as eager runs it, and the graph computes only the
gradients. Nothing is written before every guard and assertion passed; the scratch ops, like
the replayed ones, cannot raise on values.

The write stays functional (the copy and the copy-back) when:
* the graph reads the new value (a parameter read after ``opt.step()``, amsgrad's
  ``torch.maximum`` of ``exp_avg_sq``), or a view of the copy is taken;
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
    """``writes`` with every tensor update the commit can run in place turned into
    ``ReplayTensor`` records (one per op, in graph order, where the first such update was);
    the graph (not yet given its output node) loses those copies and their ops, and
    ``specs.outputs`` gains their operands."""
    updates = [w for w in writes if isinstance(w, UpdateTensor)]
    if not updates:
        return writes
    graph = Graph(tracer, specs, spec, writes, assertions)
    chosen = graph.choose(updates)
    if not chosen:
        return writes
    replays = graph.lower(chosen)
    gone = {id(u.write) for u in chosen}
    first = min(i for i, w in enumerate(writes) if id(w) in gone)
    kept = [w for w in writes if id(w) not in gone]
    return kept[:first] + replays + kept[first:]


class _Update:
    """One candidate: the copy (``clone``) and the in-place ops on it, in graph order. A
    scratch one (``write`` None) is a tensor the graph made from replayed values for replayed
    ops only (Adam's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``): ``clone`` is the node
    that makes it, which the commit runs too."""

    def __init__(self, write: UpdateTensor | None, clone: torch.fx.Node, chain: list):
        self.write, self.clone, self.chain = write, clone, chain
        self.aliases = {clone, *chain}  # nodes whose value is the copy's tensor
        self.ops = chain if write is not None else [clone, *chain]  # what the commit runs
        self.example = clone.meta["example"] if write is None else clone.args[0].meta["example"]


class Graph:
    """What deciding on the updates of one capture needs, computed once (linear in the
    graph's size): output uses, input sources, written memory, where memory is written."""

    def __init__(self, tracer, specs, spec: rb.Rebuild, writes: list, assertions: list):
        self.specs = specs
        self.uses = _output_uses(spec, writes, assertions)
        self.outputs = set(specs.outputs)
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
        # sizes that may change between calls: operands checked at one size are not batched
        self.dynamic = bool(tracer._sizes) or any(
            getattr(n.meta.get("value"), "dynamic", False) for n in self.sources)

    def choose(self, updates: list) -> list:
        """The updates the commit replays. One may read another's value (a momentum buffer
        read by its parameter's update): the commit runs every replayed op in graph order, so
        the real tensor holds then what the copy held. An update is dropped while a node the
        commit does not replay reads its value; dropping one can drop its neighbours (those
        it reads and those reading it), rechecked from a worklist: linear in the updates."""
        candidates = {}
        for w in updates:
            u = self._candidate(w)
            if u is not None:
                candidates[u.clone] = u
        self._scratch(candidates)
        replayed = {op for u in candidates.values() for op in u.ops}
        aliases = {a: u for u in candidates.values() for a in u.aliases}
        pending = list(candidates.values())
        while pending:
            u = pending.pop()
            if candidates.get(u.clone) is not u or self._ok(u, replayed, aliases):
                continue
            del candidates[u.clone]
            replayed.difference_update(u.ops)
            for a in u.aliases:
                del aliases[a]
            pending += self._neighbours(u, aliases)
        return list(candidates.values())

    def _neighbours(self, u: _Update, aliases: dict) -> list:
        """The updates whose check a dropped ``u`` can change: those whose value its ops read
        (now read by a node not replayed) and those whose ops read its value (now a graph
        output, which must be stable)."""
        near = [aliases.get(a) for op in u.ops for a in op.all_input_nodes]
        near += [aliases.get(r) for a in u.aliases for r in a.users]  # (ops are aliases)
        return [v for v in near if v is not None]

    def _scratch(self, candidates: dict) -> None:
        """Adds the scratch tensors made from the candidates' values (transitively)."""
        known = {a for u in candidates.values() for a in u.aliases}
        pending, seen = [r for a in known for r in a.users], set()
        while pending:
            node = pending.pop()
            if node in known or node in seen:
                continue
            seen.add(node)
            u = self._scratch_candidate(node)
            if u is not None:
                candidates[node] = u
                known |= u.aliases
                pending += [r for a in u.aliases for r in a.users]

    def _scratch_candidate(self, node: torch.fx.Node) -> _Update | None:
        method = _method_of(node)
        example = node.meta.get("example")
        if method is None or not node.users or node in self.outputs or not _float_tensor(example) or \
                example.requires_grad or not isinstance(node.args[0], torch.fx.Node) or \
                not _float_tensor(node.args[0].meta.get("example")) or \
                any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example"), torch.Tensor)
                    and not _float_tensor(a.meta["example"]) for a in node.args):
            return None
        chain = self._chain(node, example)
        return None if chain is None else _Update(None, node, chain)

    def _candidate(self, w: UpdateTensor) -> _Update | None:
        clone = self.specs.outputs[w.value.index]
        source = clone.args[0] if clone.op == "call_method" and clone.target == "clone" and \
            len(clone.args) == 1 and not clone.kwargs else None
        if self.uses.get(w.value.index, 0) != 1 or not isinstance(source, torch.fx.Node) or \
                source.op != "placeholder" or not isinstance(source.meta.get("example"), torch.Tensor):
            return None
        chain = self._chain(clone, source.meta["example"])
        if not chain or w.bumps < len(chain):
            return None
        return _Update(w, clone, chain)

    def _chain(self, start: torch.fx.Node, target: torch.Tensor) -> list | None:
        """The in-place ops on ``start``'s tensor (``x = buf.mul_(m); x.add_(g)``: the second
        on the first's result), in graph order; None where one cannot be replayed."""
        aliases, chain = {start}, []
        pending = sorted(start.users, key=self.order.__getitem__)
        while pending:
            op = pending.pop(0)
            if op in aliases or not (op.op == "call_method" and op.args and op.args[0] in aliases) \
                    or not op.target.endswith("_"):
                continue  # (a reader: replayed as a scratch tensor, or the update stays a copy)
            example = op.meta.get("example")
            if not _replayable(op.target, target) or \
                    not isinstance(example, torch.Tensor) or example.requires_grad:
                return None
            aliases.add(op)
            chain.append(op)
            pending = sorted({*pending, *op.users}, key=self.order.__getitem__)
        return chain

    def _ok(self, u: _Update, replayed: set, aliases: dict) -> bool:
        """Every reader of the copy is a replayed op; every operand is a replayed tensor, a
        number the entry can compute, or a tensor whose value the commit still reads."""
        if any(r not in replayed for a in u.aliases for r in a.users):
            return False
        for op in u.ops:
            operands = op.args if op is u.clone else op.args[1:]  # (a scratch's input too)
            for a in [*operands, *op.kwargs.values()]:
                if isinstance(a, torch.fx.Node) and a not in aliases:
                    if isinstance(a.meta.get("example"), torch.Tensor):
                        if not self._stable(a, self.order[op]):  # (not written after op read it)
                            return False
                    elif not _number_ok(a, self.sources):
                        return False
                elif not isinstance(a, torch.fx.Node) and not _literal(a):
                    return False
        return True

    def _stable(self, node: torch.fx.Node, last: int) -> bool:
        """Whether the commit reads in ``node`` what the op read: memory no deferred write
        touches, and that no later node of the graph writes in place."""
        key = storage_key(node.meta["example"])
        return key not in self.written and self.last_write.get(key, -1) < last and \
            self.last_unknown < last

    def lower(self, chosen: list) -> list:
        """The replay records, one per op in graph order; the graph without the copies."""
        targets = {}
        for i, u in enumerate(v for v in chosen if v.write is None):
            targets.update(dict.fromkeys(u.aliases, rb.Scratch(i)))
        targets.update({a: u.write.target for u in chosen if u.write is not None for a in u.aliases})
        ops = sorted((op for u in chosen for op in u.ops), key=self.order.__getitem__)
        owner = {op: u for u in chosen for op in u.ops}
        of_alias = {a: u for u in chosen for a in u.aliases}
        records = []
        for op in ops:
            u = owner[op]
            extra = u.write.bumps - len(u.chain) if u.write is not None and op is u.chain[-1] else 0
            makes = op is u.clone
            records.append(ReplayTensor(targets[u.clone], (_lower_op(op, targets, self, makes),),
                                        extra, u.write.where if u.write is not None else "",
                                        () if self.dynamic or makes else _form(op, u, of_alias),
                                        makes, u.example.nbytes))
        for op in reversed(ops):
            op.graph.erase_node(op)
        for u in chosen:
            if u.write is None:
                continue
            # The slot keeps its number (rebuild records refer to outputs by position): it
            # passes the input through, which costs nothing and is not read.
            self.specs.outputs[u.write.value.index] = u.clone.args[0]
            self.specs.as_values.discard(u.write.value.index)
            u.clone.graph.erase_node(u.clone)
        return records


def _replayable(method: str, target: torch.Tensor) -> bool:
    return method in _REPLAYABLE or (method in _FLOAT_ONLY and target.dtype.is_floating_point)


# Ops that make a new tensor elementwise and cannot raise on floating values (shapes and
# dtypes are guarded): a scratch tensor the commit may compute (Adam's ``denom``).
_MAKES = {"sqrt", "div", "mul", "add", "sub", "neg", "abs", "clone"}
_MAKES_FN = {operator.truediv: "div", operator.mul: "mul", operator.add: "add",
             operator.sub: "sub", operator.neg: "neg", torch.sqrt: "sqrt", torch.div: "div",
             torch.mul: "mul", torch.add: "add", torch.sub: "sub"}


def _method_of(node: torch.fx.Node) -> str | None:
    """The tensor method ``node`` runs on its first arg, when it makes a scratch tensor."""
    if not node.args or not set(node.kwargs) <= {"alpha"} or node.meta.get("mutates"):
        return None  # (``out=`` would write, ``rounding_mode`` may raise on integers)
    if node.op == "call_method":
        return node.target if node.target in _MAKES else None
    if node.op == "call_function":
        return _MAKES_FN.get(node.target) if callable(node.target) else None
    return None


def _float_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point


def _lower_op(op: torch.fx.Node, targets: dict, graph: Graph, makes: bool = False) -> tuple:
    def arg(a):
        if isinstance(a, torch.fx.Node):
            if a in targets:  # a replayed tensor, as the ops before this one left it
                return targets[a]
            if isinstance(a.meta.get("example"), torch.Tensor):
                return graph.specs.out(a, as_value=False)
            return _number(a, graph.sources, graph.numbers)
        return rb.Constant(a)
    if makes:  # ``D0 = s57.sqrt()``: the input is the first arg
        return (_method_of(op), tuple(arg(a) for a in op.args),
                tuple((k, arg(v)) for k, v in op.kwargs.items()))
    return (op.target, tuple(arg(a) for a in op.args[1:]),
            tuple((k, arg(v)) for k, v in op.kwargs.items()))


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and \
        t.layout is torch.strided and t.device.type == "cpu" and t.dtype.is_floating_point and \
        not t.is_inference()


def _form(op: torch.fx.Node, u: _Update, owner: dict) -> tuple:
    """``((kinds of the operands), dtype)`` when the commit may batch ``op`` with the same op
    on other tensors into one foreach call (``shadow_heap/replay.py``): the target and every
    tensor operand plain dense CPU floating tensors of one dtype and shape; else ``()``."""
    target = u.example
    kinds = []
    for name, a in [*((None, a) for a in op.args[1:]), *op.kwargs.items()]:
        example = a.meta.get("example") if isinstance(a, torch.fx.Node) else a
        replayed = isinstance(a, torch.fx.Node) and a in owner
        if replayed or isinstance(example, torch.Tensor):  # (a replayed tensor: its target)
            t = owner[a].example if replayed else example
            if not _plain(t) or t.dtype != target.dtype or t.shape != target.shape:
                return ()
            kind = "t"
        elif isinstance(a, torch.fx.Node) or type(a) in (int, float):
            kind = "n"
        else:
            return ()
        kinds.append(kind if name is None else f"{name}={kind}")
    return (tuple(kinds), str(target.dtype)) if _plain(target) else ()


def _literal(a) -> bool:
    return isinstance(a, _LITERALS) or isinstance(a, (torch.dtype, torch.memory_format))


def _number_ok(node: torch.fx.Node, sources: dict) -> bool:
    """Whether ``_number`` can compute ``node`` in the entry."""
    if node.op == "placeholder":
        return type(node.meta.get("example")) in (int, float) and node in sources
    return node.op == "call_function" and node.target in _NUMBER_OPS and not node.kwargs and \
        all(_number_ok(a, sources) if isinstance(a, torch.fx.Node) else type(a) in (int, float)
            for a in node.args)


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
                     else rb.Constant(a) for a in node.args)
        key = (node.target, tuple(_key(a) for a in args))
        if key not in numbers:  # uids of deferred.py's numbers are ids: positive
            numbers[key] = rb.Number(node.target, args, -1 - len(numbers))
        record = numbers[key]
    else:
        raise ValueError(f"{node} is not a number the entry computes (see _number_ok)")
    numbers[("node", node)] = record
    return record


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
