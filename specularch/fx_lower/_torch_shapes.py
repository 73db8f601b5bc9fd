"""Compat: symbolic sizes for graphs compiled once for every size of their dynamic dimensions
(``torch.fx.experimental.symbolic_shapes.ShapeEnv``, ``FakeTensorMode``'s ``from_tensor`` with a
``StatelessSymbolicContext``, ``ShapeEnv.produce_guards_expression`` and ``SYMPY_INTERP``).

Capture already knows which dimensions of which graph inputs vary (``guards/relax.py``): those,
and only those, become symbols when the graph is flattened to ATen ops; every other size and
stride stays the number it is (our own guards check them before the graph runs). Tracing
with symbols records what the trace assumed of them (a symbol at least 2, two symbols equal,
...): ``size_check`` turns that into a check of a call's inputs, so that a compiled graph
runs only on sizes its trace holds for.
"""
from __future__ import annotations

import contextlib
import re
from typing import Callable

import torch


class NotSymbolic(ValueError):
    """A dimension meant to be dynamic was fixed by the trace (an example size of 0 or 1, which
    tracing specialises on)."""


def hinted(inputs: list, dynamic: dict[int, list[int]], hints: dict[int, tuple] | None = None) -> list:
    """``inputs`` where each tensor with dynamic dimensions is replaced by zeros (contiguous,
    same dtype, device and ``requires_grad``) whose dynamic sizes are ``hints``' where given
    (an earlier call's: the full batch, not the short last one that made the batch dynamic;
    a kernel choice the trace reads from a size, such as a convolution's below a batch of
    16, is then the common calls', and the size check sends the others to ``fx``), and
    sizes 0 and 1 made 2: tracing specialises on them, so a graph captured at a batch of
    one would otherwise never be compiled for its other sizes. Fake tracing reads no
    values; a graph that cannot run at those sizes fails its compile as before."""
    hints = hints or {}
    out = list(inputs)
    for i, dims in dynamic.items():
        value = out[i]
        if not isinstance(value, torch.Tensor):
            continue
        hint = hints.get(i)
        sizes = [hint[d] if hint is not None and len(hint) == value.dim() and d in dims else n
                 for d, n in enumerate(value.shape)]
        sizes = [2 if d in dims and n < 2 else n for d, n in enumerate(sizes)]
        if sizes != list(value.shape):
            out[i] = torch.zeros(sizes, dtype=value.dtype, device=value.device,
                                 requires_grad=value.requires_grad)
    return out


