"""Graph passes of the `fx` backend (`specularch/fx_lower/passes.py`), differential against
eager: `fold_clones` turns `c = p.clone(); c.op_(...)` (an in-place update of a tensor that
outlives the call, computed on a copy) into the out-of-place op, bit for bit; the commit
copies with one `_foreach_copy_`."""
import copy

import torch
from torch import nn

import specularch
from specularch.api import _state_of
from specularch.fx_lower.passes import fold_clones


def _ran_graph(fn) -> torch.fx.GraphModule:
    """The GraphModule the `fx` backend runs for the optimized function's first graph."""
    return _state_of(fn).entries[0].fn.__globals__["GRAPH"].__self__


def _adam_setup(amsgrad=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3, amsgrad=amsgrad)


def _step_fn(model, opt, after=None):
    def train_step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item() if after is None else after(model, loss)
    return train_step


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _same_state(m1, o1, m2, o2):
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
        s1, s2 = o1.state[p], o2.state[q]
        assert s1.keys() == s2.keys()
        assert all(torch.equal(s1[k], s2[k]) and s1[k].dtype == s2[k].dtype for k in s1)


def test_adam_step_runs_without_clones_and_matches_eager_bit_for_bit():
    model, opt = _adam_setup()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=1e-3)
    fast, ref = specularch.optimize(_step_fn(model, opt)), _step_fn(ref_model, ref_opt)
    params = list(model.parameters())
    for x, y in _batches(8):
        assert fast(x, y) == ref(x, y)
        _same_state(model, opt, ref_model, ref_opt)
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    gm = _ran_graph(fast)
    assert gm.meta["constructed_by"] == "specularch.fx_lower.passes.fold_clones"
    assert gm.meta["folded_clones"] == 4 * 4  # step, exp_avg, exp_avg_sq, the parameter
    assert ".clone()" not in gm.code and ".lerp_(" not in gm.code and ".addcdiv_(" not in gm.code
    assert "FOREACH_COPY_ALL(" in _state_of(fast).entries[0].entry_source
    assert _state_of(fast).stats.graph_hits == 4  # 3 profiled calls, 1 capture


def test_amsgrad_copy_into_state_keeps_its_clone():
    """`max_exp_avg_sq.copy_(...)` has no out-of-place form in the table: that one stays."""
    model, opt = _adam_setup(amsgrad=True)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=1e-3, amsgrad=True)
    fast, ref = specularch.optimize(_step_fn(model, opt)), _step_fn(ref_model, ref_opt)
    for x, y in _batches(7):
        assert fast(x, y) == ref(x, y)
        _same_state(model, opt, ref_model, ref_opt)
    assert _ran_graph(fast).code.count(".clone()") == 4


def test_parameter_read_after_its_update_in_the_same_step():
    """Reads after the update (the updated weight's norm, returned) see the final value."""
    after = lambda model, loss: (loss.item(), model[0].weight.detach().norm(), model[2].bias * 2)  # noqa: E731
    model, opt = _adam_setup()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=1e-3)
    fast, ref = specularch.optimize(_step_fn(model, opt, after)), _step_fn(ref_model, ref_opt, after)
    for x, y in _batches(7):
        got, want = fast(x, y), ref(x, y)
        assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        _same_state(model, opt, ref_model, ref_opt)
    assert ".clone()" not in _ran_graph(fast).code


class _Buffers(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.register_buffer("buf", torch.arange(6, dtype=dtype).reshape(2, 3))


def _run_both(body, make=_Buffers, calls=7):
    fast_m, ref_m = make(), make()
    fast = specularch.optimize(lambda x: body(fast_m, x))
    for i in range(calls):
        x = torch.full((2, 3), 0.5 + i)
        got, want = fast(x), body(ref_m, x)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
        assert torch.equal(fast_m.buf, ref_m.buf) and fast_m.buf.dtype == ref_m.buf.dtype
    return fast


def test_read_between_updates_ends_the_fold():
    """`buf.mul_(); v = buf[0]; buf.add_(x)`: the view must see the second update, so only
    the first update is folded and the second stays in place on the folded result."""
    def body(m, x):
        with torch.no_grad():
            m.buf.mul_(0.5)
            row = m.buf[0]
            total = m.buf.sum()
            m.buf.add_(x)
        return row * 1, total, m.buf * 1
    fast = _run_both(body)
    code = _ran_graph(fast).code
    assert ".clone()" not in code and ".mul(" in code and ".add_(" in code


def test_type_promotion_keeps_the_clone():
    """`half_buf.add_(float_x)` keeps the buffer's dtype; `half_buf.add(float_x)` would not."""
    def body(m, x):
        with torch.no_grad():
            m.buf.add_(x)
        return (m.buf * 1,)
    fast = _run_both(body, make=lambda: _Buffers(torch.float16))
    assert _ran_graph(fast).code.count(".clone()") == 1


def test_failed_assumption_after_the_update_commits_nothing():
    """A branch on a tensor value after the update goes the other way: the call runs
    eagerly and the buffer is updated once, as in eager."""
    def body(m, x):
        with torch.no_grad():
            m.buf.mul_(0.5).add_(x)
        if m.buf.sum() < 100:
            return (m.buf + 1,)
        return (m.buf - 1,)
    fast = _run_both(body, calls=11)  # captured at the 4th call; the sum passes 100 at the 10th
    stats = _state_of(fast).stats
    assert stats.assumption_failures == 1


def test_training_step_assumption_failure_after_the_optimizer_step():
    """A speculated branch after `opt.step()` flips: parameters, `.grad` and Adam state end
    as eager's (the graph's updates were not committed, the eager run made them once)."""
    def after(model, loss):
        if model[2].bias.sum() > 0.06:  # passes 0.06 after the capture (4th step)
            return loss.item(), True
        return loss.item(), False
    model, opt = _adam_setup()
    with torch.no_grad():
        model[2].bias.fill_(0.002)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=1e-3)
    fast, ref = specularch.optimize(_step_fn(model, opt, after)), _step_fn(ref_model, ref_opt, after)
    signs = []
    for x, y in _batches(12):
        got = fast(x, y)
        assert got == ref(x, y)
        signs.append(got[1])
        _same_state(model, opt, ref_model, ref_opt)
    assert len(set(signs)) == 2, "the branch should flip within the steps"
    assert _state_of(fast).stats.assumption_failures >= 1


def test_fold_clones_leaves_the_input_graph_alone():
    def body(m, x):
        with torch.no_grad():
            m.buf.add_(x)
        return (m.buf * 1,)
    fast = _run_both(body)
    captured = _state_of(fast).entries[0].capture.graph_module
    assert ".clone()" in captured.code
    assert ".clone()" not in fold_clones(captured).code and ".clone()" in captured.code
