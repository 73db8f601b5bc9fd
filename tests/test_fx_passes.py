"""Graph passes of the `fx` backend (`specularch/fx_lower/passes.py`), differential against
eager: `fold_clones` turns `c = p.clone(); c.op_(...)` (an in-place update of a tensor that
outlives the call, computed on a copy) into the out-of-place op, bit for bit; the commit
copies with one `_foreach_copy_`."""
import copy
import operator

import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of
from specularch.fx_lower.foreach import batch_foreach
from specularch.fx_lower.passes import fold_clones
from differential import mse_train_step


def _ran_graph(fn) -> torch.fx.GraphModule:
    """The GraphModule the `fx` backend runs for the optimized function's first graph."""
    return _state_of(fn).entries[0].graph_fn.__self__


def _adam_setup(amsgrad=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3, amsgrad=amsgrad)


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
    fast, ref = specularch.optimize(mse_train_step(model, opt)), mse_train_step(ref_model, ref_opt)
    params = list(model.parameters())
    for x, y in _batches(8):
        assert fast(x, y) == ref(x, y)
        _same_state(model, opt, ref_model, ref_opt)
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    gm = _ran_graph(fast)
    assert gm.meta["constructed_by"] == "specularch.fx_lower.foreach.batch_foreach"  # after fold_clones
    # the step count, exp_avg, exp_avg_sq (with its square root, a scratch tensor) and the
    # parameter, read by nothing but each other's updates, are updated in place by the commit
    # (test_copy_tax.py): no clone left to fold, nothing copied back
    assert gm.meta["folded_clones"] == 0
    for op in (".clone()", ".lerp_(", ".addcdiv_(", "sqrt", "_foreach_mul"):
        assert op not in gm.code, op
    source = _state_of(fast).entries[0].entry_source
    assert "COPY_ALL(" not in source and "FOREACH_ADDCDIV_(" in source and "FOREACH_LERP_(" in source
    assert _state_of(fast).stats.graph_hits == 4  # 3 profiled calls, 1 capture


def test_amsgrad_copy_into_state_is_replayed_by_the_commit():
    """`max_exp_avg_sq.copy_(torch.maximum(...))`: the maximum is computed in the graph (it
    reads exp_avg_sq's new value, which stays a copy folded into out-of-place ops), the copy
    into the state is run by the commit (no clone left)."""
    model, opt = _adam_setup(amsgrad=True)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=1e-3, amsgrad=True)
    fast, ref = specularch.optimize(mse_train_step(model, opt)), mse_train_step(ref_model, ref_opt)
    for x, y in _batches(7):
        assert fast(x, y) == ref(x, y)
        _same_state(model, opt, ref_model, ref_opt)
    code = _ran_graph(fast).code
    assert code.count(".clone()") == 0 and code.count("_foreach_maximum(") == 1, code
    assert _ran_graph(fast).meta["folded_clones"] == 4  # exp_avg_sq
    source = _state_of(fast).entries[0].entry_source
    assert source.count(".copy_(R[") == 4 and "FOREACH_COPY_ALL(" in source, source


def test_parameter_read_after_its_update_in_the_same_step():
    """Reads after the update (the updated weight's norm, returned) see the final value."""
    after = lambda model, loss: (loss.item(), model[0].weight.detach().norm(), model[2].bias * 2)  # noqa: E731
    model, opt = _adam_setup()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=1e-3)
    fast, ref = specularch.optimize(mse_train_step(model, opt, after)), mse_train_step(ref_model, ref_opt, after)
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
    fast, ref = specularch.optimize(mse_train_step(model, opt, after)), mse_train_step(ref_model, ref_opt, after)
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


# --- batch_foreach: the same elementwise op over independent tensors -> one torch._foreach_* call

def _traced(fn, *inputs) -> torch.fx.GraphModule:
    """``fn`` symbolically traced, each node's value on ``inputs`` in ``meta["example"]`` (as
    capture records it)."""
    gm = torch.fx.symbolic_trace(fn)

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            n.meta["example"] = result = super().run_node(n)
            return result
    Record(gm).run(*inputs)
    return gm


def _members(body, k=3, shared=False):
    """f(t0.., u0.., v0.., s0..) returning body(t_i, u_i, v_i, s_i) for each of k members
    (``shared``: one number input ``s`` for all)."""
    names = ", ".join(f"{c}{i}" for c in "tuv" for i in range(k))
    names += ", s" if shared else "".join(f", s{i}" for i in range(k))
    calls = ", ".join(f"body(t{i}, u{i}, v{i}, s{'' if shared else i})" for i in range(k))
    ns = {"body": body}
    exec(f"def f({names}):\n    return ({calls},)\n", ns)
    return ns["f"]


def _inputs(dtype, scalars, shapes=((), (7,), (33, 5))):
    g = torch.Generator().manual_seed(len(scalars))
    make = lambda s: torch.randn(s, generator=g, dtype=dtype)  # noqa: E731
    t, u = [make(s) for s in shapes], [make(s) for s in shapes]
    v = [make(s).abs() + 0.25 for s in shapes]  # divisors, square roots
    return [*t, *u, *v, *scalars]


