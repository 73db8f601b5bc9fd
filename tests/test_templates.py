"""Recursion templates (specularch/templates): a recursive function is captured once per path
and run on structures never seen before, without a new graph per structure. Differential:
parameters after training, values, gradients and Python state against eager."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import specularch
from specularch import config
from specularch.templates.family import families
from models import data, tree_lstm, tree_rnn

from differential import A, T, check

pytestmark = pytest.mark.usefixtures("no_profiling")


def _train(model, trees_per_step, steps, mode, seed=1, lr=0.1):
    """(eager model, optimized model, explain) after ``steps`` SGD steps on new trees."""
    torch.manual_seed(0)
    eager_model, fast_model = model, copy.deepcopy(model)

    def make_step(m):
        opt = torch.optim.SGD(m.parameters(), lr=lr)

        def step(trees, labels):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(trees), labels)
            loss.backward()
            opt.step()
            return loss
        return step

    eager, fast = make_step(eager_model), specularch.optimize(make_step(fast_model))
    gen = torch.Generator().manual_seed(seed)
    with config.patch(templates=mode):
        for _ in range(steps):
            trees = [data.random_tree(gen, 50, 2, 9) for _ in range(trees_per_step)]
            labels = torch.tensor([t.label for t in trees])
            a, b = eager(trees, labels), fast(trees, labels)
            if mode == "exact":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return eager_model, fast_model, specularch.explain(fast)


def _one_graph_for_all_trees(report, steps):
    """One capture for the trees; the only recompile is eager's ``.grad`` turning from None
    into a tensor after the first step (no profiling calls in these tests)."""
    assert not report.fallbacks, str(report)
    assert report.stats.captures <= 2 and report.stats.graph_hits == steps - report.stats.captures
    assert all(".grad expected None" in str(r) for r in report.recompiles), str(report)


def _family(function):
    return next(f for f in families() if f.code is function.__code__)


@pytest.mark.parametrize("Model", [tree_rnn.TreeRNN, tree_lstm.TreeLSTM])
def test_exact_mode_trains_bit_identically_on_new_trees_with_one_graph(Model):
    eager, fast, report = _train(Model(50, 8), 1, 14, "exact")
    for p, q in zip(eager.parameters(), fast.parameters()):
        assert torch.equal(p, q)
    _one_graph_for_all_trees(report, 14)


@pytest.mark.parametrize("Model", [tree_rnn.TreeRNN, tree_lstm.TreeLSTM])
def test_batched_mode_is_within_rounding_and_batches_each_level(Model):
    before = {f.code: dict(f.stats) for f in families()}
    eager, fast, report = _train(Model(50, 8), 2, 14, "batched")
    for p, q in zip(eager.parameters(), fast.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    _one_graph_for_all_trees(report, 14)
    stats = _family(Model.encode).stats
    old = before.get(Model.encode.__code__, {"batches": 0})
    assert stats["batches"] > old["batches"] and stats["largest_batch"] > 1


class Node:
    def __init__(self, value=None, children=()):
        self.value, self.children = value, list(children)


class NaryEncoder(nn.Module):
    """Recursion over a user class with a list of children (a path per child count); the
    children's results are stacked on dim 0 (not row-wise: those paths run one by one)."""

    def __init__(self):
        super().__init__()
        self.leaf = nn.Linear(1, 4)
        self.inner = nn.Linear(4, 4)

    def encode(self, node):
        if not node.children:
            return torch.tanh(self.leaf(torch.tensor([[node.value]])))
        hs = [self.encode(c) for c in node.children]
        return torch.sigmoid(self.inner(torch.stack(hs).sum(0)))

    def forward(self, node):
        return self.encode(node)


def _nary(gen, depth=3):
    if depth == 0 or torch.rand(1, generator=gen).item() < 0.3:
        return Node(value=float(torch.randn(1, generator=gen)))
    return Node(children=[_nary(gen, depth - 1)
                          for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))])


@pytest.mark.parametrize("mode", ["exact", "batched"])
def test_user_node_class_with_child_lists_values_and_gradients(mode):
    gen = torch.Generator().manual_seed(3)
    trees = [_nary(gen) for _ in range(6)]
    with config.patch(templates=mode):
        check(lambda m, node: m(node), lambda i: A(_seeded(NaryEncoder), trees[i]), calls=6,
              grad=True, expect="graph", rtol=1e-6, atol=1e-7)


