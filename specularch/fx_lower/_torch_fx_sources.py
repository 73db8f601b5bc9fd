"""torch.fx keeps the source text of every GraphModule it generates code for (for
tracebacks): in its loader's ``eval_cache`` and in ``linecache``, under
``<eval_with_key>.N``, and never removes it. A process that captures and drops many models
(each capture and backend compile makes several GraphModules) would keep all of it. Here the
keys generated while a graph was captured or compiled are forgotten when that graph is
freed. The private names used (``torch.fx.graph_module._loader``, its ``next_id`` and
``eval_cache``) stay in this file.

Keys are taken as a range of ``next_id``: a GraphModule another thread made inside that
range loses its source lines in tracebacks once the graph is freed (its code still runs)."""
from __future__ import annotations

import linecache
import weakref

from torch.fx import graph_module as _fx_graph_module

_PREFIX = "<eval_with_key>."


def mark() -> int:
    """Where the next generated GraphModule code's key will be numbered from."""
    return getattr(_fx_graph_module._loader, "next_id", 0)


def release_with(owner, since: int) -> None:
    """Forget the sources generated since ``since`` once ``owner`` is freed."""
    keys = [f"{_PREFIX}{i}" for i in range(since, mark())]
    if keys:
        weakref.finalize(owner, _forget, keys)


def _forget(keys: list[str]) -> None:
    cache = getattr(_fx_graph_module._loader, "eval_cache", {})
    for key in keys:
        cache.pop(key, None)
        linecache.cache.pop(key, None)
