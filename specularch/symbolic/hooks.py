"""Hook points where capture hands a call to a capability above it (recursion templates,
``specularch/templates``), which registers itself when imported: symbolic/ never imports it.

* ``recursion(tracer, code, globals_, bound) -> value | None``: an inlined call; a value means
  the capability handled it (a template family call), None means inline it as usual.
* ``after_graph(tracer)``: the finished graph of a capture, before dead-code elimination (the
  template calls of one family merged into one walk).
"""
from __future__ import annotations

from typing import Callable

recursion: Callable | None = None
after_graph: Callable | None = None


def install(*, on_recursion: Callable, on_graph: Callable) -> None:
    global recursion, after_graph
    recursion, after_graph = on_recursion, on_graph
