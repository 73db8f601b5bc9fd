"""A forward graph whose results need autograd, compiled as two flattened graphs (its forward
and backward, ``_torch_joint.split``) and glued in the program (``glue.Glued``): so the
tiering worker process can compile it (each part is an artefact like a whole step's, a
TorchScript module or an AOTInductor package) instead of a thread beside the program's steps,
and the glue is thinner than AOT autograd's run-time wrappers.

``compile_parts`` runs where the compile runs (the worker); ``load_parts`` and ``cached`` in
the program. The persistent compile cache keeps the two parts under the graph's key with
``.forward`` / ``.backward`` added; the forward's metadata holds the glue's.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from . import _torch_compilers as compilers, compile_cache
from ._torch_joint import split
from .backends import specialised_numbers
from .passes import (as_tensor_input, example_inputs, number_outputs, number_outputs_as_tensors,
                     scalar_inputs_as_tensors)

PATH = "split"  # compile_cache.entry_key's path for these
PARTS = ("forward", "backward")


def refusal(gm: torch.fx.GraphModule, fixed_sizes: bool = False, counted: str = "") -> str | None:
    """None when ``gm`` is a graph this compiles (a forward graph whose results need
    autograd, its inputs tensors of fixed sizes and numbers that only feed arithmetic),
    else why not. ``_torch_joint.split`` may
    still refuse it (``NotSplit``: from the worker, the candidate then compiles through AOT
    autograd on the background thread, ``tiering/process.NotSplit``). ``fixed_sizes``: a
    graph with dynamic sizes, to be compiled for fixed ones (``tiering/hot_sizes.py``: the
    examples it is split with have them), is not refused for them; ``counted``: what the
    sizes of its calls were, said with that refusal (``tiering/hot_sizes.SizeCount.summary``)."""
    if not gm.meta.get("outputs_require_grad"):
        return "its results need no autograd"
    if gm.meta.get("scalar_inputs") and specialised_numbers(gm):
        return "it is compiled once per value of a number input, in this process"
    if not fixed_sizes and (gm.meta.get("dynamic_dims") or gm.meta.get("dynamic_inputs")):
        return f"it has dynamic sizes: {counted}" if counted else "it has dynamic sizes"
    if gm.meta.get("rolled_loops"):
        return "it has rolled loops"
    return None


def _split(backend: str, gm: torch.fx.GraphModule, examples: list):
    """``gm`` split with the partitioner ``backend``'s compile suits (Inductor: min-cut).
    Python-number inputs (which only feed arithmetic: ``refusal``) become 0-d tensor inputs
    (``passes.scalar_inputs_as_tensors``), so their values are not compiled in; the glue
    makes them so on each call (``Split.meta["converted"]``). Python numbers it returns are
    0-d tensors of the forward part, made numbers again by the glue (``["numbers"]``)."""
    converted, captured = [], gm
    if any(isinstance(v, (int, float)) for v in examples):
        gm, converted = scalar_inputs_as_tensors(gm)
        examples = [as_tensor_input(v) if i in converted else v for i, v in enumerate(examples)]
    numbers = number_outputs(captured) if captured.meta.get("non_tensor_outputs") else []
    if numbers is None:
        from ._torch_joint import NotSplit
        raise NotSplit("it returns a value that is neither a tensor nor a Python number")
    if numbers:
        gm = copy.deepcopy(gm) if gm is captured else gm
        number_outputs_as_tensors(gm, numbers)
    parts = split(compilers._generic_lstms(gm), examples, min_cut=backend == "inductor")
    parts.meta["converted"], parts.meta["numbers"] = converted, numbers
    if converted:
        same_output_dtypes(captured, parts)
    return parts


def same_output_dtypes(gm: torch.fx.GraphModule, parts) -> None:
    """Raises ``NotSplit`` where the forward part returns another dtype than capture saw (a
    number input made a 0-d tensor that promoted a result): values within rounding of
    eager's, in the wrong dtype, would be silently wrong."""
    from ._torch_joint import NotSplit
    dropped = {i for i, _ in parts.meta["passthrough"]}
    captured = [v for i, v in enumerate(compilers._output_values(gm, "example")) if i not in dropped]
    traced = compilers._output_values(parts.forward, "val")[:parts.meta["outputs"]]
    try:
        compilers._raise_on_changed_dtype(captured, traced, "a number input made a tensor changed")
    except TypeError as e:
        raise NotSplit(str(e)) from None


