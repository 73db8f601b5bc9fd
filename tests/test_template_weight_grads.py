"""Batched recursion templates make each weight's gradient once per call
(specularch/templates/weight_grads.py), not once per level of the structure. Differential:
values and gradients against eager on new trees, through ``backward`` outside the graph,
twice with ``retain_graph``, under ``no_grad``, with a frozen weight, a weight that is also
used outside a ``linear``, and a batched call that raises; ``templates="exact"`` keeps
eager's products and bits."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import specularch
from specularch import config
from specularch.templates.family import families
from models import data, tree_lstm, tree_rnn

pytestmark = pytest.mark.usefixtures("no_profiling")


def _trees(seed, count, min_leaves=6, max_leaves=12):
    gen = torch.Generator().manual_seed(seed)
    return [data.random_tree(gen, 50, min_leaves, max_leaves) for _ in range(count)]


def _pair(Model, *args):
    torch.manual_seed(0)
    eager = Model(*args)
    fast = copy.deepcopy(eager)
    return eager, fast, specularch.optimize(lambda m, trees: m(trees))


def _edges_into(output: torch.Tensor, leaf: torch.Tensor) -> int:
    """How many autograd nodes send a gradient straight to ``leaf`` (one per product that
    makes a piece of its gradient)."""
    seen, todo, count = set(), [output.grad_fn], 0
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is leaf:
                count += 1
            todo.append(nxt)
    return count


def _inner_nodes(tree) -> int:
    return 0 if tree.is_leaf else 1 + _inner_nodes(tree.left) + _inner_nodes(tree.right)


# hidden sizes whose composing weight is large enough to share (weight_grads.MIN_ELEMENTS)
RNN_H, LSTM_H = 192, 128


@pytest.mark.parametrize("Model,hidden,weight", [(tree_rnn.TreeRNN, RNN_H, "compose"),
                                                 (tree_lstm.TreeLSTM, LSTM_H, "node")])
def test_batched_templates_make_a_large_weights_gradient_once_per_call(Model, hidden, weight):
    eager, fast, f = _pair(Model, 50, hidden)
    for seed in range(4):
        trees = _trees(seed, 2)
        a, b = eager(trees), f(fast, trees)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert _edges_into(a, getattr(eager, weight).weight) == sum(map(_inner_nodes, trees))
        assert _edges_into(b, getattr(fast, weight).weight) == 1
        family = next(fm for fm in families() if fm.code is Model.encode.__code__)
        assert len(family.last_call["batches"]) > 1  # batched over several levels
        a.sum().backward()
        b.sum().backward()
        for p, q in zip(eager.parameters(), fast.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("Model", [tree_rnn.TreeRNN, tree_lstm.TreeLSTM])
def test_exact_mode_keeps_eagers_products_and_bits(Model):
    eager, fast, f = _pair(Model, 50, 8)
    with config.patch(templates="exact"):
        for seed in range(3):
            trees = _trees(seed, 1)
            a, b = eager(trees), f(fast, trees)
            assert torch.equal(a, b)
            for name in ("classify",) + (("compose",) if Model is tree_rnn.TreeRNN else ("node",)):
                w_a, w_b = getattr(eager, name).weight, getattr(fast, name).weight
                assert _edges_into(a, w_a) == _edges_into(b, w_b)
            a.sum().backward()
            b.sum().backward()
            for p, q in zip(eager.parameters(), fast.parameters()):
                assert torch.equal(p.grad, q.grad)


def test_small_weights_keep_their_per_level_gradients():
    """Below ``MIN_ELEMENTS`` sharing costs more than it saves: eager's products stay."""
    eager, fast, f = _pair(tree_rnn.TreeRNN, 50, 8)
    for seed in range(3):
        trees = _trees(seed, 2)
        a, b = eager(trees), f(fast, trees)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert _edges_into(b, fast.compose.weight) > 1


