"""Which sizes of an intermediate tensor stay the same for every size of a graph's dynamic inputs.

A tensor computed from an input with a dynamic dimension (``guards/relax.py``) is dynamic, and
each size read from it (``x.size(-1)``, ``h.shape[0]``) used to become a value of the graph,
with an in-graph check wherever Python used it as a number: an ``nn.GRU`` over a sequence of
varying length returned ``embedding.size(-1) != 32`` and ``guard_same_value(zeros.size(1), 4)``
from its graph, which the compiling backends refuse (numbers computed inside a graph whose
results need autograd). Most such sizes are fixed: the embedding's width, the batch.

``StaticSizes.fixed`` decides it soundly: it runs the ops that made the tensor again on fake
tensors (``fx_lower/_torch_shapes.py``) whose dynamic dimensions are symbols, and a size that
comes out a number (not a symbol) is that number for every size of those dimensions. Only the
ops a size depends on run, each once per capture (results are kept), and only when a size of
a dynamic intermediate is read. Before that they run on real zeros with each dynamic size one
larger: a size that changes there is dynamic without fake tensors, whose first use in a
process imports ``torch._dynamo`` (1-2 s; ``x.view(x.size(0), -1)`` of a CNN with a short
last batch never pays it). Where the fake run assumed anything of a symbol (a guard, a
specialisation, a runtime assertion: a result that holds only under it), or an op is not a
torch op that fake tensors run (specularch's own helpers, anything of ``torch.distributed``),
or an input is not a tensor, the size stays a graph value, as before.

``StaticSizes.always_equal`` asks the same of two sizes that vary (``nn.LSTM`` compares its
state's ``hx.size()`` with ``(layers, input.size(1), hidden)``): equal when the fake run gives
both the same expression of the symbols, so Python's comparison needs no check per call.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch

from ..fx_lower import _torch_shapes
from ._torch_dispatch import OPERATOR_TYPES

_UNKNOWN = object()
_SAFE_MODULES = ("torch", "_operator", "operator", "math")
PROBE_BYTES = 256 << 20  # the probe's tensors kept during one capture; past it, no probe


class StaticSizes:
    def __init__(self, constants: dict[str, torch.Tensor]):
        self._constants = constants  # the graph's get_attr tensors, by name
        self._probes: dict[torch.fx.Node, object] = {}  # real tensors, dynamic sizes + 1
        self._fakes: dict[torch.fx.Node, object] = {}
        self._mode = None
        self._marks: Callable[[], int] | None = None
        self._off = False  # the environment assumed something: decide nothing more
        self._probe_bytes = 0
        self._symbolic: dict[torch.fx.Node, list[int]] = {}  # inputs with dynamic sizes read
        self._decided = False  # a size shown fixed, or two shown equal: needs_two holds
        self._small: dict[torch.fx.Node, list[int]] = {}  # ... those of size 0 or 1 now

    def fixed(self, node: torch.fx.Node, dim: int, size: int) -> bool:
        """Whether dimension ``dim`` of the tensor ``node`` computes (``size`` at capture) is
        ``size`` for every size of the graph's dynamic inputs."""
        if self._off:
            return False
        # First the ops again on zeros with each dynamic size one larger: a size that
        # changes is dynamic, and deciding so costs no fake tensors (whose first use
        # imports torch._dynamo, 1-2 s). One that stays may still vary (``x[:, :4]``).
        probe = self._evaluate(node, self._probes, self._probe)
        if probe is _UNKNOWN and not torch.cuda.is_initialized():
            return False  # an op fake tensors would not run either, most likely: not worth 1-2 s
        if isinstance(probe, torch.Tensor) and -probe.dim() <= dim < probe.dim() \
                and probe.shape[dim] != size:
            return False
        fake = self._evaluate(node, self._fakes, self._fake)
        if not isinstance(fake, torch.Tensor) or not -fake.dim() <= dim < fake.dim():
            return False
        return self._decide(_torch_shapes.fixed_size(fake.shape[dim]) == size)

    def always_equal(self, a, b) -> bool:
        """Whether two numbers of the graph (size nodes, arithmetic on them, or Python ints)
        are equal for every size of the graph's dynamic inputs: ``hx.size(1)`` of
        ``torch.zeros(1, input.size(1), 128)`` against ``input.size(1)``, which ``nn.LSTM``
        compares. False where it is not shown (the caller checks it per call)."""
        if self._off:
            return False
        probes = [self._number(x, self._probes, self._probe) for x in (a, b)]
        if any(p is _UNKNOWN for p in probes) and not torch.cuda.is_initialized():
            return False
        if all(isinstance(p, int) for p in probes) and probes[0] != probes[1]:
            return False
        fakes = [self._number(x, self._fakes, self._fake) for x in (a, b)]
        return self._decide(not any(f is _UNKNOWN for f in fakes) and _torch_shapes.same_size(*fakes))

    def _decide(self, shown: bool) -> bool:
        self._decided = self._decided or shown
        return shown

    def needs_two(self) -> list[tuple[torch.fx.Node, list[int]]]:
        """The graph inputs, and their dynamic dimensions, that decisions so far read, once
        one of them showed a size fixed or two equal (none otherwise: nothing depends on
        them). What was decided holds where each of those sizes is at least 2: the fake run's symbols
        are (torch specialises sizes 0 and 1, so ``squeeze`` of a symbol records nothing),
        and a size of 0 or 1 may decide otherwise (``x.squeeze(0)`` keeps or drops a
        dimension). The caller guards them; an input whose capture-time size is below 2,
        or that has no source to guard, is never run symbolically (nothing it feeds is
        folded)."""
        return list(self._symbolic.items()) if self._decided else []

    def below_two(self) -> list[tuple[torch.fx.Node, list[int]]]:
        """The graph inputs, and their dynamic dimensions, of size 0 or 1 in this call that a
        decision would have read: nothing they feed was folded, so the caller keeps this
        graph to such sizes (the sizes of 2 and more get a graph of their own, folded)."""
        return list(self._small.items())

    def _number(self, x, done: dict, run: Callable):
        if not isinstance(x, torch.fx.Node):
            return x if type(x) is int else _UNKNOWN
        value = self._evaluate(x, done, run)
        return value if isinstance(value, (int, torch.SymInt)) else _UNKNOWN

    def _evaluate(self, node: torch.fx.Node, done: dict, run: Callable):
        for n in _unvisited_ancestors(node, done):
            done[n] = run(n)
            if self._off:
                return _UNKNOWN
        return done.get(node, _UNKNOWN)

    def _probe(self, n: torch.fx.Node):
        """``n`` run on real zeros (constants copied), each dynamic size one larger; no
        autograd, the random streams put back."""
        def placeholder(example, dims):
            shape = [size + 1 if d in dims else size for d, size in enumerate(example.shape)]
            return torch.zeros(shape, dtype=example.dtype, device=example.device)
        if torch.cuda.is_initialized() or self._probe_bytes > PROBE_BYTES:
            # CUDA's random streams are not put back here (fake tensors decide alone); past
            # PROBE_BYTES a large model's activations would be held twice (nothing more is
            # folded: its sizes stay graph values)
            return _UNKNOWN
        rng = torch.get_rng_state()
        try:
            result = self._run(n, self._probes, placeholder, lambda t: t.clone(), torch.no_grad())
        finally:
            torch.set_rng_state(rng)
        self._probe_bytes += sum(t.untyped_storage().nbytes() for t in _tensors(result))
        return result

    def _fake(self, n: torch.fx.Node):
        """``n`` run on fake tensors whose dynamic sizes are symbols; unknown, and nothing
        decided from then on, where the run assumed anything of a symbol."""
        if self._mode is None:  # (its first use imports torch._dynamo: only when needed)
            self._mode, self._marks = _torch_shapes.size_environment()
        before = self._marks()
        result = self._run(n, self._fakes,
                           lambda example, dims: _torch_shapes.fake_input(self._mode, example, dims),
                           lambda t: _torch_shapes.fake_input(self._mode, t, ()),
                           _fake_context(self._mode))
        if self._marks() != before:  # a result under an assumption: trust none after it
            self._off = True
            return _UNKNOWN
        return result

    def _run(self, n: torch.fx.Node, done: dict, placeholder: Callable, constant: Callable, context):
        try:
            if n.op == "placeholder":
                example, value = n.meta.get("example"), n.meta.get("value")
                if not isinstance(example, torch.Tensor) or example.is_meta:
                    return _UNKNOWN
                dims = set(getattr(value, "dyn_dims", ()) or ())
                if dims and getattr(value, "source", None) is None:
                    return _UNKNOWN
                small = sorted(d for d in dims if example.shape[d] < 2)
                if small:
                    self._small[n] = small
                    return _UNKNOWN  # (the symbols are at least 2: see ``needs_two``)
                if dims:
                    self._symbolic[n] = sorted(dims)
                return placeholder(example, dims)
            if n.op == "get_attr":
                value = self._constants.get(n.target)
                return _UNKNOWN if value is None else constant(value)
            if n.op not in ("call_function", "call_method") or not _runs_on_fakes(n):
                return _UNKNOWN
            unknown = []
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: _known(done[a], unknown))
            if unknown:
                return _UNKNOWN
            with context:
                if n.op == "call_method":
                    return getattr(args[0], n.target)(*args[1:], **kwargs)
                return n.target(*args, **kwargs)
        except Exception:  # an op that does not run so: its sizes stay graph values
            return _UNKNOWN


