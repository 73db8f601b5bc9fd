"""torch.fx's generated code calls torch's functions by qualified name (``torch.relu(x)``),
looked up each time the graph runs (``torch.fx.graph``: ``_is_from_torch`` targets are not
bound as objects). When that name no longer finds the function captured — ``torch.relu``
patched, and the capture saw the original through the patch's closure — the graph would call
the patch instead (applying it twice). Such targets are bound as objects instead. The only
private torch API used is ``torch.fx.node._get_qualified_name``; it stays in this file.
"""
from __future__ import annotations

import functools

import torch
import torch.fx


def bind_renamed_targets(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every call to a torch function whose qualified name now finds another
    object called through a wrapper bound to the captured function (rare: a patch)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and _found_by_name(node.target) is not node.target:
            node.target = _bound(node.target)
            changed = True
    if changed:
        gm.recompile()
    return gm


_NOT_FOUND = object()


def _found_by_name(target):
    """What the generated code's ``torch.a.b`` for ``target`` evaluates to now; ``target``
    itself for targets FX binds as objects anyway."""
    module = getattr(target, "__module__", None) or ""
    if module.split(".")[0] != "torch":
        return target
    try:
        from torch.fx.node import _get_qualified_name
        name = _get_qualified_name(target)
    except Exception:  # FX cannot name it: it binds the object itself
        return target
    if not name.startswith("torch."):
        return target
    found = torch
    for part in name.split(".")[1:]:
        found = getattr(found, part, _NOT_FOUND)
        if found is _NOT_FOUND:
            return found
    return found


def _bound(target):
    @functools.wraps(target, assigned=("__name__", "__qualname__", "__doc__"))
    def call(*args, **kwargs):
        return target(*args, **kwargs)
    return call
