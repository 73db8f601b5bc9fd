"""Compat: AOTInductor, Inductor's ahead-of-time form of a graph: one C++ library in a
``.pt2`` package that the program loads and runs with the C++ loader
(``torch._C._aoti.AOTIModelPackageLoader``), without importing Inductor's compiler.

That import is why this exists: loading a ``standalone_compile`` artefact imports
``torch._inductor.compile_fx`` and the rest of the compiler (160-odd modules) in the
program's process, 0.2-6 s of Python holding the GIL on the background thread, the largest
stall a tiered program had left (docs/tiering.md). (Eager PyTorch itself imports a few
Inductor modules: an optimizer imports ``torch._dynamo``, which imports them.) Compiling
needs Inductor and ``torch.export``; it runs in the tiering worker process
(``_torch_compilers.inductor_artifact``).
"""
from __future__ import annotations

import atexit
import io
import weakref

import torch
import torch.fx


def loadable() -> bool:
    """This torch has the C++ package loader (a build without AOTInductor does not)."""
    return hasattr(torch._C, "_aoti") and hasattr(torch._C._aoti, "AOTIModelPackageLoader")


class _Graph(torch.nn.Module):
    """``torch.export`` takes a module; the flattened graph takes its inputs positionally."""

    def __init__(self, graph: torch.fx.GraphModule):
        super().__init__()
        self.graph = graph

    def forward(self, *inputs):
        return self.graph(*inputs)


def package(graph: torch.fx.GraphModule, inputs: list, threads: int | None) -> bytes:
    """``graph`` (flattened: ATen ops, no autograd, tensor inputs only, static shapes) exported
    and compiled by AOTInductor; the ``.pt2`` package's bytes. Random ops call eager's
    kernels on the global generator (``fallback_random``), so a graph draws eager's numbers;
    the C++ kernels are written for ``threads`` (the program's count, not this process's)."""
    examples = tuple(t.detach() for t in inputs)
    with torch.no_grad():
        return _compiled(torch.export.export(_Graph(graph), examples, strict=False), threads)


def package_dynamic(graph: torch.fx.GraphModule, inputs: list, threads: int | None,
                    dynamic: dict[int, list[int]]) -> tuple[bytes, str]:
    """``package`` for a graph flattened with dynamic sizes: exported with the dimensions
    ``dynamic[i]`` of input ``i`` dynamic (``Dim.AUTO``: export may narrow their range, or
    fix one), compiled for every size in the exported ranges. Also what the package holds
    for, as a size-guard expression over ``L['t<i>']`` (``dynamic_sizes``): each dimension's
    range, dimensions export found equal, fixed ones. Raises ``ValueError`` where export made
    a dimension an expression of others (not checked here)."""
    from torch.export import Dim
    examples = tuple(t.detach() for t in inputs)
    shapes = tuple({d: Dim.AUTO for d in dynamic.get(i, ())} or None for i in range(len(examples)))
    with torch.no_grad():
        exported = torch.export.export(_Graph(graph), examples, dynamic_shapes=(shapes,),
                                       strict=False)
        guards = _export_guards(exported, dynamic)
        return _compiled(exported, threads), guards


def _export_guards(exported, dynamic: dict[int, list[int]]) -> str:
    from torch.utils._sympy.numbers import int_oo
    names = list(exported.graph_signature.user_inputs)
    values = {n.name: n.meta["val"] for n in exported.graph_module.graph.nodes if n.op == "placeholder"}
    terms, first = [], {}
    for i, dims in sorted(dynamic.items()):
        value = values[names[i]]
        for d in dims:
            size, at = value.shape[d], f"L['t{i}'].size()[{d}]"
            if not isinstance(size, torch.SymInt):
                terms.append(f"{at} == {int(size)}")
                continue
            symbol = size.node.expr
            if not symbol.is_Symbol:
                raise ValueError(f"export made dimension {d} of input {i} the expression {symbol}")
            if symbol in first:
                terms.append(f"{at} == {first[symbol]}")
                continue
            first[symbol] = at
            bounds = exported.range_constraints[symbol]
            terms.append(f"{int(bounds.lower)} <= {at}")
            if bounds.upper != int_oo:
                terms.append(f"{at} <= {int(bounds.upper)}")
    return " and ".join(terms)


def _compiled(exported, threads: int | None) -> bytes:
    from torch._inductor import aoti_compile_and_package, config as inductor_config
    buffer = io.BytesIO()
    with inductor_config.patch(fallback_random=True, **{"cpp.threads": threads or -1}):
        aoti_compile_and_package(exported, package_path=buffer)
    return buffer.getvalue()


def test_run(path: str, inputs: list) -> None:
    """Run the package at ``path`` once on ``inputs`` (in the tiering worker: zero-filled
    tensors of the graph's layout), raising what it raises. A package can compile and then
    fail when it runs: the big LM's step (``nn.LSTM``) did in every call, while its flattened
    graph still had oneDNN's LSTM kernel ("Expected IntList but got None": the kernel's
    backward workspace is made only in grad mode; ``_torch_compilers._generic_lstms``).
    Such a graph gets the ``standalone_compile`` artefact
    instead. (It runs in the worker process: what it draws is not the program's.)"""
    with torch.no_grad():
        Package(path)(list(inputs))


def updated_inputs(graph: torch.fx.GraphModule) -> list[int]:
    """The positions of the inputs ``graph`` updates in place (an ATen op whose schema writes
    an argument). Capture writes through the commit, so flattened graphs have none (checked
    on the MLP's, LeNet's and the LSTM LM's steps); where one does, the package is not used.
    (AOTInductor did apply ``x.add_(y)`` to its input in a one-off check; nothing relies on it.)"""
    inputs = [n for n in graph.graph.nodes if n.op == "placeholder"]
    out = set()
    for node in graph.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and value in inputs:
                out.add(inputs.index(value))
    return sorted(out)


class Package:
    """A loaded package: ``package(inputs: list[Tensor]) -> list[Tensor]``. The loader
    unpacks it into a fresh folder in the temporary directory (``$TMPDIR``, else ``/tmp``),
    which it removes when it is freed. ``run`` releases the GIL while the kernels run, and
    calls from two threads at once take turns on the package's one model instance (the
    loader's ``num_runners``)."""

    def __init__(self, path: str):
        self._loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        _OPEN.add(self)

    def __call__(self, inputs: list) -> list:
        return self._loader.run(inputs)

    def close(self) -> None:
        """Free the loader now (its folder goes with it); calls raise from then on."""
        self._loader = None


_OPEN: "weakref.WeakSet[Package]" = weakref.WeakSet()


def load(path: str) -> Package:
    """The package at ``path``, loaded in milliseconds, no Inductor module imported."""
    return Package(path)


@atexit.register
def _close_all() -> None:
    # A kept graph's package lives as long as the dispatcher's state, which the interpreter
    # does not always free at exit (two runs of a tiered step left two folders, ~2 MB each,
    # in the temporary directory): free the loaders here. A killed process leaves its own.
    for package in list(_OPEN):
        package.close()
