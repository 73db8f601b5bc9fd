"""What ``explain()`` says about templates: per family its paths (with their path guards),
instances and batch sizes, and every recursion that stayed unrolled, with why."""
from __future__ import annotations


def template_lines(graph_modules) -> list[str]:
    families, unrolled = [], {}
    for gm in graph_modules:
        for node in gm.graph.nodes:
            family = node.meta.get("template_family")
            if family is not None and family not in families:
                families.append(family)
        unrolled.update(gm.meta.get("unrolled_recursion", {}))
    out = []
    for family in families:
        out += _family_lines(family)
    out += [f"  recursion unrolled (one graph per structure): {code.co_qualname}: {why}"
            for code, why in unrolled.items()]
    return out


def _family_lines(family) -> list[str]:
    s = family.stats
    lines = [f"  template {family.name}: {len(family.paths)} path(s); calls={s['calls']} "
             f"instances={s['instances']} batched={s['batched_instances']} in {s['batches']} "
             f"batches (largest {s['largest_batch']})"]
    last = family.last_call
    if last:
        sizes = ",".join(str(n) for n in last["batches"]) or "-"
        lines.append(f"    last call: {last['instances']} instances, {last['levels']} levels, "
                     f"batch sizes {sizes}{' (exact order)' if last['exact'] else ''}")
    for i, path in enumerate(family.paths):
        form = path.batched
        how = ("" if form is None else " batched" if not isinstance(form, str)
               else f" one by one ({form})")
        lines.append(f"    path {i}: runs={path.runs}{how}; holes={len(path.holes)}; "
                     f"{path.describe()}")
    if family.closed:
        lines.append(f"    no new paths at run time: {family.closed}")
    return lines
