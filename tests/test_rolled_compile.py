"""Compiling backends on graphs with rolled loops (fx_lower/rolled_compile.py): the graph runs
as ``fx`` and the loop body is compiled once per input shapes and run from the loop, instead
of the backend refusing the graph. Equal to eager within rounding; bodies it cannot compile
keep running as ``fx`` and ``explain()`` says why."""
import pytest
import torch


from differential import A, T, check
from test_rolled_fast import LENGTHS, RTOL, _train_both


@pytest.mark.parametrize("dropout", [0.0])
def test_torchscript_compiles_the_lm_loop_body_and_trains_like_eager(dropout):
    report = _train_both(LENGTHS, dropout=dropout, templates="batched", rtol=RTOL, momentum=0.9,
                         backend="torchscript")
    assert report.stats.captures == 1 and not report.fallbacks, report
    graph = report.graphs[0]
    assert graph.backend == "torchscript", report
    assert "body compiled by torchscript" in graph.loops[0].faster, report
    assert list(graph.loops[0].trips)[-3:] == LENGTHS[-3:], report


def _index_in_arithmetic(x, w, n):
    h = x
    for t in range(n):
        h = torch.tanh(h @ w) + t  # the index reaches a tensor op: the body would specialise on it
    return h


def test_a_body_using_the_index_in_tensor_math_runs_as_fx_and_says_why():
    report = check(_index_in_arithmetic, lambda i: A(T(2, 3, requires_grad=True),
                                                     T(3, 3, requires_grad=True), [3, 5, 4, 6, 8, 7][i]),
                   calls=6, grad=True, expect="graph", backend="torchscript", rtol=RTOL, atol=1e-7)
    loop = report.graphs[-1].loops[0]
    assert loop.rolled and "body not compiled by torchscript: it uses the loop index" in loop.faster, report
