"""One cache entry = one generated Python function doing the whole fast path of a call:

    def entry(L, C, G, B):
        try:
            <guards, each source evaluated once>        # return MISS on the first failure
            <graph inputs and every object the commit will touch, read from their sources>
        except Exception:
            return MISS
        c0 = CLOCK()                                # clock reads made before any tensor op
        try:
            R = GRAPH(s0, s3, ...)
        except BaseException:                       # also KeyboardInterrupt
            SET_GRAD(GRAD)                            # the guarded grad mode, as before the graph
            raise
        if bool(R[4]) is not True: return FAILED[0]    # in-graph assumptions
        c1 = CLOCK(); n0 = ...                      # clocks after the graph; numbers computed
                                                    # from .item() values (symbolic/deferred.py)
        <objects created in the call, built from R and constants>
        <shadow-heap commit: the deferred writes, in program order>
        return <the Python return value>

Every source is read before the graph runs, so the commit writes into the objects as they
were before the call, and nothing is written unless every guard and assertion passed.
"""
from __future__ import annotations

import builtins
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .guards import GlobalStateGuard, GuardSet, SourceNamer, TensorGuard, guard_lines
from .guards.guard import const_name
from .guards.sources import PINNED

MISS = object()

_RANDOM_OPS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform",
               "exponential", "poisson", "geometric", "cauchy", "log_normal", "rrelu",
               "gumbel", "fractional_max_pool")


@dataclass(frozen=True)
class AssumptionFailed:
    """Returned by an entry whose in-graph assumption did not hold (nothing committed)."""

    where: str
    site: tuple
    expected: bool

    def explanation(self) -> str:
        if self.site[0] in ("specialize", "compare"):
            return ("the graph assumed a size computed inside the function keeps the value it "
                    "had at capture (it steers Python control flow), but it changed")
        return (f"the graph assumed this branch on a tensor value is {self.expected}, "
                f"but it was {not self.expected}")


def _literal(value: Any) -> bool:
    if type(value) in (int, str, bool, type(None)):
        return True
    if type(value) is float:
        return value == value and value not in (float("inf"), float("-inf"))
    return False


class Renderer:
    """Turns value specs (``symbolic.capture.SpecBuilder``) into Python expressions."""

    def __init__(self, namer: SourceNamer, consts: dict[str, Any]):
        self.namer = namer
        self.consts = consts
        self.prelude: list[str] = []   # statements run after the graph, before the commit
        self.numbers: list[str] = []   # numbers computed after the graph, before the prelude
        self.clocks: dict[int, tuple] = {}  # clock reads: seq -> (function, "before"/"after")
        self._made: dict[int, str] = {}

    def const(self, value: Any) -> str:
        return const_name(self.consts, value)

    def expr(self, spec: tuple) -> str:
        kind = spec[0]
        if kind == "out":
            return f"R[{spec[1]}]"
        if kind == "item":
            return f"R[{spec[1]}].item()"
        if kind == "const":
            return repr(spec[1]) if _literal(spec[1]) else self.const(spec[1])
        if kind == "object":
            return self.const(spec[1])
        if kind == "source":
            return self.namer.name(spec[1])
        if kind == "set":
            return f"set({self.const(spec[1])})"
        if kind == "tuple":
            body = "".join(f"{self.expr(s)}, " for s in spec[1])
            cls = spec[2]
            if cls is tuple:
                return f"({body})"
            if hasattr(cls, "_make"):
                return f"{self.const(cls)}({body})"
            return f"{self.const(cls)}(({body}))"  # structseq: built from one sequence
        if kind == "format":  # f"{v!r:spec}", as FORMAT_VALUE computes it
            conv = {0: "", 1: "STR", 2: "REPR", 3: "ASCII"}[spec[2]]
            return f"FORMAT({conv}({self.expr(spec[1])}), {spec[3]!r})" if conv else \
                f"FORMAT({self.expr(spec[1])}, {spec[3]!r})"
        if kind == "concat":
            return "''.join((" + "".join(f"{self.expr(s)}, " for s in spec[1]) + "))"
        if kind == "call":
            args = [self.expr(s) for s in spec[2]] + [f"{k}={self.expr(s)}" for k, s in spec[3]]
            return f"{self.const(spec[1])}({', '.join(args)})"
        if kind == "num":  # computed once, before any write (symbolic/deferred.py)
            key = ("num", spec[3])
            if key not in self._made:
                args = ", ".join(self.expr(s) for s in spec[2])
                var = f"n{len(self._made)}"
                self.numbers.append(f"{var} = {self.const(spec[1])}({args})")
                self._made[key] = var
            return self._made[key]
        if kind == "clock":
            self.clocks[spec[2]] = (spec[1], spec[3])
            return f"c{spec[2]}"
        if kind == "inference":  # once per tensor: two uses stay one tensor object
            key = ("inference", spec[2])
            if key not in self._made:
                var = f"t{len(self._made)}"
                self.prelude.append(f"{var} = AS_INFERENCE({self.expr(spec[1])})")
                self._made[key] = var
            return self._made[key]
        if kind in ("list", "dict", "new"):
            uid = spec[-1]
            if uid not in self._made:
                if kind == "list":
                    text = "[" + ", ".join(self.expr(s) for s in spec[1]) + "]"
                elif kind == "dict":
                    text = "{" + ", ".join(f"{self._key(k)}: {self.expr(s)}" for k, s in spec[1]) + "}"
                else:
                    attrs = "{" + ", ".join(f"{k!r}: {self.expr(s)}" for k, s in spec[2]) + "}"
                    text = f"NEW({self.const(spec[1])}, {attrs})"
                var = f"t{len(self._made)}"
                self.prelude.append(f"{var} = {text}")
                self._made[uid] = var
            return self._made[uid]
        raise ValueError(f"unknown value spec {kind!r}")

    def _key(self, k: Any) -> str:
        return repr(k) if _literal(k) else self.const(k)

    def write(self, w: tuple) -> str:
        kind = w[0]
        if kind == "setattr":
            return f"setattr({self.expr(w[1])}, {w[2]!r}, {self.expr(w[3])})"
        if kind == "delattr":
            return f"delattr({self.expr(w[1])}, {w[2]!r})"
        if kind == "global":
            target = "G" if w[1][0] == "globals" else self.const(w[1][1])
            return f"{target}[{w[2]!r}] = {self.expr(w[3])}"
        if kind == "cell":
            source = w[1]
            parent = source.parent
            lvalue = source.render(self.namer.name(parent) if parent is not None else "")
            return f"{lvalue} = {self.expr(w[2])}"
        if kind == "list_contents":
            return f"{self.expr(w[1])}[:] = [{', '.join(self.expr(s) for s in w[2])}]"
        if kind == "dict_contents":
            items = ", ".join(f"{self._key(k)}: {self.expr(s)}" for k, s in w[2])
            return f"REPLACE_DICT({self.expr(w[1])}, {{{items}}})"
        if kind == "item":
            return f"{self.expr(w[1])}[{self.expr(w[2])}] = {self.expr(w[3])}"
        if kind == "append":
            return f"{self.expr(w[1])}.append({self.expr(w[2])})"
        if kind == "print":  # the stream (sys.stdout / sys.stderr) was read before the graph ran
            args = [self.expr(s) for s in w[1]]
            args += [f"{k}={self.expr(s)}" for k, s in (("sep", w[2]), ("end", w[3]), ("file", w[4]))
                     if s is not None]
            return f"PRINT({', '.join(args + ['flush=True'] * w[5])})"
        if kind == "effect":
            return f"{self.const(w[1])}({', '.join(self.expr(s) for s in w[2])})"
        raise ValueError(f"unknown write {kind!r}")


