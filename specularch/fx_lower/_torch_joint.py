"""Compat: a forward graph whose results need autograd, split into two graphs of ATen ops
without autograd by AOT autograd's joint trace and partitioner: the *forward* (the graph's
inputs in; its outputs, then what the backward reads) and the *backward* (what the forward
saved, then the outputs' gradients in; the inputs' gradients out). Each compiles like a
flattened graph, in the tiering worker too, and ``glue.py`` joins them as one autograd node,
where AOT autograd's own run-time wrappers cost more than a small model's compiled code
saves. torch has no public API for this; every use goes through here.

Refused (``NotSplit``, with why) where AOT autograd's run-time wrappers do real work: inputs
updated in place, random-number state, subclasses, sizes traced as symbols. Outputs that are
views of an input, of another output, or of an intermediate value no output returns (AOT
autograd's *intermediate bases*: the forward returns that value too, hidden from the program)
are described (``_aliases``) for the glue to make again from their bases.
"""
from __future__ import annotations

import torch
import torch.fx

from .passes import graph_outputs


class NotSplit(ValueError):
    """The graph cannot be split without AOT autograd's run-time wrappers (why)."""


class Split:
    """``forward`` and ``backward`` (ATen graphs; each placeholder's ``meta["example"]`` a
    zero-filled tensor of its layout) and ``meta`` (plain values, what ``glue.Glued`` needs):
    ``outputs``, the graph's output count (the forward returns them, then ``bases``
    intermediate bases, then the saved tensors but those in ``saved_outputs``, ``[saved
    position, output position]`` of each that is an output); ``direct``, the outputs and bases the glue's
    autograd node returns (positions ``outputs`` onwards are the bases; ``aliases``: the
    other outputs, views it makes again from their bases; ``base_layouts``, each base's
    ``[size, stride]``); ``differentiable``, the positions in ``direct`` of the
    outputs that get a gradient (the backward's inputs after the saved tensors, in this
    order, each with the strides in ``tangent_strides``); ``inputs``, the graph's input
    count; ``gradients``, the inputs the backward returns a gradient for, in its output
    order."""

    def __init__(self, forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, meta: dict):
        self.forward, self.backward, self.meta = forward, backward, meta


