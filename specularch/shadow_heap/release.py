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
* the graph runs on ``fx`` (``entry_function._runs_on_fx``): a compiling backend's graph that
  raises is retried with ``fx`` on the same call, whose guards must see its gradients.

The commit then leaves out the released writes (no other write of a ``.grad`` came before
them, so every later one still runs after them, in program order).
"""
from __future__ import annotations

from typing import Iterable

from ..guards.sources import AttrSource, Source
from .rebuild import Constant, FromSource, Rebuild, walk
from .writes import DelAttr, SetAttr, Write


def early_releases(writes: list[Write], input_sources: Iterable[Source], output: Rebuild,
                   assertions) -> tuple[list[SetAttr], list[Write]]:
    """``(released, commit)``: the ``.grad = None`` writes the entry does before the graph,
    and the writes left for the commit, in program order."""
    if assertions or not any(_is_release(w) for w in writes):
        return [], writes
    if _reads_a_grad([*input_sources, *_sources_read(writes, output)]):
        return [], writes
    released, written = [], False
    for w in writes:
        if _is_release(w) and not written:
            released.append(w)
        elif isinstance(w, (SetAttr, DelAttr)) and w.name == "grad":
            written = True  # (any tensor's: two sources may name one tensor)
    ids = {id(w) for w in released}
    return released, [w for w in writes if id(w) not in ids]


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