_BATCHED = {  # per-member body -> the foreach op it must become
    "t.add(s)": (lambda t, u, v, s: t.add(s), "_foreach_add"),
    "t + 2": (lambda t, u, v, s: t + 2, "_foreach_add"),
    "t.add(u, alpha=0.5)": (lambda t, u, v, s: t.add(u, alpha=0.5), "_foreach_add"),
    "t.sub(u, alpha=-3)": (lambda t, u, v, s: t.sub(u, alpha=-3), "_foreach_sub"),
    "t - s": (lambda t, u, v, s: t - s, "_foreach_sub"),
    "t * s": (lambda t, u, v, s: t * s, "_foreach_mul"),
    "t.mul(u)": (lambda t, u, v, s: t.mul(u), "_foreach_mul"),
    "t / s": (lambda t, u, v, s: t / s, "_foreach_div"),
    "t.div(v)": (lambda t, u, v, s: t.div(v), "_foreach_div"),
    "t.lerp(u, s)": (lambda t, u, v, s: t.lerp(u, s), "_foreach_lerp"),
    "t.addcmul(u, v, value=s)": (lambda t, u, v, s: t.addcmul(u, v, value=s), "_foreach_addcmul"),
    "t.addcmul(u, u)": (lambda t, u, v, s: t.addcmul(u, u), "_foreach_addcmul"),
    "t.addcdiv(u, v, value=s)": (lambda t, u, v, s: t.addcdiv(u, v, value=s), "_foreach_addcdiv"),
    "t.addcdiv(u, v, s)": (lambda t, u, v, s: t.addcdiv(u, v, value=1 - s), "_foreach_addcdiv"),
    "v.sqrt()": (lambda t, u, v, s: v.sqrt(), "_foreach_sqrt"),
    "torch.sqrt(v)": (lambda t, u, v, s: torch.sqrt(v), "_foreach_sqrt"),
    "t.neg()": (lambda t, u, v, s: t.neg(), "_foreach_neg"),
    "torch.maximum(t, u)": (lambda t, u, v, s: torch.maximum(t, u), "_foreach_maximum"),
    "(t * u).add_(s)": (lambda t, u, v, s: (t * u).add_(s), "_foreach_add_"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scalars", ["one number", "a number per member"])
@pytest.mark.parametrize("case", sorted(_BATCHED))
def test_batch_foreach_rule_matches_the_per_tensor_op_bit_for_bit(case, scalars, dtype):
    """Each rule, on members of different shapes: one foreach call, the same bits, dtypes and
    strides as the per-tensor ops (Python-number scalars, shared or one per member)."""
    body, foreach = _BATCHED[case]
    shared = scalars == "one number"  # one graph node for every member, or one each
    inputs = _inputs(dtype, [0.3] if shared else [0.3, -1.7, 2])
    gm = _traced(_members(body, shared=shared), *inputs)
    batched = batch_foreach(gm)
    assert batched.meta["foreach_groups"] >= 1
    assert f"torch.{foreach}(" in batched.code, batched.code
    want, got = gm(*inputs), batched(*inputs)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(g, w)


def _not_batched(fn, *inputs):
    gm = _traced(fn, *inputs)
    batched = batch_foreach(gm)
    assert batched.meta["foreach_groups"] == 0 and "_foreach_" not in batched.code, batched.code
    assert all(torch.equal(a, b) for a, b in zip(gm(*inputs), batched(*inputs)))


def test_batch_foreach_leaves_dependent_members_in_order():
    """`b = a * s` reads `a = t * s`: the same op and number, but b waits for a; the
    independent `c = u * s` joins a, not b."""
    def fn(t, u, s):
        a = t * s
        b = a * s
        c = u * s
        return a, b, c
    gm = _traced(fn, torch.randn(4), torch.randn(4), 1.5)
    batched = batch_foreach(gm)
    assert batched.meta["foreach_groups"] == 1
    group = next(n for n in batched.graph.nodes if n.target is torch._foreach_mul)
    assert [a.name for a in group.args[0]] == ["t", "u"]  # a and c; b stays per tensor
    ins = (torch.randn(4), torch.randn(4), 1.5)
    assert all(torch.equal(x, y) for x, y in zip(gm(*ins), batched(*ins)))


def test_batch_foreach_needs_one_alpha():
    """`_foreach_add(selfs, others, alpha=)` takes one alpha: different ones stay per tensor."""
    _not_batched(lambda t, u, p, q: (t.add(p, alpha=0.5), u.add(q, alpha=0.25)),
                 *[torch.randn(3) for _ in range(4)])


def test_batch_foreach_needs_one_dtype():
    """float32 and float64 members, or a member whose operands would promote, stay apart."""
    _not_batched(lambda t, u: (t * 2.0, u * 2.0), torch.randn(3), torch.randn(3, dtype=torch.float64))
    _not_batched(lambda t, u, p, q: (t.add(p), u.add(q)), torch.randn(3),
                 torch.randn(3), torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64))


def test_batch_foreach_needs_number_scalars():
    """A 0-d tensor operand where the other member has a number (other overloads, broadcasting)."""
    _not_batched(lambda t, u, w: (t * 2.0, u * w), torch.randn(3), torch.randn(3), torch.tensor(2.0))


def test_batch_foreach_does_not_move_across_other_nodes():
    """An op it does not know (a view) between two members ends the run: nothing moves past it."""
    _not_batched(lambda t, u, w: (t * 2.0, w.t(), u * 2.0), torch.randn(3), torch.randn(3), torch.randn(2, 3))


def test_batch_foreach_leaves_autograd_and_inputs_alone():
    """Results needing autograd, and in-place writes into inputs (not private temporaries)."""
    w, v = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    _not_batched(lambda t, u: (t * 2.0, u * 2.0), w, v)

    def writes(t, u):
        t.add_(1.0)
        u.add_(1.0)
        return t * 1, u * 1
    gm = _traced(writes, torch.randn(3), torch.randn(3))
    assert batch_foreach(gm).meta["foreach_groups"] == 1  # the two `* 1`, not the writes
    assert "_foreach_add_" not in batch_foreach(gm).code


def test_batch_foreach_keeps_reads_after_an_in_place_update():
    """`d = t * u; d.add_(s); r = d.sqrt()`: r reads d after the update, also once batched."""
    def fn(t, u, p, q, s):
        d, e = t * u, p * q
        d.add_(s)
        e.add_(s)
        return d.sqrt(), e.sqrt()
    ins = [torch.rand(5) for _ in range(4)] + [0.5]
    gm = _traced(fn, *ins)
    batched = batch_foreach(gm)
    assert batched.meta["foreach_groups"] == 3 and "torch._foreach_add_(" in batched.code
    assert all(torch.equal(a, b) for a, b in zip(gm(*ins), batched(*ins)))


_OPTIMIZERS = {
    "SGD momentum nesterov weight_decay": (lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), "_foreach_add"),
    "SGD momentum dampening maximize": (lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, dampening=0.1, maximize=True), "_foreach_neg"),
    "SGD two groups (two alphas)": (lambda ps: torch.optim.SGD(
        [{"params": ps[:2], "lr": 0.05}, {"params": ps[2:], "lr": 0.01}], momentum=0.9), "_foreach_mul"),
    "Adam weight_decay": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3), "_foreach_addcdiv"),
    "AdamW amsgrad": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2, amsgrad=True),
                      "_foreach_maximum"),
    "Adam two groups": (lambda ps: torch.optim.Adam(
        [{"params": ps[:2], "lr": 1e-2, "betas": (0.8, 0.95)}, {"params": ps[2:], "lr": 3e-3}]),
        "_foreach_lerp"),
}