def test_a_second_backward_with_retain_graph_and_autograd_grad_match_eager():
    eager, fast, f = _pair(tree_lstm.TreeLSTM, 50, LSTM_H)
    f(fast, _trees(9, 1))  # capture
    trees = _trees(10, 2)
    a, b = eager(trees), f(fast, trees)
    for _ in range(2):  # the second backward accumulates into .grad again
        a.sum().backward(retain_graph=True)
        b.sum().backward(retain_graph=True)
        for p, q in zip(eager.parameters(), fast.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a.square().sum(), [eager.node.weight, eager.embed.weight])
    gb = torch.autograd.grad(b.square().sum(), [fast.node.weight, fast.embed.weight])
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_no_grad_and_a_frozen_weight_match_eager():
    eager, fast, f = _pair(tree_lstm.TreeLSTM, 50, LSTM_H)
    with torch.no_grad():
        for seed in range(2):
            trees = _trees(seed, 2)
            torch.testing.assert_close(eager(trees), f(fast, trees), rtol=1e-5, atol=1e-6)
    eager.node.weight.requires_grad_(False)
    fast.node.weight.requires_grad_(False)
    for seed in range(2, 4):
        trees = _trees(seed, 2)
        a, b = eager(trees), f(fast, trees)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        a.sum().backward()
        b.sum().backward()
        assert fast.node.weight.grad is None
        for p, q in zip(eager.parameters(), fast.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class TiedRNN(nn.Module):
    """The composing weight is also used outside its ``linear`` (its mean scales the result):
    its gradient is then made the ordinary way."""

    def __init__(self, vocab=50, hidden=RNN_H):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.compose = nn.Linear(2 * hidden, hidden)

    def encode(self, tree):
        if tree.is_leaf:
            return self.embed(torch.tensor([tree.word]))
        h = torch.cat([self.encode(tree.left), self.encode(tree.right)], dim=1)
        return torch.tanh(self.compose(h)) * (1 + self.compose.weight.mean())

    def forward(self, trees):
        return torch.cat([self.encode(t) for t in trees]).sum(1)


def test_a_weight_used_outside_linear_keeps_its_ordinary_gradient():
    eager, fast, f = _pair(TiedRNN)
    for seed in range(3):
        trees = _trees(seed, 2)
        a, b = eager(trees), f(fast, trees)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert _edges_into(b, fast.compose.weight) > 1  # batched, but not deferred
        a.sum().backward()
        b.sum().backward()
        for p, q in zip(eager.parameters(), fast.parameters()):  # (a mean of 73728 products)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def _with_word(tree, word):
    """``tree`` with its leftmost leaf's word replaced."""
    node = tree
    while not node.is_leaf:
        node = node.left
    node.word = word
    return tree


def test_a_batched_call_that_raises_raises_as_eager_and_changes_nothing():
    """A leaf's word out of the embedding's range: the batched level raises inside the graph
    (after other levels made their weights' shared views); the call raises eager's error,
    no parameter or gradient changes, and the next tree runs as a graph again."""
    eager, fast, f = _pair(tree_lstm.TreeLSTM, 50, LSTM_H)
    for seed in range(2):
        trees = _trees(seed, 2)
        eager(trees).sum().backward()
        f(fast, trees).sum().backward()
    before = [(p.detach().clone(), p.grad.clone()) for p in fast.parameters()]
    bad = [_trees(5, 1)[0], _with_word(_trees(6, 1)[0], 999)]
    with pytest.raises(IndexError) as eager_error:
        eager(bad)
    with pytest.raises(IndexError) as fast_error:
        f(fast, bad)
    assert str(fast_error.value) == str(eager_error.value)
    for p, (value, grad) in zip(fast.parameters(), before):
        assert torch.equal(p, value) and torch.equal(p.grad, grad)
    trees = _trees(7, 2)
    hits = specularch.explain(f).stats.graph_hits
    a, b = eager(trees), f(fast, trees)
    assert specularch.explain(f).stats.graph_hits == hits + 1
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    b.sum().backward()
    for p, q in zip(eager.parameters(), fast.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
