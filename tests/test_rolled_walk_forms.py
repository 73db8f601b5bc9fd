"""More forms of rolled linked walks (``rolled_walk.py``), each compared with eager over 30
walk lengths (values, gradients, the nodes after the call): one capture, the walk rolled."""
import pytest
import torch

import specularch

from differential import check

from test_rolled_walk import LENGTHS, MODES, _args, _loops


def _walk(node, w, h):
    while node is not None:
        h = torch.tanh(node.x @ w + h) * node.scale
        node = node.next
    return h


def _walks_twice(node, w, h):
    # one helper, two walks from the same head: one graph input for the head
    return _walk(node, w, h) + _walk(node, w, h * 2)


@pytest.mark.parametrize("templates, rtol", MODES)
def test_two_walks_from_one_head_are_rolled_in_one_capture(templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(_walks_twice, _args, calls=len(LENGTHS), grad=True, expect="graph",
                       rtol=rtol, atol=rtol * 1e-2)
    assert report.stats.captures == 1, report
    assert len([loop for loop in _loops(report) if loop.rolled]) == 2, report
