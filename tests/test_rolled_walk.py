"""``while node is not None: ...; node = node.next`` over a linked list of user objects from
the call, rolled by symbolic/rolled/walk.py: the walk is computed when the graph runs, its
guards are checked per node (same class, attributes of the same kind, tensors of the same metadata),
the body captured once, whatever the walk's length. Each case is compared with eager over
30 lengths (values, gradients, the nodes after the call, exceptions): one capture, no
``cache_limit`` fallback; bit for bit with ``templates="exact"``, within rounding by
default. A node that differs is never wrong (the call is captured again), and ``explain()``
says why."""
import copy
import dis

import pytest
import torch
from torch import nn

import specularch

from differential import A, T, assert_same, check

LENGTHS = list(range(2, 32))  # 30 lengths
MODES = [("exact", 0.0), ("batched", 1e-5)]
FORM = "while node is not None: node = node.next"


class Node:
    def __init__(self, x, scale, next=None):
        self.x, self.scale, self.next = x, scale, next


class Odd(Node):
    pass


def _chain(xs, scales):
    head = None
    for x, s in reversed(list(zip(xs, scales))):
        head = Node(x, s, head)
    return head


def _loops(report) -> list:
    return [loop for graph in report.graphs for loop in graph.loops]


def _assert_rolled_once(report, form=FORM):
    assert report.stats.captures == 1, report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report
    (loop,) = [loop for loop in _loops(report) if loop.rolled]
    assert loop.form == form and len(loop.trips) == 16, report
    assert f"({form}): body" in str(report) and "trip counts of the last calls" in str(report)


def _walk_rnn(node, w, h):
    outs = []
    while node is not None:
        h = torch.tanh(node.x @ w + h) * node.scale
        outs.append(h.sum(1))
        node = node.next
    return torch.stack(outs), h, node


def _walk_sum(node, w):
    total = torch.zeros(())
    last = None
    while node is not None:
        total = total + (node.x @ w).sum() * node.scale
        last = node
        node = node.next
    return total, last.x, last.scale


def _args(i, requires_grad=False):
    n = LENGTHS[i % len(LENGTHS)]
    head = _chain([T(3, 5, requires_grad=requires_grad) for _ in range(n)],
                  [k % 3 - 1 for k in range(n)])
    return A(head, T(5, 5, requires_grad=True), T(3, 5))


def _sum_args(i):
    (head, w, _), _ = _args(i, requires_grad=True)
    return A(head, w)


@pytest.mark.parametrize("templates, rtol", MODES)
@pytest.mark.parametrize("fn, make_args", [(_walk_rnn, _args), (_walk_sum, _sum_args)])
def test_a_walk_over_a_linked_list_is_rolled_once(fn, make_args, templates, rtol):
    with specularch.config.patch(templates=templates):
        report = check(fn, make_args, calls=len(LENGTHS), grad=True, expect="graph", rtol=rtol,
                       atol=rtol * 1e-2)
    _assert_rolled_once(report)


def _short_args(i):
    (head, w, h), _ = _args(i)
    if i % 3 == 0:
        head = None  # no iteration
    elif i % 3 == 1:
        head.next = None  # one
    return A(head, w, h)


def _walk_or_start(node, w, h):
    while node is not None:
        h = torch.tanh(node.x @ w + h)
        node = node.next
    return h * w.sum()