def symbolic_inputs(inputs: list, dynamic: dict[int, list[int]]) -> list:
    """Fake tensors for ``inputs`` in one fresh shape environment: the dimensions
    ``dynamic[i]`` of input ``i`` symbolic, every other size and input static (numbers stay
    numbers). A contiguous input's strides follow from its sizes; a non-contiguous one's (a
    slice ``data[3:, :-1]``) are what torch makes of them: numbers, or symbols of their own."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    out = []
    for i, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        dims = set(dynamic.get(i, ()))
        sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(value.dim())]
        out.append(mode.from_tensor(value,
                                    symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
    return out


def contiguous_inputs(inputs: list, dynamic: dict[int, list[int]]) -> set[int]:
    """Which inputs with dynamic sizes are contiguous (``size_guards``' ``contiguous``)."""
    return {i for i in dynamic if inputs[i].is_contiguous()}


def size_guards(placeholders: list, dynamic: dict[int, list[int]], contiguous: set[int]) -> str:
    """What the trace of a graph whose placeholders' values are ``placeholders`` (fake
    tensors made by ``symbolic_inputs``, then traced and compiled) assumed of its dynamic
    sizes, as a Python expression over ``L['t<i>']`` (input ``i``): the shape environment's
    guards on symbols; contiguity of each input with a dynamic size that was contiguous
    (``contiguous``: their strides were traced as a contiguous tensor's), each stride the
    trace took as a number for the others. A size or stride the trace itself fixed to a
    number (the graph checks a size against one: ``x.size(0) == 35``) adds that equality:
    torch's expression leaves out what it calls static. Raises ``NotSymbolic`` where a
    dynamic dimension was never a symbol (an example size of 0 or 1)."""
    terms = [f"L['t{i}'].is_contiguous()" for i in sorted(dynamic) if i in contiguous]
    for i, dims in sorted(dynamic.items()):
        value = placeholders[i]
        for d in dims:
            size = value.shape[d]
            if not isinstance(size, torch.SymInt):
                raise NotSymbolic(f"dimension {d} of graph input {i} was traced as the number "
                                  f"{int(size)} (sizes 0 and 1 are specialised on)")
            if _fixed(size):
                terms.append(f"L['t{i}'].size()[{d}] == {int(size)}")
        if i not in contiguous:
            terms += [f"L['t{i}'].stride()[{k}] == {int(stride)}"
                      for k, stride in enumerate(value.stride()) if _fixed(stride)]
    expression = _shape_env(placeholders).produce_guards_expression(placeholders, ignore_static=True)
    if expression:
        terms.append(f"({expression})")
    return " and ".join(terms)


def _fixed(number) -> bool:
    """A size or stride the trace holds as a number (never a symbol, or one it specialised)."""
    return not isinstance(number, torch.SymInt) or not number.node.expr.free_symbols


def _shape_env(placeholders: list):
    for value in placeholders:
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    raise NotSymbolic("no graph input has a symbolic size")


_INPUT = re.compile(r"L\['t(\d+)'\]")


def size_check(expression: str) -> Callable[[tuple], bool]:
    """``size_guards``' expression as a function of a call's inputs (a tuple), evaluated with
    the functions torch's guards use (``SYMPY_INTERP``: ``Eq``, ``Mod``, ``FloorDiv``, ...)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    body = _INPUT.sub(r"a[\1]", expression)
    return eval(f"lambda a: bool({body})", dict(SYMPY_INTERP))


def named(expression: str, inputs: list[str]) -> str:
    """``expression`` with each ``L['t<i>']`` written as ``inputs[i]`` (a report's names)."""
    return _INPUT.sub(lambda m: inputs[int(m.group(1))] if int(m.group(1)) < len(inputs)
                      else m.group(0), expression)


@contextlib.contextmanager
def traced_with(fakes: list):
    """A compile (Inductor's ``standalone_compile(dynamic_shapes="from_tracing_context")``)
    inside uses the fake mode and shape environment of ``fakes`` (``symbolic_inputs``): our
    symbols, our static sizes, and what it assumes of them lands where ``size_guards`` reads
    it. (Without it Inductor fakes the inputs afresh: every size a symbol, equal sizes one
    symbol, assumptions ``size_guards`` never sees.)"""
    from torch._guards import TracingContext, tracing
    mode = next(t.fake_mode for t in fakes if isinstance(t, torch.Tensor))
    with tracing(TracingContext(mode)):
        yield


def size_environment():
    """A fake-tensor mode over a fresh shape environment for deciding which sizes are fixed
    (``symbolic/static_sizes.py``): no duck sizing (two dynamic sizes equal at capture are
    different symbols: assuming them equal would be a guess), sizes 0 and 1 specialised as
    torch does (callers give dynamic dimensions at least 2). Returns ``(mode, marks)``:
    ``marks()`` counts what the environment has assumed so far (guards, replacements,
    runtime assertions); a count that grew means a result may hold only under an assumption."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)

    def marks() -> int:
        return (len(env.guards) + len(env.replacements)
                + sum(len(v) for v in env.deferred_runtime_asserts.values()))
    return mode, marks


def fake_input(mode, value: torch.Tensor, dims) -> torch.Tensor:
    """A fake of ``value`` in ``mode`` whose dimensions ``dims`` are symbols, others fixed."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(value.dim())]
    return mode.from_tensor(value, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))


def same_size(a, b) -> bool:
    """Whether two fake sizes (ints or ``SymInt``s of one environment) are the same number
    for every value of the symbols: equal ints, or the same expression. Compared without
    ``==``, which would record a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def fixed_size(size) -> int | None:
    """``size`` (a fake tensor's) as a number where it is one whatever the symbols are."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return None