def compile_parts(backend: str, gm: torch.fx.GraphModule, examples: list, artefact: str,
                  cache_key: str | None, threads: int | None, aoti: bool) -> dict:
    """Split ``gm``, compile both parts with ``backend`` into ``artefact`` + ``.forward`` /
    ``.backward`` (and the persistent cache under ``cache_key``); returns the metadata
    ``load_parts`` needs."""
    parts = _split(backend, gm, examples)
    metas = {}
    for name, graph in zip(PARTS, (parts.forward, parts.backward)):
        path, key = f"{artefact}.{name}", cache_key and f"{cache_key}.{name}"
        graph_examples = example_inputs(graph)
        if backend == "torchscript":
            scripted, meta = compilers.scripted_flattened(graph, graph_examples)
            if name == "forward":
                meta["glue"] = parts.meta
            compile_cache.write_script(path, scripted, meta)
            if key:
                compile_cache.save_script(key, scripted, meta)
        elif backend == "inductor":
            meta = compilers.inductor_artifact(graph, graph_examples, path, threads=threads, aoti=aoti)
            if name == "forward":
                meta["glue"] = parts.meta
            if key:
                compile_cache.save_artifact(key, path, meta)
        else:
            raise ValueError(f"no split compile for backend {backend!r}")
        metas[name] = meta
    return metas


def compile_here(backend: str, gm: torch.fx.GraphModule, examples: list,
                 without_autograd: Callable) -> tuple[Callable | None, str | None]:
    """For a pinned backend, in this process: ``gm`` split and each part compiled by
    ``without_autograd`` (the backend's flattened compile), glued, and None; or None where
    ``refusal`` refuses it (rolled loops, dynamic sizes, numbers compiled per value), and
    also why where the split itself did (AOT autograd's own wrappers then, and ``explain()``
    says why: an input updated in place, which AOT autograd's wrappers copy back)."""
    from ._torch_joint import NotSplit
    from .glue import Glued
    if refusal(gm) is not None:
        return None, None
    try:
        parts = _split(backend, gm, examples)
    except NotSplit as e:
        return None, str(e)
    compiled = [without_autograd(graph, example_inputs(graph)) for graph in (parts.forward, parts.backward)]
    glued = Glued(*compiled, parts.meta, replay_of(gm))
    return (compile_cache.mark_cached(glued) if all(map(compile_cache.from_cache, compiled)) else glued), None


def replay_of(gm: torch.fx.GraphModule) -> Callable:
    """What ``glue.Glued`` runs for a backward under ``create_graph``: the graph's ``fx``
    code (from the call's generator states where it draws random numbers)."""
    from .glue import Replay
    from .randomness import graph_uses_randomness
    return Replay(gm.forward, graph_uses_randomness(gm))


def load_parts(backend: str, artefact: str, metas: dict, replay: Callable | None) -> Callable:
    """What ``compile_parts`` wrote to ``artefact``, glued (``replay``: ``replay_of``)."""
    from .glue import Glued
    loaded = []
    for name in PARTS:
        path = f"{artefact}.{name}"
        if backend == "torchscript":
            loaded.append(compilers.run_scripted(*compile_cache.read_script(path, quiet=False)))
        else:
            loaded.append(compilers.load_inductor_artifact(path, metas[name]))
    return Glued(*loaded, metas["forward"]["glue"], replay)


def cached(backend: str, key: str, replay: Callable | None) -> Callable | None:
    """The glued parts an earlier run saved under ``key``, or None (either part missing or
    unreadable: logged by the cache)."""
    from .glue import Glued
    loaded = [compilers.load_cached(backend, f"{key}.{name}") for name in PARTS]
    if None in loaded or not isinstance(loaded[0][1].get("glue"), dict):
        return None
    return Glued(*(fn for fn, _ in loaded), loaded[0][1]["glue"], replay)


def in_cache(backend: str, key: str) -> bool:
    return all(compilers.has_cached(backend, f"{key}.{name}") for name in PARTS)
