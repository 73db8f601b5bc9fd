"""An argument the captured code never reads is not guarded: an unused list whose length
changes, or an unused tensor whose shape changes, keeps the one graph (it captured again
for every new length before). Compared with eager on every call (values, the arguments
after the call); an argument read in any way (even after being rebound, or through
``locals()``) is still guarded."""
import torch

from differential import A, T, check


def _ignores_a_list(x, xs):
    return x * 2


def _ignores_a_list_and_a_tensor(x, xs, y, k):
    return x * k


def _lengths(i):
    return A(T(3), [T(2) for _ in range(2 + i)])


def test_an_unused_list_of_varying_length_is_captured_once():
    report = check(_ignores_a_list, _lengths, calls=12, expect="graph")
    assert report.stats.captures == 1, report
    assert not report.recompiles, report


def test_unused_arguments_of_varying_length_and_shape_are_captured_once():
    report = check(_ignores_a_list_and_a_tensor,
                   lambda i: A(T(3), [T(2)] * (1 + i % 5), T(i + 1, 2), 3), calls=12,
                   expect="graph")
    assert report.stats.captures == 1, report


def _rebinds(x, xs):
    xs = [x, x]  # the argument's value is never read, the name is
    return torch.stack(xs).sum(0) + len(xs)


def test_a_rebound_argument_is_equal_to_eager():
    check(_rebinds, _lengths, calls=8)


def _reads_the_length(x, xs):
    return x * len(xs)


def test_a_read_argument_is_still_guarded():
    # each length is a new value of ``len(xs)``: eager-equal on every call
    check(_reads_the_length, _lengths, calls=12)


def _through_locals(x, xs):
    return x * len(locals()["xs"])


def test_an_argument_read_through_locals_is_equal_to_eager():
    check(_through_locals, _lengths, calls=8)