def _tensor_calls(gm) -> int:
    """Calls that run tensor kernels (not `operator.getitem`, not arithmetic on numbers)."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_method", "call_function")
               and isinstance(n.meta.get("example"), torch.Tensor) and n.target is not operator.getitem
               or n.op == "call_function" and str(n.target).startswith("<built-in method _foreach_"))


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_batched_optimizer_steps_match_eager_bit_for_bit(name):
    """12 steps of a whole training step with batched updates: loss, parameters, `.grad` and
    optimizer state equal eager's. Parameter 0 gets no gradient in the first two steps, so
    its step count (and Adam's bias corrections: per-member numbers) differs from the others."""
    make_opt, foreach = _OPTIMIZERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make_opt(list(model.parameters())), make_opt(list(ref_model.parameters()))

    def warm(m, o, x, y):  # eager steps with the first weight frozen
        m[0].weight.requires_grad_(False)
        for _ in range(2):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        m[0].weight.requires_grad_(True)
    batches = _batches(14)
    warm(model, opt, *batches[0])
    warm(ref_model, ref_opt, *batches[0])

    def after(m, loss):  # the updated parameters read in the graph: the updates stay in it
        return (loss + sum(p.sum() for p in m.parameters())).item()  # (else: test_copy_tax.py)
    fast, ref = specularch.optimize(mse_train_step(model, opt, after)), mse_train_step(ref_model, ref_opt, after)
    for x, y in batches[1:13]:
        assert fast(x, y) == ref(x, y)
        _same_state(model, opt, ref_model, ref_opt)
    gm = _ran_graph(fast)
    assert _state_of(fast).stats.graph_hits >= 8
    assert f"torch.{foreach}(" in gm.code
    unbatched = fold_clones(_state_of(fast).entries[0].capture.graph_module)
    assert _tensor_calls(gm) < _tensor_calls(unbatched), (_tensor_calls(gm), _tensor_calls(unbatched))
    assert gm.code.count("torch._foreach_") == gm.meta["foreach_groups"]
