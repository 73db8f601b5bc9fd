"""The AST driver: parse, apply every rule in order, unparse, report."""
from __future__ import annotations

import ast

from .rules import RULES, Context


def convert(source: str, *, scale_lr: bool = True, wrap_ddp: bool = True) -> tuple[str, list]:
    """The distributed script and the list of ``(line, rule, what)`` rewrites.

    Raises ``rules.Refused`` naming the line and the rule when the script breaks a restriction.
    """
    tree = ast.parse(source)
    ctx = Context(scale_lr=scale_lr, wrap_ddp=wrap_ddp)
    for apply in RULES.values():
        apply(tree, ctx)
    ast.fix_missing_locations(tree)
    header = "# Converted for torch.distributed by `python -m specularch.ddp_convert`.\n"
    return header + ast.unparse(tree) + "\n", sorted(ctx.reports, key=lambda r: r[0])
