"""The fast paths of the generated guard check (issue 14 item 5) still miss whenever the full
check would: process state read by one C++ call, global module hooks read inline. Each case
changes something between calls and compares the optimized call with eager."""
import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of
from differential import mse_train_step


def _warm(fast, ref, *args):
    """Two calls, equal to eager; returns the graph entry they captured and hit."""
    for _ in range(2):
        assert torch.equal(fast(*args), ref(*args))
    entries = _state_of(fast).entries
    assert len(entries) == 1 and entries[0].hits >= 1
    return entries[0]


def _scaled_sum(x, w):
    return (x @ w).sum(0)


def _zeros_plus(x, w):
    return torch.zeros(w.shape[1]) + x.sum()  # the default dtype decides the result's dtype


def _args():
    torch.manual_seed(0)
    return torch.randn(4, 3), torch.randn(3, 2)


def _same(a, b):
    return a.dtype == b.dtype and a.is_inference() == b.is_inference() and torch.equal(a, b)


def _ones(n):
    return torch.ones(n) * 2  # no tensor input: no C++ tensor check to notice inference mode


def test_inference_mode_with_grad_enabled_misses(no_profiling):
    # grad mode is on, as at capture: only inference mode differs, which torch's C++ check of
    # the global state does not cover.
    fast = specularch.optimize(_ones)
    entry = _warm(fast, _ones, 3)
    hits = entry.hits
    with torch.inference_mode(), torch.enable_grad():
        got, want = fast(3), _ones(3)
    assert _same(got, want) and want.is_inference()
    assert entry.hits == hits


def test_autocast_change_misses(no_profiling):
    fast = specularch.optimize(_scaled_sum)
    x, w = _args()
    entry = _warm(fast, _scaled_sum, x, w)
    hits = entry.hits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = fast(x, w), _scaled_sum(x, w)
    assert _same(got, want) and want.dtype == torch.bfloat16
    torch.set_autocast_enabled("cuda", True)  # a flag our guard reads, though no CPU op uses it
    try:
        assert _same(fast(x, w), _scaled_sum(x, w))
    finally:
        torch.set_autocast_enabled("cuda", False)
    assert entry.hits == hits


def test_default_dtype_change_misses(no_profiling):
    fast = specularch.optimize(_zeros_plus)
    x, w = _args()
    entry = _warm(fast, _zeros_plus, x, w)
    hits, previous = entry.hits, torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got, want = fast(x, w), _zeros_plus(x, w)
    finally:
        torch.set_default_dtype(previous)
    assert _same(got, want) and want.dtype == torch.float64
    assert entry.hits == hits


def test_state_only_the_cpp_check_reads_still_hits(no_profiling):
    # The C++ snapshot also compares the number of threads; our guard does not: the Python
    # conditions decide, and the graph is still used.
    fast = specularch.optimize(_scaled_sum)
    x, w = _args()
    entry = _warm(fast, _scaled_sum, x, w)
    hits, threads = entry.hits, torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert _same(fast(x, w), _scaled_sum(x, w))
    finally:
        torch.set_num_threads(threads)
    assert entry.hits == hits + 1 and len(_state_of(fast).entries) == 1


def test_global_module_hook_added_after_capture_runs(no_profiling):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    fast = specularch.optimize(lambda x: model(x) * 2)
    x = torch.randn(4, 3)
    _warm(fast, lambda x: model(x) * 2, x)
    for register in (nn.modules.module.register_module_forward_hook,
                     nn.modules.module.register_module_forward_pre_hook):
        runs = []
        for fn in (lambda x: model(x) * 2, fast):
            seen = []
            handle = register(lambda *args, seen=seen: seen.append(type(args[0]).__name__))
            try:
                runs.append((fn(x), seen))
            finally:
                handle.remove()
        (want, want_seen), (got, got_seen) = runs
        assert torch.equal(got, want) and got_seen == want_seen and len(want_seen) == 3


def _adam_pair():
    """An optimized Adam step and its eager twin, with two steps behind them (state made)."""
    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        pairs.append((model, opt, mse_train_step(model, opt)))
    (model, opt, step), (ref_model, ref_opt, ref_step) = pairs
    fast = specularch.optimize(step)
    for i in range(3):
        assert fast(*_batch(i)) == ref_step(*_batch(i))
    return (model, opt, fast), (ref_model, ref_opt, ref_step)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _same_training_state(a, b):
    (model, opt), (ref_model, ref_opt) = a, b
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[q][key]), key


def _steady_entry(fast):
    entries = _state_of(fast).entries
    return max(entries, key=lambda e: e.hits)


@pytest.mark.parametrize("change", ["other strides", "view at an offset", "shares memory with state",
                                    "requires grad"])
def test_zero_grad_drops_any_old_gradient_without_recapture(no_profiling, change):
    # zero_grad() only asks whether a gradient is None: what it was does not matter to eager,
    # so the graph is used whatever it is now (its shape, dtype, memory).
    (model, opt, fast), (ref_model, ref_opt, ref_step) = _adam_pair()
    entry = _steady_entry(fast)
    hits, graphs = entry.hits, len(_state_of(fast).entries)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        w = m[0].weight
        w.grad = {"other strides": lambda: torch.zeros(w.shape[::-1]).t(),
                  "view at an offset": lambda: torch.zeros(w.numel() + 4)[4:].view(w.shape),
                  "shares memory with state": lambda: o.state[w]["exp_avg"],
                  "requires grad": lambda: torch.ones(w.shape, requires_grad=True)}[change]()
    assert fast(*_batch(7)) == ref_step(*_batch(7))
    _same_training_state((model, opt), (ref_model, ref_opt))
    assert entry.hits == hits + 1 and len(_state_of(fast).entries) == graphs


def test_gradient_set_to_none_between_calls_misses(no_profiling):
    (model, opt, fast), (ref_model, ref_opt, ref_step) = _adam_pair()
    entry = _steady_entry(fast)
    hits = entry.hits
    model[2].bias.grad = None
    ref_model[2].bias.grad = None
    assert fast(*_batch(8)) == ref_step(*_batch(8))
    _same_training_state((model, opt), (ref_model, ref_opt))
    assert entry.hits == hits
    for i in range(9, 11):  # and the usual step hits again
        assert fast(*_batch(i)) == ref_step(*_batch(i))
    _same_training_state((model, opt), (ref_model, ref_opt))


def test_optimizer_step_hook_added_after_capture_runs(no_profiling):
    (model, opt, fast), (ref_model, ref_opt, ref_step) = _adam_pair()
    calls = []
    for o in (opt, ref_opt):
        o.register_step_post_hook(lambda o, args, kwargs: calls.append(type(o).__name__))
    assert fast(*_batch(9)) == ref_step(*_batch(9))
    assert calls == ["Adam", "Adam"]
    _same_training_state((model, opt), (ref_model, ref_opt))


def test_lr_scheduler_made_after_capture_wraps_step(no_profiling):
    # The scheduler wraps the optimizer's step (an instance attribute): the graph, captured
    # with the class's step, must not run in its place.
    (model, opt, fast), (ref_model, ref_opt, ref_step) = _adam_pair()
    entry = _steady_entry(fast)
    hits = entry.hits
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    assert "step" in opt.__dict__
    assert fast(*_batch(12)) == ref_step(*_batch(12))
    assert entry.hits == hits
    _same_training_state((model, opt), (ref_model, ref_opt))
    assert getattr(opt, "_opt_called", None) == getattr(ref_opt, "_opt_called", None)
    for s in schedulers:
        s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