def _new_object(cls: type, attrs: dict) -> Any:
    """An object created during the call, rebuilt with the attributes it ended up with."""
    obj = cls.__new__(cls)
    for name, value in attrs.items():
        if isinstance(getattr(cls, name, None), types.MemberDescriptorType):
            object.__setattr__(obj, name, value)  # a __slots__ field
        else:
            obj.__dict__[name] = value
    return obj


def as_inference(t: torch.Tensor) -> torch.Tensor:
    """``t`` (computed by the graph under no_grad where eager ran ``inference_mode()``) as
    the inference tensor eager returns: the same storage, sizes and strides, no copy."""
    if t.is_inference():
        return t
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_conj() or t.is_neg():
        raise TypeError("as_inference: not a plain strided tensor")  # the call runs eagerly
    with torch.inference_mode():
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _replace_dict(target: dict, items: dict) -> None:
    target.clear()
    target.update(items)


def _copy_all(targets: tuple, values: tuple) -> None:
    with torch.no_grad():
        for target, value in zip(targets, values):
            target.copy_(value)


def _foreach_copy_all(targets: tuple, values: tuple) -> None:
    """``_copy_all`` as one call: ``_foreach_copy_`` runs ``copy_`` per pair in order on CPU
    (each target's version counter bumped, dtypes converted, values broadcast) without a
    Python loop; used when every tensor of the graph is a plain Tensor or Parameter (a
    subclass would see one foreach call instead of its own ``copy_``)."""
    with torch.no_grad():
        torch._foreach_copy_(targets, values)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _only_plain_tensors(guards: GuardSet) -> bool:
    return all(g.tensor_type in _PLAIN_TENSORS for g in guards if isinstance(g, TensorGuard))


def _tensor_commit(render: Renderer, writes: list, plain: bool) -> list[str]:
    """The statements that copy the graph's final values into the tensors written in place.

    Each ``("tensor", target, value, bumps)`` write leaves ``target``'s autograd version
    counter where eager leaves it: ``bumps`` higher (the in-place ops eager ran on it, counted
    at capture). ``copy_`` bumps it once; a tensor eager wrote without a bump (batch_norm's
    running stats) is copied through ``.data`` (same memory, its own counter), so a graph that
    autograd saved it for (the first call of a siamese model) still runs backward."""
    targets = values = ""
    extra: list[str] = []
    for w in writes:
        target, bumps = render.expr(w[1]), w[3]
        targets += f"{target}.data, " if bumps == 0 else f"{target}, "
        values += f"{render.expr(w[2])}, "
        extra += [target] * max(bumps - 1, 0)
    copy = "FOREACH_COPY_ALL" if plain else "COPY_ALL"
    lines = [f"{copy}(({targets}), ({values}))"]
    if extra:
        lines.append(f"BUMP_VERSIONS(({', '.join(extra)}, ))")
    return lines


