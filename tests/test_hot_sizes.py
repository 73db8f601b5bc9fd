"""A forward graph whose batch dimension became dynamic (a short last batch), compiled in the
worker process for the sizes most of its calls have (``tiering/hot_sizes.py``), other sizes
running ``fx``: differential against an eager twin on every parameter after each step, and
the graph's tier history; sizes with no majority compile for every size on the thread."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch import tiering
from specularch.tiering import policy
from specularch.tiering.hot_sizes import SizeCount

from differential import assert_same

pytestmark = pytest.mark.usefixtures("no_profiling")


def test_size_count_finds_the_sizes_of_most_calls():
    seen = []
    count = SizeCount(lambda *args: seen.append(args) or "out", {1: [0, 2]})
    for n in (4, 4, 2, 4):
        assert count(None, torch.zeros(n, 3, 5)) == "out"
    assert len(seen) == 4 and count.common() == [(4, 5)]
    count.counts.clear()
    assert count.common() is None
    for n in (2, 3, 4, 5):
        count(None, torch.zeros(n, 3, 5))
    assert count.common() is None  # (no size has half the calls, each seen once)


def test_a_few_common_sizes_get_a_form_each():
    """No size has half the calls: the commonest (at most MAX_FORMS, each a tenth of the
    calls and seen twice) if together they have half; else none."""
    count = SizeCount(lambda *args: None, {0: [0]})
    for n in [3, 5, 7] * 4 + [9]:
        count(torch.zeros(n))
    assert count.common() == [(3,), (5,), (7,)]  # (none alone has half)
    count.counts.clear()
    for n in [3] * 6 + [5] * 3 + list(range(10, 22)):  # 21 calls, a tenth: 2.1
        count(torch.zeros(n))
    assert count.common() is None  # sizes 3 and 5: 9 of 21 calls, not half
    for _ in range(3):
        count(torch.zeros(3))
    assert count.common() == [(3,), (5,)]  # 12 of 24 (each of 10..21: one call, no form)
    count.counts.clear()
    for n in range(1, 30):  # sizes that vary from call to call
        count(torch.zeros(n))
    assert count.common() is None


def _train_both(batches, rounds):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    twin = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    twin.load_state_dict(model.state_dict())
    opt = specularch.optimize(model)
    adams = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (twin, model)]
    for _ in range(rounds):
        for x, y in batches:
            for call, adam in ((twin, adams[0]), (opt, adams[1])):
                adam.zero_grad()
                F.mse_loss(call(x), y).backward()
                adam.step()
            for (name, p), q in zip(twin.state_dict().items(), model.state_dict().values()):
                assert_same(p, q, name, rtol=1e-4, atol=1e-6)
        tiering.wait(timeout=120)
    return opt


def test_a_short_last_batch_compiles_for_the_full_batch_in_the_worker(hot_at_once, monkeypatch, cache_dir):
    """Run twice on one compile cache: the second run loads the form compiled for batches
    of 4 (its key names the sizes) without a worker."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)  # keep it
    torch.manual_seed(1)
    batches = [(torch.randn(n, 8), torch.randn(n, 2)) for n in (4, 4, 4, 2)]
    wheres = []
    for _ in range(2):
        specularch.reset()
        opt = _train_both(batches, 20)
        graph = specularch.explain(opt).graphs[-1]
        (event,) = graph.tier.events
        assert (event.decision, graph.backend) == ("kept", "torchscript"), event
        wheres.append(event.compiled_in)
        assert graph.sizes.startswith(
            "compiled for the sizes of most calls where "
            "L['input'].size()[0] == 4 and L['input'].is_contiguous();"), graph.sizes
        assert not graph.sizes.endswith(" 0 call(s) outside ran fx")  # (the short batches did)
    note = "; compiled for the sizes of most calls, others run fx (explain's sizes line)"
    assert wheres == ["worker process" + note, "from the compile cache" + note], wheres


def test_sizes_without_a_majority_compile_for_every_size_on_the_thread(hot_at_once, monkeypatch):
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(1)
    batches = [(torch.randn(n, 8), torch.randn(n, 2)) for n in (4, 2, 3, 5, 6, 7)]
    opt = _train_both(batches, 4)
    graph = specularch.explain(opt).graphs[-1]
    (event,) = graph.tier.events
    assert event.decision == "kept", event
    assert event.compiled_in.startswith(
        "thread: its AOT-autograd form cannot be sent (it has dynamic sizes: 4 different sizes "
        "in 4 calls, the commonest in 1)"), event
    assert graph.sizes.startswith("compiled for every size where"), graph.sizes


def test_a_whole_step_with_a_short_last_batch_compiles_for_the_full_batch(hot_at_once, monkeypatch):
    """A whole training step (flattened: loss, backward and Adam in the graph) whose batch
    became dynamic: compiled in the worker for batches of 4, the short batch on fx, every
    parameter as eager's after each step."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    adams = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]

    def step(model, adam, x, y):
        adam.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        adam.step()
        return loss.detach()

    fast = specularch.optimize(step)
    torch.manual_seed(1)
    batches = [(torch.randn(n, 8), torch.randn(n, 2)) for n in (4, 4, 4, 2)]
    for _ in range(20):
        for x, y in batches:
            assert_same(step(models[0], adams[0], x, y), fast(models[1], adams[1], x, y), rtol=1e-4)
            for (name, p), q in zip(models[0].state_dict().items(), models[1].state_dict().values()):
                assert_same(p, q, name, rtol=1e-4, atol=1e-6)
        tiering.wait(timeout=120)
    graph = next(g for g in specularch.explain(fast).graphs if g.tier is not None and g.tier.events)
    (event,) = graph.tier.events
    assert (event.decision, graph.backend) == ("kept", "torchscript"), event
    assert event.compiled_in.startswith("worker process; compiled for the sizes of most calls"), event
    assert not graph.sizes.endswith(" 0 call(s) outside ran fx"), graph.sizes


def test_a_few_batch_sizes_compile_one_form_each_in_the_worker(hot_at_once, monkeypatch):
    """Batches of 4, 6 and 8 rows in turn (none the size of most calls): one TorchScript form
    per size, each call running its own, every parameter as eager's after each step."""
    hot_at_once("torchscript")
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)
    torch.manual_seed(1)
    batches = [(torch.randn(n, 8), torch.randn(n, 2)) for n in (4, 6, 8, 4, 6, 8)]
    with specularch.config.patch(tier_min_hits=12):  # sizes counted on a dozen calls
        opt = _train_both(batches, 8)
    graph = specularch.explain(opt).graphs[-1]
    (event,) = graph.tier.events
    assert (event.decision, graph.backend) == ("kept", "torchscript"), event
    assert event.compiled_in.startswith("worker process; compiled for the 3 commonest sizes"), event
    assert graph.sizes.startswith("compiled for the 3 commonest sizes where "), graph.sizes
    assert all(f"L['input'].size()[0] == {n} and L['input'].is_contiguous()" in graph.sizes
               for n in (4, 6, 8)), graph.sizes
    assert graph.sizes.endswith("(3 compiles, one per size); 0 call(s) outside ran fx"), graph.sizes