def split(gm: torch.fx.GraphModule, example_inputs: list, *, min_cut: bool) -> Split:
    """``gm`` (its outputs a flat tuple or list of tensors) split for ``example_inputs``
    (tensors; their ``requires_grad`` says which get gradients). ``min_cut``: the
    partitioner Inductor uses (the backward recomputes cheap ops instead of saving them),
    else the one that keeps eager's split. Raises ``NotSplit``."""
    from torch._functorch import aot_autograd, partitioners
    from torch._functorch._aot_autograd.schemas import OutputType

    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise NotSplit("a graph input is not a tensor")
    if not any(x.requires_grad for x in example_inputs):
        raise NotSplit("no graph input requires grad")

    gm, passthrough = _without_returned_inputs(gm)

    def flat(*args):
        out = gm(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    with torch.enable_grad():
        joint, meta, _, _ = aot_autograd._aot_export_function(
            flat, tuple(example_inputs), trace_joint=True, dynamic_shapes=False)
    if any(x.mutates_data or x.mutates_metadata for x in meta.input_info):
        raise NotSplit("the graph updates an input in place")
    if meta.is_rng_op_functionalized or \
            any(type(m).__name__ == "SubclassCreationMeta" for m in meta.subclass_inp_meta):
        raise NotSplit("AOT autograd would wrap it (random-number state or subclasses)")
    outputs, bases = len(meta.output_info), meta.num_intermediate_bases
    # (an ``_unsafe_view`` of an intermediate, e.g. ``linear`` on a 3-d input, is a plain
    # output to AOT autograd's wrappers as well.) An intermediate base is returned after the
    # outputs, and its views are made from it: AOT autograd keeps one only where it and its
    # views need a gradient, so each gets one (the joint's tangents: outputs', then bases').
    direct = [i for i, x in enumerate(meta.output_info)
              if x.output_type in (OutputType.non_alias, OutputType.unsafe_view_alias)]
    direct += range(outputs, outputs + bases)
    aliases = _aliases(joint, meta, direct)
    differentiable = [k for k, i in enumerate(direct) if i >= outputs or meta.output_info[i].requires_grad]
    tangents = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    if len(tangents) != len(differentiable):
        raise NotSplit(f"{len(tangents)} gradient inputs for {len(differentiable)} differentiable outputs")
    partition = partitioners.min_cut_rematerialization_partition if min_cut else partitioners.default_partition
    forward, backward = partition(joint, None, num_fwd_outputs=outputs + bases)
    gradients = _drop_none_outputs(backward)
    for graph in (forward, backward):
        _examples_from_fakes(graph)
    saved = len(graph_outputs(forward)) - outputs - bases
    tangent_inputs = [n for n in backward.graph.nodes if n.op == "placeholder"][saved:]
    if len(tangent_inputs) != len(differentiable):
        raise NotSplit("the backward's inputs are not the saved tensors and the gradients")
    base_values = _output_values(joint)[outputs:outputs + bases]
    saved_outputs = _saved_outputs(forward, direct, outputs + bases)
    _drop_saved(forward, outputs + bases, {k for k, _ in saved_outputs})
    return Split(forward, backward, {
        "outputs": outputs, "bases": bases, "direct": direct, "aliases": aliases,
        "saved_outputs": saved_outputs,
        "base_layouts": [[list(v.shape), list(v.stride())] for v in base_values],
        "differentiable": differentiable, "inputs": len(example_inputs),
        "gradients": gradients, "passthrough": passthrough,
        "tangent_strides": [list(n.meta["example"].stride()) for n in tangent_inputs]})


def _saved_outputs(forward: torch.fx.GraphModule, direct: list[int], returned: int) -> list[list[int]]:
    """``[saved position, output position]`` for each tensor the backward reads that is an
    output the glue returns (``tanh``'s result, which its backward reads): the glue saves
    that output itself, so that the program changing it in place before the backward raises,
    as eager does. (A compiled forward returns it once per use, and the compiled form copies
    repeated tensors: saved as returned, the copy would hide the change and the backward
    would read the old value.)"""
    values = _output(forward).args[0]
    first = {}
    for i in direct:  # (an output ``h.detach()`` is ``detach(tanh)``: saved ``tanh`` is it)
        first.setdefault(_undetached(values[i]), i)
    return [[k, first[_undetached(v)]] for k, v in enumerate(values[returned:]) if _undetached(v) in first]


def _drop_saved(forward: torch.fx.GraphModule, returned: int, dropped: set[int]) -> None:
    """The forward part without the saved tensors at ``dropped`` (positions among the saved
    ones, after the ``returned`` outputs and bases): outputs the glue saves itself
    (``_saved_outputs``). Returned twice, the compiled form would copy the second (each
    output is its own object: ``captured_outputs``), an output-sized copy per call that
    the glue would not use."""
    if not dropped:
        return
    output = _output(forward)
    values = list(output.args[0])
    output.args = (values[:returned] + [v for k, v in enumerate(values[returned:]) if k not in dropped],)
    forward.graph.eliminate_dead_code()
    forward.recompile()


def _undetached(value):
    """The node a chain of ``detach`` calls starts from (the partitioner saves an output as
    ``detach(out)``, which shares its version counter in eager)."""
    detach = torch.ops.aten.detach.default
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is detach:
        value = value.args[0]
    return value


def _aliases(joint: torch.fx.GraphModule, meta, direct: list[int]) -> list[dict]:
    """The outputs that are views of an input, of another output that is not itself a view
    (``x.t()``, ``hidden[:, 0]`` beside ``hidden``), or of an intermediate base (``h[:, 0]``
    and ``h[:, 1]`` of an ``h`` no output returns): the glue makes each again from its base,
    as AOT autograd's wrappers do (``Tensor.as_strided`` with the traced layout; the base's
    gradient flows through it), so that it aliases what eager's aliases. Each: ``output``,
    ``input`` or ``of`` (the base's input position, or its position among the outputs and,
    after them, the intermediate bases), ``size``, ``stride``, ``offset`` (from the base's
    storage offset; a view of an earlier aliased output, ``a.detach()`` beside ``a``, is made
    from it). Raises ``NotSplit`` for other aliases (an output that is an input after
    ``set_``, a view made without grad mode)."""
    from torch._functorch._aot_autograd.schemas import OutputType
    inputs = [n.meta["val"] for n in joint.graph.nodes if n.op == "placeholder"
              and not n.name.startswith("tangents")]
    outputs = len(meta.output_info)
    values = _output_values(joint)[:outputs + meta.num_intermediate_bases]
    of_bases = (OutputType.alias_of_intermediate, OutputType.alias_of_intermediate_save_as_output)
    out, made = [], set()  # (the glue makes them in this order: a view of an earlier one too)
    for i, info in enumerate(meta.output_info):
        if i in direct:
            continue
        if info.output_type == OutputType.alias_of_input:
            base, where = inputs[info.base_idx], {"input": info.base_idx}
        elif info.output_type == OutputType.alias_of_intermediate_base_is_user_output \
                and (info.base_idx in direct or info.base_idx in made):
            base, where = values[info.base_idx], {"of": info.base_idx}
        elif info.output_type in of_bases:
            base, where = values[outputs + info.base_idx], {"of": outputs + info.base_idx}
        else:
            raise NotSplit("an output aliases an intermediate value or another aliased output, "
                           "or is an input")
        if info.requires_grad != info.requires_grad_for_backward:
            raise NotSplit("an output is a view made without grad mode")
        alias = values[i]
        if not isinstance(alias, torch.Tensor) or not isinstance(base, torch.Tensor):
            raise NotSplit("an aliased output is not a tensor")
        made.add(i)
        out.append({"output": i, **where, "size": list(alias.shape), "stride": list(alias.stride()),
                    "offset": alias.storage_offset() - base.storage_offset(),
                    "requires_grad": info.requires_grad})
    return out


def _without_returned_inputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list]:
    """``gm`` without the outputs that are its inputs as they came in (BatchNorm's
    ``num_batches_tracked``, which the commit then advances), and ``[output position, input
    position]`` for each: the glue returns those inputs themselves, as ``fx`` does."""
    import copy
    values = _output(gm).args[0]
    if not isinstance(values, (list, tuple)):
        return gm, []
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    passthrough = [[i, inputs.index(v)] for i, v in enumerate(values) if isinstance(v, torch.fx.Node) and v in inputs]
    if not passthrough:
        return gm, []
    if len(passthrough) == len(values):
        raise NotSplit("every output is an input")
    gm = copy.deepcopy(gm)
    output = _output(gm)
    dropped = {i for i, _ in passthrough}
    output.args = (tuple(v for i, v in enumerate(output.args[0]) if i not in dropped),)
    gm.recompile()
    return gm, passthrough


