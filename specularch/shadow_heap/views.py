"""Read-your-writes for lists and dicts that existed before the call.

Capture reads a pre-existing list or dict into a container value whose items are other
values. The first write to it in the call (``ShadowHeap.touch_container``) opens a
``ContainerView`` here, keyed by the container value's identity: from then on the container
value reads and writes its items through the view (``ListV.items``/``DictV.items`` delegate
to ``view.current``), the real object stays untouched, and the commit stores ``current``
(``ReplaceList``/``ReplaceDict``). ``base`` keeps the items as capture read them before the
first write, so the heap can say what the call changed and ``discard`` can hand the
container back its unwritten items.

The items are opaque here (whatever capture put in: values of ``symbolic/values``), so this
package never imports the layer that uses it.
"""
from __future__ import annotations

from typing import Any, Iterator


class ContainerView:
    """The contents of one pre-existing list or dict as this call has left them so far.

    ``current`` is the container's own item list/dict (capture mutates it in place, so a
    reference taken before the first write still sees later ones); ``base`` is a shallow
    snapshot taken at the first write."""

    __slots__ = ("current", "base")

    def __init__(self, items: list | dict) -> None:
        self.current = items
        self.base = dict(items) if isinstance(items, dict) else list(items)

    # ---- reads: what later code in the call sees --------------------------------------------
    def __len__(self) -> int:
        return len(self.current)

    def __getitem__(self, key: Any) -> Any:
        return self.current[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.current)

    def __contains__(self, key: Any) -> bool:
        return key in self.current

    def is_dict(self) -> bool:
        return isinstance(self.current, dict)

    def changed(self) -> bool:
        """Whether the call left different items (by identity) than capture read."""
        now, then = self.current, self.base
        if len(now) != len(then):
            return True
        if isinstance(now, dict):
            return list(now) != list(then) or any(now[k] is not then[k] for k in now)
        return any(a is not b for a, b in zip(now, then))