def _seeded(cls):
    torch.manual_seed(0)
    return cls()


class TupleCombiner(nn.Module):
    """Recursion over nested tuples whose leaves are tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def combine(self, x):
        if isinstance(x, tuple):
            return torch.tanh(self.lin(torch.cat([self.combine(x[0]), self.combine(x[1])], 1)))
        return x

    def forward(self, x):
        return self.combine(x)


def _nested(depth, seed):
    if depth <= 0:
        return T(1, 3, seed=seed)
    return (_nested(depth - 1, seed * 2 + 1), _nested(depth - 1 - (seed % 2), seed * 2 + 2))


def test_nested_tuples_of_tensors_values_and_gradients():
    """(A tuple is guarded whole where it is read, so each nesting shape is its own path and,
    passed as the argument, its own graph: docs/recursion.md, Limits.)"""
    shapes = [_nested(2, 1), _nested(3, 2), _nested(4, 3), _nested(1, 4)]
    check(lambda m, x: m(x), lambda i: A(_seeded(TupleCombiner), shapes[i]), calls=4, grad=True,
          expect="graph", rtol=1e-6, atol=1e-7)


class Counting(nn.Module):
    """Writes Python state in the recursion: templates refuse it, the recursion stays
    unrolled (per structure) and the writes happen exactly as eagerly."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.visits = 0

    def walk(self, x):
        self.visits += 1
        if isinstance(x, tuple):
            return self.walk(x[0]) + self.walk(x[1])
        return self.lin(x)

    def forward(self, x):
        return self.walk(x)


def test_recursion_with_python_writes_stays_unrolled_and_exact():
    x = (T(1, 3, seed=1), (T(1, 3, seed=2), T(1, 3, seed=3)))
    report = check(lambda m, x: m(x), lambda: A(_seeded(Counting), x), calls=3, expect="graph")
    unrolled = [line for line in report.templates if "Counting.walk:" in line]
    assert unrolled and "writes" in unrolled[0], report.templates


def fact(n):
    return torch.ones(1) if n == 0 else fact(n - 1) * n


def test_recursion_on_computed_numbers_is_unrolled_as_before():
    check(lambda n: fact(n), lambda: A(4), calls=3, expect="graph")


class Dropping(nn.Module):
    """Random numbers in a template: instances run in eager's order (bit-identical), also in
    batched mode."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def combine(self, x):
        if isinstance(x, tuple):
            h = torch.cat([self.combine(x[0]), self.combine(x[1])], 1)
            return torch.nn.functional.dropout(torch.tanh(self.lin(h)), 0.5)
        return x

    def forward(self, x):
        return self.combine(x)


def test_random_ops_in_templates_draw_like_eager():
    shapes = [_nested(2, 1), _nested(3, 2), _nested(2, 5)]
    check(lambda m, x: m(x), lambda i: A(_seeded(Dropping), shapes[i]), calls=3, grad=True,
          expect="graph")


class Even(nn.Module):
    """Mutual recursion: ``even`` calls ``odd`` calls ``even``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def even(self, x):
        if isinstance(x, tuple):
            return torch.tanh(self.a(self.odd(x[0]) + self.odd(x[1])))
        return x

    def odd(self, x):
        if isinstance(x, tuple):
            return torch.sigmoid(self.b(self.even(x[0]) * self.even(x[1])))
        return x

    def forward(self, x):
        return self.even(x)


def test_mutual_recursion():
    shapes = [_nested(3, 1), _nested(4, 2), _nested(3, 7)]
    check(lambda m, x: m(x), lambda i: A(_seeded(Even), shapes[i]), calls=3, grad=True,
          expect="graph", rtol=1e-6, atol=1e-7)


def test_off_unrolls_one_graph_per_structure():
    shapes = [_nested(2, 1), _nested(3, 2)]
    with config.patch(templates="off"):
        report = check(lambda m, x: m(x), lambda i: A(_seeded(TupleCombiner), shapes[i]),
                       calls=2)
    assert report.stats.captures == 2


