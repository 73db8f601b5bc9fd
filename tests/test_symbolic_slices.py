"""Slices with a symbolic bound (``values.SliceV``): ``x[:n]`` with ``n`` a dynamic size, and
``x[t:t + 2]`` with ``t`` a rolled loop's index, are graph ops on those numbers. Before, a
dynamic size in a slice was read as a constant (a guard: one graph per size, a recompile
storm) and a loop index in one unrolled the loop (one graph per trip count). Differential
against eager: values, gradients, in-place writes through the slice, negative and
out-of-range bounds, steps; slicing a Python list or string still takes the number's value."""
import pytest
import torch

from differential import A, T, check

SIZES = [5, 6, 7, 8, 9, 6, 10, 5, 7, 8]


def _sized(*shape, grad=False):
    return lambda i: A(T(*shape, requires_grad=grad), T(SIZES[i % len(SIZES)]))


def bounds(x, y):
    n = y.shape[0]
    return x[:n], x[-n:], x[: -n], x[n - 3:2 * n:2], x[3 * n:], x[:3 * n]


def two_dims(x, y):
    n = y.shape[0]
    return x[..., :n].sum(-1), x[1:n, n - 4:], x[:, n]


def written(x, y):
    n = y.shape[0]
    z = x.clone()
    z[:n] = 0
    z[n:] += y.sum()
    return z


def with_grad(x, y):
    n = y.shape[0]
    return (x[:n] * y).sum() + x[n:].pow(2).sum()


@pytest.mark.parametrize("backend", [None, "torchscript"])
@pytest.mark.parametrize("fn, make, grad", [
    (bounds, _sized(20), False), (two_dims, _sized(12, 20), False), (written, _sized(20), False),
    (with_grad, _sized(20, grad=True), True)])
def test_a_slice_by_a_dynamic_size_is_one_graph_for_every_size(fn, make, grad, backend):
    report = check(fn, make, calls=10, grad=grad, backend=backend, expect="graph")
    assert report.stats.captures == 1 and not report.stats.recompiles, report


def window(x, h, n):
    for t in range(n):
        h = torch.tanh(h + x[t:t + 2].sum(0))
    return h


def test_a_slice_by_a_rolled_loop_index_keeps_the_loop_rolled():
    report = check(window, lambda i: A(T(14, 3), T(3), 4 + i % 5), calls=10, expect="graph")
    assert report.stats.captures == 1 and report.graphs[0].loops[0].rolled, report


def python_list(x, y):
    n = y.shape[0]
    return torch.stack([x * i for i in range(10)][:n]).sum(0) * len("abcdefghijkl"[:n])


def test_slicing_a_python_list_or_string_still_takes_the_number():
    """A list or a string sliced by a size is Python's own work: the number's value is used
    (guarded), one graph per size, as before."""
    report = check(python_list, _sized(3), calls=10, expect="graph")
    assert report.stats.captures >= 2, report


def layout(x):
    return x.t().is_contiguous(), x.t()[:2].is_same_size(x[:2])


def test_layout_queries_of_a_dynamic_tensor_are_checked_not_baked_in():
    """``x.t().is_contiguous()`` is True at sizes 0 and 1 of a dynamic dimension and False
    otherwise: the graph checks the answer it assumed (it was baked in, unguarded); where it
    differs, the call runs eagerly and the function's sizes become static."""
    report = check(layout, lambda i: A(T([5, 6, 7, 8, 1, 9, 0, 4][i % 8], 12)), calls=12)
    assert report.stats.assumption_failures >= 1, report


def masked(x):
    k = x[x > 0]
    return x.new_zeros(len(k)), k.shape, torch.nonzero(x > 0).shape[0], x[:len(k)] * 2


def test_sizes_made_from_data_are_read_when_the_graph_runs():
    """``x[x > 0]``, ``nonzero``: their sizes come from the data, and were read as the
    capture's constants where the inputs' sizes are static (a silent wrong answer, found by
    the dynamic-metadata sweep); they are dynamic sizes now (``tracer._data_shaped``)."""
    signs = [[1, 1, 1, -1], [1, -1, 1, -1], [-1, -1, -1, 1], [1, 1, 1, 1], [-1] * 4]
    report = check(masked, lambda i: A(torch.tensor(signs[i % 5], dtype=torch.float) * (i + 1)),
                   calls=10, expect="graph")
    assert report.stats.captures == 1, report