def test_an_empty_or_one_node_walk_is_equal_to_eager():
    report = check(_walk_or_start, _short_args, calls=12, grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _one_node_differs(how):
    def make_args(i):
        (head, w, h), _ = _args(i)
        if i % 6 == 5:
            third = head.next.next
            if how == "shape":
                third.x = T(1, 5)
            elif how == "class":
                head.next.next = Odd(third.x, third.scale, third.next)
            else:
                third.scale = 0.5
        return A(head, w, h)
    return make_args


@pytest.mark.parametrize("how, why", [
    ("shape", "L['node'] (walked by .next) node 2.x expected Tensor(dtype=torch.float32, "
              "shape=(3, 5)"),
    ("class", "L['node'] [2] expected a Node, got"),
    ("number", "L['node'] (walked by .next) node 2.scale expected an int, got 0.5"),
])
def test_a_walk_with_a_node_that_differs_is_never_wrong_and_says_why(how, why):
    report = check(_walk_rnn, _one_node_differs(how), calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report
    assert why in str(report), report
    assert not [f for f in report.fallbacks if f.kind == "cache_limit"], report


def _raises_at(node, w, h, k):
    while node is not None:
        h = torch.tanh(node.x[:, :k] @ w + h)  # k == 4 on every 7th call: the shapes do not fit
        node = node.next
    return h


def test_an_exception_inside_a_rolled_walk_is_eagers():
    def make_args(i):
        (head, w, h), _ = _args(i)
        return A(head, w, h, 4 if i % 7 == 6 else 5)
    report = check(_raises_at, make_args, calls=len(LENGTHS), grad=True)
    assert any(loop.rolled for loop in _loops(report)), report


def _branches_on_a_number(node, w, h):
    while node is not None:
        h = torch.tanh(node.x @ w + h) if node.scale > 0 else h  # a node's number steers Python
        node = node.next
    return h * w.sum()


def _looks_ahead(node, w, h):
    while node is not None:
        h = torch.tanh(node.x @ w + h)
        if node.next is not None:  # the next node as a Python value
            h = h * 2
        node = node.next
    return h


def _writes_nodes(node, w, h):
    while node is not None:
        h = torch.tanh(node.x @ w + h)
        node.seen = True  # a Python write into every node, committed as eager's
        node = node.next
    return h


@pytest.mark.parametrize("fn, form, why", [
    (_branches_on_a_number, FORM, "as a Python value"),
    (_looks_ahead, FORM, "other than to step to the next node"),
    # an attribute write in the body is never rolled: symbolic/rolled/unrolled.py says why
    (_writes_nodes, "while loop", "`while node is not None: ...; node = node.next` over objects"),
])
def test_a_walk_that_needs_a_nodes_python_value_unrolls_and_says_why(fn, form, why):
    report = check(fn, _args, calls=6, grad=True)
    loops = _loops(report)
    assert loops and not any(loop.rolled for loop in loops), report
    assert any(loop.form == form and why in loop.why for loop in loops), report


class _Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, node):
        h = torch.zeros(2, 4)
        while node is not None:
            h = self.cell(node.x, h) * node.scale
            node = node.next
        return self.out(h)


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(node, y):
        opt.zero_grad()
        loss = ((model(node) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    return step


@pytest.mark.parametrize("templates, rtol", MODES)
def test_a_training_step_over_a_linked_list_is_captured_once(templates, rtol):
    torch.manual_seed(0)
    eager_model = _Reader()
    opt_model = copy.deepcopy(eager_model)
    eager_step, opt_step = _train(eager_model), specularch.optimize(_train(opt_model))
    data = torch.Generator().manual_seed(4)
    close = {"rtol": rtol, "atol": rtol * 1e-2}
    with specularch.config.patch(templates=templates):
        for n in LENGTHS:
            head = _chain([torch.randn(2, 3, generator=data) for _ in range(n)],
                          [1.0 - k / 64 for k in range(n)])
            y = torch.randn(2, 2, generator=data)
            assert_same(eager_step(head, y), opt_step(head, y), f"loss at {n}", **close)
            for (name, p), q in zip(eager_model.named_parameters(), opt_model.parameters()):
                assert_same(p, q, f"{name} after length {n}", **close)
                assert_same(p.grad, q.grad, f"{name}.grad after length {n}", **close)
    _assert_rolled_once(specularch.explain(opt_step))


def test_a_walk_with_a_long_body_rolls():
    """A body longer than 255 code units: the jumps of both tests carry an ``EXTENDED_ARG``
    prefix (before, such a walk never rolled)."""
    lines = "\n".join("        h = torch.tanh(node.x @ w + h) * node.scale" for _ in range(25))
    source = f"def long_body(node, w, h):\n    while node is not None:\n{lines}\n" \
             "        node = node.next\n    return h\n"
    namespace = {"torch": torch}
    exec(compile(source, "<long body>", "exec"), namespace)
    fn = namespace["long_body"]
    assert any(i.opname == "EXTENDED_ARG" for i in dis.get_instructions(fn)), "body too short"
    report = check(fn, _args, calls=12, rtol=1e-6, atol=1e-7)
    assert report.stats.captures == 1 and any(loop.rolled for loop in _loops(report)), report
