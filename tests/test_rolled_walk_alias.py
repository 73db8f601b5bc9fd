"""Tensors inside the nodes of a rolled linked walk (``symbolic/rolled/walk.py``) or the items
of a rolled list of objects (``symbolic/rolled/objects.py``) that alias a tensor the call writes
in place: the rolled body reads the nodes' tensors when the graph runs, before the commit, so a node
whose tensor is (a view of) the written one would read the old value where eager reads the
new one. The aliasing is guarded (``ListDistinctGuard`` over the walk, as over lists passed
whole): such a call is captured again or runs eagerly, never wrong. Compared with eager
over many lengths, with the aliasing node appearing on some calls only (after capture)."""
import pytest
import torch

import specularch

from differential import A, T, assert_same, check

from test_rolled_walk import _chain, _loops

LENGTHS = list(range(2, 14))


def _bump_then_walk(node, p, w):
    p.add_(1.0)  # an in-place write into an input; the walk below reads it through a node
    h = torch.zeros(3, 5)
    while node is not None:
        h = torch.tanh(node.x @ w + h)
        node = node.next
    return h


def _walk_then_bump(node, p, w):
    h = torch.zeros(3, 5)
    while node is not None:
        h = torch.tanh(node.x @ w + h)
        node = node.next
    p.mul_(0.5)
    return h * p.sum()


def _alias(p, how):
    return p if how == "same" else p[3:]  # a view at an offset, with a node's metadata


def _walk_args(how, every=4):
    def make_args(i):
        n = LENGTHS[i % len(LENGTHS)]
        p = T(3, 5) if how == "same" else T(6, 5)
        head = _chain([T(3, 5) for _ in range(n)], [1] * n)
        if i % every == every - 1:  # after capture: a node's tensor is the written one
            node = head
            for _ in range(i % n):
                node = node.next
            node.x = _alias(p, how)
        return A(head, p, T(5, 5))
    return make_args


# every 4th call aliases: the capture's own call among them; every 5th: only later calls
@pytest.mark.parametrize("every", [4, 5])
@pytest.mark.parametrize("how", ["same", "view"])
@pytest.mark.parametrize("fn", [_bump_then_walk, _walk_then_bump])
def test_a_node_tensor_aliasing_a_written_input_is_never_wrong(fn, how, every):
    report = check(fn, _walk_args(how, every), calls=2 * len(LENGTHS))
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


class Item:
    def __init__(self, x):
        self.x = x


def _bump_then_loop(items, p, w):
    p.add_(1.0)
    h = torch.zeros(3, 5)
    for it in items:
        h = torch.tanh(it.x @ w + h)
    return h


def _item_args(how, every=4):
    def make_args(i):
        n = LENGTHS[i % len(LENGTHS)]
        p = T(3, 5) if how == "same" else T(6, 5)
        items = [Item(T(3, 5)) for _ in range(n)]
        if i % every == every - 1:
            items[i % n].x = _alias(p, how)
        return A(items, p, T(5, 5))
    return make_args


@pytest.mark.parametrize("every", [4, 5])
@pytest.mark.parametrize("how", ["same", "view"])
def test_an_object_items_tensor_aliasing_a_written_input_is_never_wrong(how, every):
    report = check(_bump_then_loop, _item_args(how, every), calls=2 * len(LENGTHS))
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _walk(node, w, h):
    while node is not None:
        h = torch.tanh(node.x @ w + h)
        node = node.next
    return h



def _stepper(w):
    opt = torch.optim.SGD([w], lr=0.1)

    def step(node):
        opt.zero_grad()
        (w.tanh() ** 2).sum().backward()
        opt.step()  # writes w in place; the second walk reads it through a node on some calls
        return _walk(node, w, torch.ones(3, 5))
    return step


@pytest.mark.parametrize("every", [4, 5])
def test_a_node_tensor_viewing_a_parameter_the_optimizer_steps_is_never_wrong(every):
    w_eager = torch.randn(5, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w_opt = w_eager.detach().clone().requires_grad_(True)
    eager, opt = _stepper(w_eager), specularch.optimize(_stepper(w_opt))
    data = torch.Generator().manual_seed(1)
    for i in range(2 * len(LENGTHS)):
        n = LENGTHS[i % len(LENGTHS)]
        xs = [torch.randn(3, 5, generator=data) for _ in range(n)]
        heads = _chain(xs, [1] * n), _chain([x.clone() for x in xs], [1] * n)
        if i % every == every - 1:  # a node's tensor is a view of the parameter stepped
            heads[0].next.x, heads[1].next.x = w_eager.detach()[1:4], w_opt.detach()[1:4]
        assert_same(eager(heads[0]), opt(heads[1]), f"result of call {i}")
        assert_same(w_eager, w_opt, f"w after call {i}")
        assert_same(w_eager.grad, w_opt.grad, f"w.grad after call {i}")
    # (a rolled loop reading a parameter after the step is not rolled yet: view_writes.py
    # sees the leaf the written copy stands for passed into the loop; only values compared)