class _fake_context:
    """Inside ``mode``, without autograd (sizes do not depend on it, and capture's
    saved-tensor hooks must not see fake tensors)."""

    def __init__(self, mode):
        self.contexts = (torch.no_grad(), mode)

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _known(value, unknown: list):
    if value is _UNKNOWN:
        unknown.append(True)
    return value


def _runs_on_fakes(n: torch.fx.Node) -> bool:
    """A torch op, a tensor method or an operator: not specularch's helpers (their checks
    and side effects), nothing of ``torch.distributed`` (a collective), no in-graph backward."""
    if n.op == "call_method":
        return n.target not in ("backward", "register_hook", "item", "tolist")
    target = n.target
    if isinstance(target, OPERATOR_TYPES):
        return True
    module = getattr(target, "__module__", None) or ""
    if target in (operator.getitem, getattr):
        return True
    return (module.split(".")[0] in _SAFE_MODULES and not module.startswith("torch.distributed")
            and not module.startswith("torch.autograd"))


def _unvisited_ancestors(node: torch.fx.Node, seen: dict) -> list[torch.fx.Node]:
    """``node`` and the nodes it depends on that ``seen`` lacks, each after its inputs."""
    order, stack, queued = [], [(node, False)], set()
    while stack:
        n, expanded = stack.pop()
        if expanded:
            order.append(n)
            continue
        if n in seen or n in queued:
            continue
        queued.add(n)
        stack.append((n, True))
        stack.extend((a, False) for a in n.all_input_nodes if a not in seen and a not in queued)
    return order
