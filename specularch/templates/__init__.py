"""Recursion templates: a recursive function is captured once per *path* (the guards its body
takes on the recursion's structure argument: leaf or inner node, ...) instead of once per
structure. Its recursive calls become holes of the path's graph; at run time a walker picks a
path per node of the new structure and runs the path graphs bottom-up, in exact order
(bit-identical to eager) or batched by wavefront (all ready instances of one path in one call,
equal to eager within float rounding).

* ``paths.py`` — capturing one path (a separate tracer; holes for the recursive calls).
* ``family.py`` — the paths of one recursive function, path selection, exact evaluation.
* ``wavefront.py`` — planning a structure into levels and running each level batched.
* ``rowwise.py`` — whether a path graph can run on many instances at once, and that form.
* ``weight_grads.py`` — a ``linear`` weight's gradient made once per batched call.
* ``callsite.py`` — where capture meets recursion: the hook called by ``symbolic.calls``.
"""

from ..symbolic import hooks as _hooks
from .callsite import recursive_call as _recursive_call
from .merge import merge_family_calls as _merge_family_calls, paths_for_gradients as _for_gradients


def _after_graph(tracer) -> None:
    _merge_family_calls(tracer.graph)
    _for_gradients(tracer.graph)


_hooks.install(on_recursion=_recursive_call, on_graph=_after_graph)
