"""Old gradients released before the graph runs, as eager's ``zero_grad()`` releases them.

A training step that begins with ``opt.zero_grad()`` (``set_to_none``, the default) drops
last step's ``.grad`` tensors before its forward runs, so its backward's new gradients reuse
their memory. Deferred to the commit, the ``p.grad = None`` writes would keep the old
gradients alive while the graph makes the new ones: one more set of gradients at the peak,
whose pages a large model faults in anew each step (issue 14 item 6).

The entry does such a write before the graph (``RELEASE`` in ``entry_function.py``) when no
run can tell the difference:

* no write of a ``.grad`` other than these releases comes before it, and it was made before
  the call ran any graph op (``SetAttr.before_ops``): the graph cannot raise before it in eager's order, and the
  eager re-run after a graph that raised starts with ``.grad`` None, where eager itself is
  once its ``zero_grad()`` ran;
* nothing after the guards reads an old gradient (no graph input, commit value or return
  value is read through a ``.grad`` attribute), so the old value is not needed later;
* the graph has no in-graph assumption: an assumption that fails returns before the commit
  and the call runs eagerly from the state before it, as it does today;
* the graph runs on ``fx`` (``entry_function._runs_on_fx``, the entry's ``EARLY``): a
  compiling backend's graph that raises is retried with ``fx`` on the same call, whose
  guards must see its gradients.

The commit keeps the released writes among its gradient assignments, in program order: after
an early release each sets to None a ``.grad`` that is None already (no other write of a
``.grad`` came before them, so every later one still runs after them). So the entry's text is
the same whichever graph it calls, and a tiering candidate reuses the capture's compiled
entry code (``build_entry_function(built=)``).
"""
from __future__ import annotations

from typing import Iterable

from ..guards.guard import NotNoneGuard
from ..guards.sources import AttrSource, Source
from .rebuild import Constant, FromSource, Rebuild, walk
from .writes import DelAttr, SetAttr, Write


def early_releases(writes: list[Write], input_sources: Iterable[Source], output: Rebuild,
                   assertions, guards: Iterable = ()) -> list[SetAttr]:
    """The ``.grad = None`` writes the entry may do before the graph (the commit does them
    too, in program order, where they change nothing after an early release: each sets a
    ``.grad`` that no write before it set). ``guards``: a guard on a gradient other than
    ``zero_grad``'s "is it None" (``NotNoneGuard``) means the call's Python read it (``if
    p.grad is not None: ...`` before ``zero_grad()``); the eager re-run after a graph that
    raised must find it then, so nothing is released early."""
    if assertions or not any(_is_release(w) for w in writes):
        return []
    if _reads_a_grad([*input_sources, *_sources_read(writes, output)]) or _reads_a_grad(
            [g.source for g in guards if type(g) is not NotNoneGuard and isinstance(g.source, Source)]):
        return []
    released, written = [], False
    for w in writes:
        if _is_release(w) and not written:
            released.append(w)
        elif isinstance(w, (SetAttr, DelAttr)) and w.name == "grad":
            written = True  # (any tensor's: two sources may name one tensor)
    return released


def _is_release(w: Write) -> bool:
    return (isinstance(w, SetAttr) and w.name == "grad" and w.before_ops
            and isinstance(w.target, FromSource)
            and isinstance(w.value, Constant) and w.value.value is None)


def _sources_read(writes: list[Write], output: Rebuild) -> list[Source]:
    """The sources the commit and the return value read (the targets written included)."""
    roots = [r for w in writes for r in w.rebuilds() if isinstance(r, Rebuild)] + [output]
    return [r.source for root in roots for r in walk(root) if isinstance(r, FromSource)]


def _reads_a_grad(sources: list[Source]) -> bool:
    """Whether a source goes through some tensor's ``.grad`` (any path to it: the same
    parameter may be reached from a module and from an optimizer), a key's source too."""
    todo = list(sources)
    while todo:
        source = todo.pop()
        if isinstance(source, AttrSource) and source.attr == "grad":
            return True
        todo += [v for v in vars(source).values() if isinstance(v, Source)]
    return False


def release_lines(render, released: list[SetAttr]) -> list[str]:
    """The statements the entry runs between its guards and its graph: the writes, then the
    guards' own locals of the old gradients deleted (``zero_grad``'s "is not None" check
    reads each into one), so that nothing holds them while the graph runs."""
    if not released:
        return []
    lines = [f"RELEASE_GRADS(({', '.join(render.expr(w.target) for w in released)}, ))"]
    held = [render.namer.named(AttrSource(w.target.source, "grad")) for w in released]
    if any(held):
        lines.append(f"del {', '.join(name for name in held if name)}")
    return lines


def _release_grads(tensors: tuple) -> None:
    for t in tensors:
        t.grad = None


NAMESPACE = {"RELEASE_GRADS": _release_grads}
