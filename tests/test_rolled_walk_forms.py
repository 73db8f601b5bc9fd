"""More forms of rolled linked walks (``symbolic/rolled/walk.py``), each compared with eager over 30
walk lengths (values, gradients, the nodes after the call): one capture, the walk rolled."""
import pytest
import torch

import specularch

from differential import A, check

from test_rolled_walk import LENGTHS, MODES, Node, _args, _loops


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


def _walk_truthy(node, w, h):
    outs = []
    while node:  # a Node has no __bool__/__len__: true unless None
        h = torch.tanh(node.x @ w + h) * node.scale
        outs.append(h.sum(1))
        node = node.next
    return torch.stack(outs), h, node


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_walk_tested_by_truthiness_is_rolled_once(templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(_walk_truthy, _args, calls=len(LENGTHS), grad=True, expect="graph",
                       rtol=rtol, atol=rtol * 1e-2)
    assert report.stats.captures == 1, report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == "while node: node = node.next", report


class Sized(Node):
    def __len__(self):  # decides ``bool(node)``: ``while node:`` is not ``is not None``
        return 0 if self.scale == 0 else 1


def _sized_args(i):
    (head, w, h), _ = _args(i)
    nodes = []
    while head is not None:
        nodes.append(Sized(head.x, head.scale, None))
        head = head.next
    for a, b in zip(nodes, nodes[1:]):
        a.next = b
    return A(nodes[0], w, h)


def test_a_walk_over_nodes_with_len_stops_where_eager_does():
    # scales cycle -1, 0, 1: ``while node:`` stops at the first node of scale 0
    report = check(_walk_truthy, _sized_args, calls=12, grad=True)
    assert not any(loop.rolled for loop in _loops(report)), report


def _falsy_next_args(i):
    (head, w, h), _ = _args(i)
    if i % 4 == 3:  # after capture: a walk that ends at 0, not None
        last = head
        while last.next is not None:
            last = last.next
        last.next = 0
    return A(head, w, h)


def test_a_walk_ending_at_a_falsy_value_other_than_none_is_never_wrong():
    report = check(_walk_truthy, _falsy_next_args, calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
