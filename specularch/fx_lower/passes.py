"""Graph passes. Each takes a GraphModule and returns a new one (the input is not changed);
the result's ``meta["constructed_by"]`` names the pass."""
from __future__ import annotations

import copy
import operator

import torch
import torch.fx

# call_method ops whose Python-number keyword becomes a multiplication by a 0-d tensor:
# method -> (keyword, out-of-place form using the scaled operand).
_SCALED_KEYWORD = {"add": "alpha", "add_": "alpha", "sub": "alpha", "sub_": "alpha",
                   "addcdiv_": "value", "addcmul_": "value"}


def scalar_inputs_as_tensors(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[int]]:
    """Python-number inputs (a learning rate, Adam's step count) become 0-d float64 tensor
    inputs, so a compiler that would specialise on a number's value cannot. Keyword scalars
    (``alpha=``, ``value=``) fed by them are folded into the tensor operand:
    ``p.add_(g, alpha=a)`` → ``p.add_(g * a)``; ``p.addcdiv_(t1, t2, value=v)`` →
    ``p.add_(t1 / t2 * v)``. Returns the new module and the positions of converted inputs."""
    new = copy.deepcopy(gm)
    graph = new.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    converted = [i for i, n in enumerate(placeholders) if isinstance(n.meta.get("example"), (int, float))]
    derived = {placeholders[i] for i in converted}
    for node in list(graph.nodes):  # nodes computed from converted inputs are tensors now
        if node.op == "call_function" and node.target.__module__ in ("_operator", "operator") and \
                any(isinstance(a, torch.fx.Node) and a in derived for a in node.args):
            derived.add(node)
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in _SCALED_KEYWORD:
            continue
        key = _SCALED_KEYWORD[node.target]
        scale = node.kwargs.get(key)
        if not isinstance(scale, torch.fx.Node) or scale not in derived:
            continue
        with graph.inserting_before(node):
            if node.target == "addcdiv_":
                operand = graph.call_function(operator.truediv, (node.args[1], node.args[2]))
            elif node.target == "addcmul_":
                operand = graph.call_function(operator.mul, (node.args[1], node.args[2]))
            else:
                operand = node.args[1]
            scaled = graph.call_function(operator.mul, (operand, scale))
        kwargs = {k: v for k, v in node.kwargs.items() if k != key}
        target = node.target if node.target in ("add", "add_", "sub", "sub_") else "add_"
        node.target = target
        node.args = (node.args[0], scaled)
        node.kwargs = kwargs
    graph.lint()
    new.recompile()
    new.meta = dict(gm.meta, constructed_by="specularch.fx_lower.passes.scalar_inputs_as_tensors")
    return new, converted


def as_tensor_input(value, device=None) -> torch.Tensor:
    """A Python-number graph input as the 0-d tensor ``scalar_inputs_as_tensors`` expects."""
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64,
                        device=device)
