"""Rolled loops at capture: a loop whose trip count varies between calls captured once, its
body a ``GraphModule`` that one ``RolledLoop`` node runs per iteration (docs/recursion.md).

In the order a loop goes through them:

* the loop's form, recognised at its head, each one handing ``loops.py`` a trip count and
  the value of the loop variable per iteration:
  ``loops.py`` — ``for t in range(n)`` over a symbolic ``n`` at ``FOR_ITER``, and what every
  form shares: iteration 0 run as any code, iteration 1 recorded with a symbolic index,
  ``RolledLoop``, ``LoopReport``;
  ``lists.py`` — ``for x in xs`` (``enumerate``, ``zip``) over a list of like tensors from the
  call, passed into the graph whole (``RollList``: capture starts again);
  ``objects.py`` — such a list of user objects of one class (``ObjectListV``, ``RowV``);
  ``rows.py`` — ``for row in x`` / ``for x_t in x.unbind(d)`` over a dynamic dimension of a
  tensor (``RowsIterV``);
  ``while_loops.py`` — ``while i < n:`` with a counter stepped by a constant;
  ``walk.py`` — ``while node is not None: ...; node = node.next`` over objects from the call;
* ``match.py`` — the frame at the loop's head and after iteration 1 compared (``Snapshot``,
  ``Match``): carried values, index slots, appended lists, or a refusal (``RollRefused``,
  made in ``values/rolled.py``: capture starts again with the loop unrolled);
* iteration 1's nodes made into the body (``loops.py``), then, outside exact mode:
  ``hoist.py`` — what feeds only the appended values runs once after the loop
  (``HoistedTail``);
  ``first.py`` — iteration 0 run by the body too, where it is the body's own work;
  ``fast.py`` — the body made cheaper: a prelude before the loop, fused LSTM cells, a stack
  of them as one node (run by ``fx_lower/rolled/``), with
  ``project.py`` — a cell's input projection moved into the prelude;
* when capture ends: ``hoist.stack_whole``, then ``head.py`` — a hoisted one-op tail that
  also computes iteration 0's item (``HeadedTail``);
* ``unrolled.py`` — the loops that stay unrolled, noted at their backward jumps with the
  reason, for ``explain()``.

The values a rolled loop puts on the stack are in ``values/rolled.py``, below this package;
its run-time pieces are in ``fx_lower/rolled/``. Layer (``tests/test_layering.py``): under
the core, ``ops/``, ``library/`` and ``capture.py``, which import it as they import
``speculation/``; above ``speculation/``, of which it imports nothing yet. A module of this
package is imported under its name as a flat module, ``from .rolled import lists as
rolled_lists``: the short names are common locals (``first``, ``lists``, ``head``), and
``rolled_lists.row`` says at the call what it is.
"""
