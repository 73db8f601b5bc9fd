"""What a capture must not specialise on: the one contract between the dispatcher, which
learns it (profiling, relaxation, speculation that failed), and the tracer, which obeys it.

A capture is given one ``Assumptions`` and cannot change it; the dispatcher builds a new one
for each capture from what it learnt so far (``relax.Generalisation`` and the tensor branches
seen going both ways).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class Assumptions:
    # (id(code), instruction index) of tensor branches seen going both ways: merged, not
    # speculated (raising_branch.py may speculate one again within a capture)
    unstable_sites: frozenset = frozenset()
    # argument slot -> the dims whose size varies between calls (sizes become SymV)
    dynamic_dims: Mapping[int, frozenset] = field(default_factory=dict)
    # tensors inside tuple/list arguments (their source) -> the dims whose size varies
    dynamic_sources: Mapping = field(default_factory=dict)
    # argument slots whose int/float is a graph input instead of a guarded constant
    symbolic_scalars: frozenset = frozenset()
    # other int/float sources read as graph inputs (``self.count``)
    symbolic_sources: frozenset = frozenset()
    # list sources only appended to (``self.history.append(x)``): length not guarded
    append_only: frozenset = frozenset()
    # dict sources used through single keys (``self.cache[k] = v``): keys not guarded
    keyed_dicts: frozenset = frozenset()
    # (id(code), offset of FOR_ITER) of loops that could not be rolled: unrolled
    unrolled_loops: frozenset = frozenset()
    # rolled loops keep every op in their body, in eager's order (config.templates == "exact"):
    # nothing is hoisted after the loop (rolled/hoist.py), so results are eager's bit for bit
    exact_loops: bool = False
    # list sources whose length changed between calls: a ``for x in`` loop over one rolls
    varied_lists: frozenset = frozenset()
    # (source, site, where) of lists a rolled ``for x in xs`` loop reads whole (rolled/lists.py)
    rolled_lists: frozenset = frozenset()
    # sizes of dynamic intermediates that stay fixed are numbers of the graph (static_sizes.py);
    # off where only fx will run it: there its in-graph size checks cost microseconds, and
    # deciding costs 1-2 s of imports once per process
    fold_fixed_sizes: bool = True
    # argument slot -> the sizes of one earlier call (every slot from the same call) at which
    # a compile of the dynamic dims is traced: a full batch, not a short last one that
    # made the dims dynamic (a kernel choice read from the batch is then the common one's)
    size_hints: Mapping[int, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Callers pass their live sets; the capture keeps a snapshot no later relaxation
        # can change under it.
        for name in ("unstable_sites", "symbolic_scalars", "symbolic_sources", "append_only",
                     "keyed_dicts", "unrolled_loops", "rolled_lists", "varied_lists"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        dims = {}
        for slot, slot_dims in dict(self.dynamic_dims).items():
            if not isinstance(slot, int) or not all(isinstance(d, int) for d in slot_dims):
                raise TypeError(f"dynamic_dims maps argument slots to dims (ints), got "
                                f"{slot!r}: {slot_dims!r}")
            dims[slot] = frozenset(slot_dims)
        object.__setattr__(self, "dynamic_dims", MappingProxyType(dims))
        object.__setattr__(self, "size_hints", MappingProxyType(
            {slot: tuple(shape) for slot, shape in dict(self.size_hints).items()}))
        object.__setattr__(self, "dynamic_sources", MappingProxyType(
            {source: frozenset(d) for source, d in dict(self.dynamic_sources).items()}))
