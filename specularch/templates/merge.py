"""One graph pass: the calls of one template family with the same context (``[self.encode(t)
for t in trees]``) become one ``Family.run_many`` call, so the trees of a batch share one
wavefront (a level of every tree in one batched op) instead of one walk each.

Calls are merged only when nothing between the first and the last draws random numbers (the
merged walk draws in the same order as the separate calls only then) and every argument is
defined before the first call (structures and context objects are graph inputs)."""
from __future__ import annotations

import operator

import torch.fx

from ..fx_lower.randomness import is_random_node


def paths_for_gradients(graph: torch.fx.Graph) -> None:
    """In a graph that differentiates (``loss.backward()`` is one ``torch.autograd.grad``
    node over the tensors the capture's paths read), each family call may run only the paths
    its capture ran (``Family.run_many``'s ``only``): a path it did not would read parameters
    whose gradient the graph does not compute, and the optimizer step after it would leave
    them (a step captured on a lone leaf, then a tree: the inner parameters kept still)."""
    if not any(n.op == "call_function" and n.target is torch.autograd.grad for n in graph.nodes):
        return
    for node in graph.nodes:
        if node.meta.get("template_family") is not None and node.op == "call_function" \
                and "template_paths" in node.meta:
            node.kwargs = {**node.kwargs, "only": node.meta["template_paths"]}


def merge_family_calls(graph: torch.fx.Graph) -> None:
    groups: dict = {}
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        family = node.meta.get("template_family")
        if family is not None and node.op == "call_function":
            groups.setdefault((family, node.args[1], node.args[2]), []).append(node)
    for (family, ctx_objects, tensors), calls in groups.items():
        if len(calls) < 2 or not _mergeable(graph, calls, order):
            continue
        first = calls[0]
        with graph.inserting_before(first):
            merged = graph.call_function(family.run_many,
                                         (tuple(c.args[0] for c in calls), ctx_objects, tensors))
            merged.meta.update(first.meta)
            merged.meta["template_paths"] = frozenset().union(
                *(c.meta.get("template_paths", ()) for c in calls))
            merged.meta["example"] = tuple(c.meta.get("example") for c in calls)
            for k, call in enumerate(calls):
                item = graph.call_function(operator.getitem, (merged, k))
                item.meta.update(call.meta)
                call.replace_all_uses_with(item)
        for call in calls:
            graph.erase_node(call)


def _mergeable(graph: torch.fx.Graph, calls: list, order: dict) -> bool:
    first, last = order[calls[0]], order[calls[-1]]
    between = [n for n in graph.nodes if first < order[n] < last]
    if any(is_random_node(n) for n in between):
        return False
    inputs = {a for c in calls for a in c.all_input_nodes}
    return all(order[a] < first for a in inputs)