def _output_values(joint: torch.fx.GraphModule) -> list:
    """The fake value of each of the joint graph's results (None where it is not a node)."""
    return [v.meta.get("val") if isinstance(v, torch.fx.Node) else None for v in _output(joint).args[0]]


def _output(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _drop_none_outputs(gm: torch.fx.GraphModule) -> list[int]:
    """The backward returns a gradient or None per input: keep the gradients (a compiled
    graph returns tensors only); returns their input positions."""
    output = _output(gm)
    values = list(output.args[0])
    kept = [i for i, v in enumerate(values) if v is not None]
    if any(not isinstance(values[i], torch.fx.Node) for i in kept):
        raise NotSplit("the backward returns a constant gradient")
    output.args = ([values[i] for i in kept],)
    gm.recompile()
    return kept


def _examples_from_fakes(gm: torch.fx.GraphModule) -> None:
    """Each placeholder's ``meta["example"]``: a zero-filled tensor of its fake value's
    layout (what the flattened compilers trace with), without autograd."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        fake = node.meta.get("val")
        if not isinstance(fake, torch.Tensor) or any(not isinstance(s, int) for s in (*fake.shape, *fake.stride())):
            raise NotSplit(f"{node.name} is not a tensor of fixed size (saved: {type(fake).__name__})")
        with unset_fake_temporarily():
            node.meta["example"] = torch.empty_strided(
                tuple(fake.shape), tuple(fake.stride()), dtype=fake.dtype, device=fake.device).zero_()
