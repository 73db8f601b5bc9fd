"""``for k, (x, y) in enumerate(zip(xs, ys))`` (and ``enumerate(zip(...), start)``) over
lists passed whole (``symbolic/rolled/lists.py``): rolled as ``zip`` is, handing out ``(start + k,
(xs[k], ys[k]))`` for ``min(len(xs), len(ys))`` iterations. Compared with eager over 30
lengths (values, gradients, the lists after the call): one capture."""
import pytest
import torch

import specularch

from differential import A, check

from test_rolled_zip import LENGTHS, MODES, _args, _assert_rolled_once


def _enumerated_rnn(xs, ys, w, h):
    outs = []
    for k, (x, y) in enumerate(zip(xs, ys)):
        h = torch.tanh(x @ w + h) * y + k
        outs.append(h.sum(1) * k)
    return torch.stack(outs), h, k, x


def _enumerated_from(xs, ys, w, h):
    for k, (x, y) in enumerate(zip(xs, ys), 3):
        h = torch.tanh(x @ w + h) * y / k
    return h, k


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, form", [
    (_enumerated_rnn, "for k, (x, y) in enumerate(zip(L['xs'], L['ys']))"),
    (_enumerated_from, "for k, (x, y) in enumerate(zip(L['xs'], L['ys']), 3)"),
])
def test_enumerate_of_zip_is_rolled_once(fn, form, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, _args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report, form)


def _uneven(i):
    (xs, ys, w, h), _ = _args(i)
    return A(xs, ys[: max(1, len(ys) - i % 3)], w, h)


def test_enumerate_of_zip_of_uneven_lists_stops_at_the_shortest():
    report = check(_enumerated_rnn, _uneven, calls=len(LENGTHS), grad=True)
    assert report.stats.captures == 1, report


def _listed(xs, ys, w, h):
    for x, y in list(zip(xs, ys)):  # not enumerate: the zip is consumed whole
        h = torch.tanh(x @ w + h) * y
    return h


def test_a_zip_passed_to_another_builtin_before_its_loop_is_equal_to_eager():
    check(_listed, _args, calls=8, grad=True)