def _clock_reads(render: Renderer, phase: str) -> list[str]:
    """The clock reads of one side of the graph, in program order."""
    return [f"c{seq} = {render.const(fn)}()" for seq, (fn, at) in sorted(render.clocks.items())
            if at == phase]


def _numbers(lines: list[str], random_graph: bool) -> list[str]:
    """The numbers the commit computes (symbolic/deferred.py), all before any write: one
    that raises (a division by a zero ``.item()``) leaves every object untouched, and the
    dispatcher runs the call eagerly, which raises it; that run must draw what the graph drew."""
    if not lines or not random_graph:
        return [f"    {line}" for line in lines]
    return ["    try:", *[f"        {line}" for line in lines],
            "    except BaseException:", "        SET_RNG(RNG)", "        raise"]


def _guarded_grad_mode(guards: GuardSet) -> bool:
    """The grad mode a call passing ``guards`` runs in (every capture guards it)."""
    return next(g.grad_enabled for g in guards if isinstance(g, GlobalStateGuard))


def build_entry(guards: GuardSet, input_sources: list, output_spec: tuple, graph_fn: Callable,
                fast_tensors: bool = True, writes: list = (), assertions: list = (),
                random_graph: bool = False) -> tuple[Callable, str]:
    """The entry function and its source text (kept for explain())."""
    consts: dict[str, Any] = {}
    namer = SourceNamer()
    body = guard_lines(guards, namer, consts, fast_tensors)
    inputs = [namer.name(s) for s in input_sources]
    render = Renderer(namer, consts)
    commit = [render.write(w) for w in writes if w[0] != "tensor"]
    tensor_writes = [w for w in writes if w[0] == "tensor"]
    if tensor_writes:  # one no_grad block for every in-place tensor update
        commit[:0] = _tensor_commit(render, tensor_writes, _only_plain_tensors(guards))
    result = render.expr(output_spec)
    body += namer.lines
    failed = [AssumptionFailed(where, site, expected) for _, expected, where, site in assertions]
    src = ["def entry(L, C, G, B):", "    try:"]
    src += [f"        {line}" for line in body] or ["        pass"]
    src += ["    except Exception:", "        return MISS"]
    call = f"R = GRAPH({', '.join(inputs)})"
    # The graph switches grad mode around its no_grad blocks: one stopped inside such a block
    # (an error, or Ctrl-C's KeyboardInterrupt) must not leave the caller's mode switched; the
    # guards passed, so the mode before the graph is the guarded one. The eager re-run after
    # a failed assumption or a graph that raised must draw the same random numbers as if the
    # graph had never run.
    restore = ["SET_GRAD(GRAD)", *(["SET_RNG(RNG)"] if random_graph else [])]
    src += ["    RNG = GET_RNG()"] if random_graph else []
    src += [f"    {line}" for line in _clock_reads(render, "before")]
    src += ["    try:", f"        {call}", "    except BaseException:",
            *[f"        {line}" for line in restore], "        raise"]
    for i, (index, expected, _, _) in enumerate(assertions):
        restore = "SET_RNG(RNG); " if random_graph else ""
        src.append(f"    if bool(R[{index}]) is not {expected}: {restore}return FAILED[{i}]")
    src += [f"    {line}" for line in _clock_reads(render, "after")]
    src += _numbers(render.numbers, random_graph)
    src += [f"    {line}" for line in render.prelude + commit]
    src.append(f"    return {result}")
    text = "\n".join(src) + "\n"
    ns: dict[str, Any] = dict(consts, MISS=MISS, GRAPH=graph_fn, O=PINNED, NEW=_new_object,
                              FAILED=failed, REPLACE_DICT=_replace_dict, COPY_ALL=_copy_all,
                              FOREACH_COPY_ALL=_foreach_copy_all,
                              BUMP_VERSIONS=torch.autograd.graph.increment_version,
                              AS_INFERENCE=as_inference, PRINT=builtins.print,
                              FORMAT=builtins.format, STR=str, REPR=repr, ASCII=ascii,
                              GET_RNG=torch.get_rng_state, SET_RNG=torch.set_rng_state,
                              SET_GRAD=torch.set_grad_enabled, GRAD=_guarded_grad_mode(guards))
    exec(compile(text, "<specularch entry>", "exec"), ns)
    return ns["entry"], text


def is_random_node(node: torch.fx.Node) -> bool:
    """Whether the node draws random numbers (by op name; conservative: ``normalize`` counts).
    Such a node must run even when its result is unused, to advance the RNG like eager."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return any(r in str(name) for r in _RANDOM_OPS)


def graph_uses_randomness(gm: torch.fx.GraphModule) -> bool:
    return any(is_random_node(node) for node in gm.graph.nodes)
