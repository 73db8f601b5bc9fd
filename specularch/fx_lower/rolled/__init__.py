"""Rolled loops at run time: how a captured loop's body (``symbolic/rolled/``) runs, once per
iteration or as one node for the whole loop, and how a compiling backend takes a graph that
has such loops (docs/recursion.md).

In the order a call reaches them:

* ``cells.py`` — a body's ``lstm_cell`` as one autograd node per iteration and one
  weight-gradient product per call (``fuse``, ``_FusedCell``, ``_WeightSink``; the projected
  cell, whose input projection ran before the loop);
* ``stack_plan.py`` — whether a body of fused cells is nothing but a stack of them, and the
  sizes its inputs must keep;
* ``stack.py`` — such a loop run as one autograd node for all its iterations (``Stack``,
  ``_StackFn``);
* ``compiled.py`` — the compiling backends on a graph with rolled loops: the graph runs as
  ``fx``, each loop body compiled for its first input shapes, then once for every size that
  varies (``compile_bodies``, ``with_own_loops``).

Capture (``symbolic/rolled/``) builds the loops and imports these modules; nothing here
imports capture. A module of this package is imported under its name as a flat module,
``from ..fx_lower.rolled import cells as rolled_cells``: the short names are common locals
(``cells``, ``stack``), and ``rolled_cells.fuse`` says at the call what it is.
"""