def test_trees_of_a_batch_share_one_walk():
    eager, fast, report = _train(tree_rnn.TreeRNN(50, 8), 3, 6, "batched")
    for p, q in zip(eager.parameters(), fast.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    family = _family(tree_rnn.TreeRNN.encode)
    assert family.last_call["roots"] == 3
    assert "run_many" in report.graphs[0].code if report.verbose else True


class Special(Node):
    """A node kind that appears only in later structures; its path reads a parameter no
    earlier path read."""


class TwoKinds(nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = nn.Linear(1, 4)
        self.inner = nn.Linear(4, 4)
        self.special = nn.Linear(4, 4)

    def encode(self, node):
        if not node.children:
            return torch.tanh(self.leaf(torch.tensor([[node.value]])))
        h = self.encode(node.children[0]) + self.encode(node.children[1])
        if isinstance(node, Special):
            return torch.relu(self.special(h))
        return torch.sigmoid(self.inner(h))

    def forward(self, node):
        return self.encode(node)


def _two_kinds(i):
    def leaf(v):
        return Node(value=float(v))
    if i < 2:
        return Node(children=[leaf(i), Node(children=[leaf(1), leaf(2)])])
    return Node(children=[Special(children=[leaf(i), leaf(3)]), leaf(-1)])


def test_a_node_kind_seen_later_falls_back_once_then_runs_as_a_graph():
    torch.manual_seed(0)
    eager_model = TwoKinds()
    fast_model = copy.deepcopy(eager_model)
    fast = specularch.optimize(fast_model)
    for i in range(5):
        a, b = eager_model(_two_kinds(i)), fast(_two_kinds(i))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        a.sum().backward()
        b.sum().backward()
    for p, q in zip(eager_model.parameters(), fast_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    report = specularch.explain(fast)
    assert report.stats.assumption_failures == 1, str(report)
    assert report.stats.captures == 2 and report.stats.graph_hits == 2, str(report)
    assert "template:" in str(report.fallbacks[0])
    assert "new kind of node" in report.fallbacks[0].hint  # not the tensor-branch hint


def test_explain_lists_templates_paths_batches_and_unrolled_recursion():
    _, _, report = _train(tree_rnn.TreeRNN(50, 8), 1, 5, "batched")
    text = "\n".join(report.templates)
    assert "template TreeRNN.encode: 2 path(s)" in text
    assert "L['tree'].word == None" in text and "type(L['tree'].word) is int" in text
    assert "last call:" in text and "batch sizes" in text and "batched;" in text
    assert "templates:" in str(report)
    counting = specularch.optimize(_seeded(Counting))
    with config.patch(profile_calls=0):
        counting((T(1, 3, seed=1), T(1, 3, seed=2)))
    text = "\n".join(specularch.explain(counting).templates)
    assert "recursion unrolled (one graph per structure): Counting.walk:" in text


class Leafy(nn.Module):
    """One ``encode`` code, two models whose leaf modules differ (the second reads a
    parameter path the first does not have)."""

    def __init__(self, deep: bool):
        super().__init__()
        self.leaf = nn.Sequential(nn.Linear(1, 3), nn.Tanh()) if deep else nn.Linear(1, 3)
        self.node = nn.Linear(3, 3)

    def encode(self, node):
        if not node.children:
            return self.leaf(torch.tensor([[node.value]]))
        return self.node(sum(self.encode(c) for c in node.children))

    def forward(self, node):
        return self.encode(node)


def test_models_sharing_recursive_code_but_not_structure_each_get_their_paths():
    gen = torch.Generator().manual_seed(5)
    trees = [_nary(gen) for _ in range(4)]
    for deep in (True, False, True):
        torch.manual_seed(0)
        eager = Leafy(deep)
        fast = specularch.optimize(copy.deepcopy(eager))
        with config.patch(profile_calls=0):
            for tree in trees:
                torch.testing.assert_close(fast(tree), eager(tree), rtol=1e-6, atol=1e-7)
        report = specularch.explain(fast)
        assert not report.fallbacks and report.stats.captures == 1, str(report)


_WALK = """
import torch

def walk(node):
    if node.children:
        return walk(node.children[0]) * SCALE + walk(node.children[1])
    return torch.tensor([[node.value]])

def run(node):
    return walk(node)
"""


def test_equal_code_in_two_modules_runs_in_its_own_globals():
    """Two imports of one file (a symlink) give equal code objects with different globals:
    a family is per code object and globals, not per equal code."""
    runs = []
    for scale in (2.0, 3.0):
        namespace = {"SCALE": scale, "__name__": f"walk_{scale}"}
        exec(compile(_WALK, "walk_module.py", "exec"), namespace)
        runs.append(namespace["run"])
    assert runs[0].__code__ == runs[1].__code__
    gen = torch.Generator().manual_seed(9)
    trees = [_binary(gen, 3) for _ in range(3)]
    for run in runs:
        report = check(run, lambda i: A(trees[i]), calls=3, expect="graph")
        assert "template walk" in "\n".join(report.templates), str(report)


def _binary(gen, depth):
    if depth == 0 or torch.rand(1, generator=gen).item() < 0.3:
        return Node(value=float(torch.randn(1, generator=gen)))
    return Node(children=[_binary(gen, depth - 1), _binary(gen, depth - 1)])


class Rescaling(nn.Module):
    """Writes a Python attribute the recursion then reads, in the same call: the write is
    only committed after the graph, so the walk (which reads the real objects) must not run
    on the old value."""

    def __init__(self):
        super().__init__()
        self.leaf = nn.Linear(1, 3)
        self.node = nn.Linear(3, 3)
        self.scale = 1.0

    def encode(self, node):
        if not node.children:
            return self.leaf(torch.tensor([[node.value * self.scale]]))
        return self.node(sum(self.encode(c) for c in node.children))

    def forward(self, node, scale, first_value):
        self.scale = scale
        node.children[0].value = first_value
        return self.encode(node)


def test_python_writes_earlier_in_the_call_are_seen_by_the_recursion():
    gen = torch.Generator().manual_seed(11)
    trees = [Node(children=[_binary(gen, 2), _binary(gen, 2)]) for _ in range(4)]
    check(lambda m, node, s, v: m(node, s, v),
          lambda i: A(_seeded(Rescaling), trees[i], 1.0 + i, float(i)), calls=4,
          rtol=1e-6, atol=1e-7)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def walk(self, node):
        if not node.children:
            return torch.ones(1, 3)
        return self.lin(self.walk(node.children[0]))

    def forward(self, node):
        return self.walk(node)


def _chain(length):
    node = Node(value=0.0)
    for _ in range(length):
        node = Node(children=[node])
    return node


def test_a_structure_too_deep_for_eager_raises_recursion_error_as_eager(recursion_limit):
    model = specularch.optimize(_seeded(Chain))
    with config.patch(profile_calls=0):
        model(_chain(20))  # captured: the walk is a template
        assert "template Chain.walk" in "\\n".join(specularch.explain(model).templates)
        deep = _chain(2 * recursion_limit)
        with pytest.raises(RecursionError):
            _seeded(Chain)(deep)
        with pytest.raises(RecursionError):
            model(deep)
        torch.testing.assert_close(model(_chain(30)), _seeded(Chain)(_chain(30)))


class _Valued:
    def __init__(self, x, value, left=None, right=None):
        self.x, self.value, self.left, self.right = x, value, left, right


def _scaled_leaves(node):
    if node.left is None:
        if node.value < 0.0:  # a node's number steers Python: checked per node
            return node.x * 10
        return node.x * node.value
    return _scaled_leaves(node.left) + _scaled_leaves(node.right)


@pytest.mark.parametrize("templates", ["batched", "exact"])
def test_a_branch_on_a_node_number_is_checked_for_every_node(templates):
    """A template path made the node's numbers inputs, and a branch on one was guarded once
    per call, not per node: every leaf took the branch of the leaf it was captured on (a
    silent wrong answer, found by the recursion sweep). Numbers that steer Python stay the
    path's constants, guarded per node; others stay inputs."""
    leaf = lambda v: _Valued(torch.ones(1, 3), v)  # noqa: E731
    fast = specularch.optimize(_scaled_leaves)
    with specularch.config.patch(profile_calls=0, templates=templates):
        for values in [(1.0, 2.0), (1.0, -2.0), (-3.0, 0.5), (2.0, 4.0)]:
            tree = _Valued(torch.ones(1, 3), 0.0, leaf(values[0]), leaf(values[1]))
            assert torch.equal(fast(tree), _scaled_leaves(tree)), values
