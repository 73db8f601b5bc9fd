"""`.item()` values passed to torch ops (symbolic/speculation/item_args.py): the graph reads `.item()`
where eager read it and hands the op the same Python number, so results are bit-identical
(every check compares with atol=rtol=0). Uses that steer Python still fall back."""
import pytest
import torch
from torch import nn

import specularch
from differential import A, Pair, T, check, expect_graph, marker_line

pytestmark = pytest.mark.usefixtures("no_profiling")


# ------------------------------------------------------------------ the actor-critic step

def make_actor_critic():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)

    def finish_episode(states, returns):
        out = model(states)
        log_probs, values = torch.log_softmax(out[:, :2], -1)[:, 0], out[:, 2:]
        policy_losses, value_losses = [], []
        for log_prob, value, R in zip(log_probs, values, returns):
            advantage = R - value.item()
            policy_losses.append(-log_prob * advantage)
            value_losses.append(nn.functional.smooth_l1_loss(value, torch.tensor([R])))
        opt.zero_grad()
        loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
        loss.backward()
        opt.step()
        return loss.item(), model.weight.detach().clone()
    return finish_episode


def test_actor_critic_advantage_from_item_is_in_the_graph():
    def make_args(i):
        g = torch.Generator().manual_seed(i)
        return A(torch.randn(5, 4, generator=g), torch.randn(5, generator=g))
    opt = specularch.optimize(make_actor_critic())
    pair = Pair("finish_episode", make_actor_critic(), opt, opt)
    for _ in range(4):
        pair.step(make_args)
    e = pair.explain()
    expect_graph(e)
    assert e.stats.graph_hits >= 2, e


# ------------------------------------------------------------------ ops taking the number

def test_float32_item_in_arithmetic():
    def f(x, v):
        s = v.item()
        return x - s, s * x, x / s, x ** s, s - x, x + s
    check(f, lambda: A(T(3, 4), T(1) + 10), expect="graph")


def test_int_item_in_int_ops():
    def f(x, n):
        k = n.item()
        return x * k, x // k, x % k, x + k, k - x
    check(f, lambda: A(T(3, 4, dtype=torch.int64, low=-9, high=9),
                       torch.randint(1, 6, (1,))), expect="graph")


def test_int_item_into_float_tensor_and_float_item_into_int_tensor():
    def f(x, n, v):
        return x * n.item(), n * v.item(), x.to(torch.float16) + v.item()
    check(f, lambda: A(T(4), torch.randint(1, 6, (1,)), T(1)), expect="graph")


def test_float64_item():
    def f(x, v):
        return x * v.item() + v.item(), (x > v.item())
    check(f, lambda: A(T(5, dtype=torch.float64), T(1, dtype=torch.float64)), expect="graph")


def test_item_in_comparisons_where_clamp_and_fill():
    def f(x, v):
        s = v.item()
        out = torch.where(x > s, x, s)
        c = x.clamp(min=-abs(s), max=abs(s))
        g = torch.full((2, 3), s)
        h = torch.zeros(3).fill_(s)
        m = x.masked_fill(x < s, s)
        return out, c, g, h, m, x == s, x.lt(s)
    check(f, lambda: A(T(6), T(1)), expect="graph")


def test_item_in_tensor_construction():
    def f(x, v, n):
        s = v.item()
        return torch.tensor([s]), torch.tensor(s), torch.tensor([[s, 2.0]], dtype=torch.float64), \
            torch.tensor([n.item(), 1]), torch.tensor((s,)) * x
    check(f, lambda: A(T(2), T(1), torch.randint(0, 9, (1,))), expect="graph")


def test_compiling_backend_runs_the_fx_graph_and_says_why():
    def f(x, v):
        return torch.relu(x) - v.item()
    opt = specularch.optimize(f, backend="torchscript")
    for i in range(3):
        x, v = torch.randn(3), torch.randn(1)
        assert torch.equal(opt(x, v), f(x, v))
    e = specularch.explain(opt)
    assert e.graphs and all(g.backend == "fx" for g in e.graphs), str(e)
    assert "reads `.item()` values" in e.graphs[0].note, str(e)  # refused before compiling


def test_recipe_of_items_into_an_op():
    def f(x, v, w):
        r = 0.99 * v.item() + w.item() / 3
        return x - r, x * (r - 1)
    check(f, lambda: A(T(4), T(1), T(1)), expect="graph")


def test_item_read_before_an_in_place_write():
    def f(x, v):
        v = v.clone()
        s = v.item()
        v.add_(1)
        return x - s, v
    check(f, lambda: A(T(4), T(1)), expect="graph")


def test_item_into_loss_backward_gradients():
    def f(w, v):
        loss = ((w - v.item()) ** 2).sum() * v.item()
        loss.backward()
        return loss.detach(), w.grad.clone()
    check(f, lambda: A(T(4, requires_grad=True), T(1)), expect="graph")


# ------------------------------------------------------------------ uses that still fall back

def test_item_as_a_size_falls_back():
    def f(x, n):
        return torch.zeros(n.item()) + x.sum()  # size
    check(f, lambda: A(T(3), torch.tensor([4])), expect="fallback",
          fallback_kind="data_dependent_value", fallback_line=marker_line(f, "size"))


def test_item_in_range_falls_back():
    def f(x, n):
        for _ in range(n.item()):  # range
            x = x + 1
        return x
    check(f, lambda: A(T(3), torch.tensor([2])), expect="fallback",
          fallback_kind="data_dependent_value", fallback_line=marker_line(f, "range"))


def test_item_in_a_branch_is_speculated_and_runs_eagerly_once_it_flips():
    def f(x, v):
        if v.item() > 0:  # branch
            return x + 1
        return x - 1
    check(f, lambda: A(T(3), T(1)), calls=8, expect="fallback",
          fallback_kind="assumption_failed", fallback_line=marker_line(f, "branch"))


def test_int_of_an_item_into_an_op():
    def f(x, v):
        return x * int(v.item() * 10), x + round(v.item(), 2)
    check(f, lambda: A(T(3), T(1)), expect="graph")


def test_recipe_that_raises_when_the_graph_runs_raises_as_eager():
    def f(x, n):
        return x - 1 / n.item()
    check(f, lambda i: A(T(3), torch.tensor([2 - i])), calls=4)


# ------------------------------------------------------------------ backward into outside history

def make_outside_history_step():
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)

    def step(y):  # `y` carries autograd history made before the call (as saved actions do)
        loss = (y - y.detach()[0].item()).pow(2).sum() + lin.weight.sum() * 0
        loss.backward()
        return loss.item()
    return lin, step


def test_backward_into_history_made_before_the_call_runs_eagerly():
    """Capture's own backward would free the outside history (the graph's backward then
    raised "backward through the graph a second time"); such a step runs eagerly."""
    (lin_e, eager), (lin_o, step) = make_outside_history_step(), make_outside_history_step()
    opt = specularch.optimize(step)
    for i in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        assert eager(lin_e(x)) == opt(lin_o(x))
        assert torch.equal(lin_e.weight.grad, lin_o.weight.grad)
    e = specularch.explain(opt)
    assert [f.kind for f in e.fallbacks] == ["unsupported_call"], e
    assert "history made before the call" in str(e), e
