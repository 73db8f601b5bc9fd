"""What one check of a graph's guards costs: explain() reports it (timed at compile time,
keeping nothing of the call), and the generated check reads each source once, leaves
"not an inference tensor" to the C++ tensor check, and checks written tensors' storages
without a Python loop. Each behaviour is compared with eager."""
import gc
import re
import weakref

import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of
from specularch.guards.aliasing import _storages_distinct_exact, storages_distinct
from differential import mse_train_step


def _adam_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, mse_train_step(model, opt)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def test_explain_reports_guard_micros_and_keeps_no_argument_alive(no_profiling):
    model, _, step = _adam_step()
    ref_model, _, ref_step = _adam_step()
    fast = specularch.optimize(step)
    x, y = _batch(0)
    alive = weakref.ref(x)
    for i in range(3):
        assert fast(*_batch(i)) == ref_step(*_batch(i))
    assert fast(x, y) == ref_step(x, y)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    report = specularch.explain(fast)
    assert report.graphs and all(0 < g.guard_us < 10_000 for g in report.graphs), report
    assert re.search(r"guards=\d+ \([\d.]+µs\)", str(report)), str(report)
    del x
    gc.collect()
    assert alive() is None  # the guard timing held nothing of the call


def test_check_reads_optimizer_state_keys_through_names(no_profiling):
    model, opt, step = _adam_step()
    fast = specularch.optimize(step)
    for i in range(3):
        fast(*_batch(i))
    source = _state_of(fast).entries[0].entry_source
    guards = source[:source.index("    except Exception:")]
    # Keys of opt.state and the parameters' identity with the optimizer's are the variables
    # already holding them, not the path to them evaluated again.
    assert re.search(r"\.get\(s\d+\)", guards), guards
    assert guards.count("param_groups") == 1, guards  # read once, then by name
    assert len(list(model.parameters())) == len(re.findall(r"\.get\(s\d+\)", guards))


def test_inference_tensor_fails_the_fast_check_and_runs_like_eager(no_profiling):
    def update(p, g):
        p.add_(g)
        return p * 2

    fast = specularch.optimize(update)
    for _ in range(2):
        p, g = torch.randn(3), torch.randn(3)
        ref = p.clone()
        assert torch.equal(fast(p, g), update(ref, g)) and torch.equal(p, ref)
    source = _state_of(fast).entries[0].entry_source
    assert "is_inference" not in source  # the C++ check covers it
    first = _state_of(fast).entries[0]
    hits = first.hits
    with torch.inference_mode():
        p = torch.randn(3)
        ref = p.clone()
    with pytest.raises(RuntimeError) as eager:
        update(ref, g)
    with pytest.raises(RuntimeError) as optimized:
        fast(p, g)
    assert str(optimized.value) == str(eager.value) and torch.equal(p, ref)
    assert first.hits == hits  # its guards rejected the inference tensor


@pytest.mark.parametrize("case", ["distinct", "written view", "other view", "empty", "twice",
                                  "empty views", "disjoint views", "offset view of a written",
                                  "written at an offset", "overlapping offsets"])
def test_storages_distinct_agrees_with_the_exact_check(case):
    base = torch.randn(10)
    a, b, c = torch.randn(3), torch.randn(4), torch.randn(2)
    written, others = {
        "distinct": ((a, b), (c,)),
        "written view": ((base[:3], base[5:]), (c,)),
        "other view": ((a, base), (base[2:4],)),
        "empty": ((torch.empty(0), torch.empty(0), a), (torch.empty(0),)),
        "twice": ((a, a), ()),
        "empty views": ((base[3:3], a), (base,)),
        "disjoint views": ((a,), (base[:2], base[4:])),
        # data_ptr() differs from the storage's address: the fast path must not trust it
        "offset view of a written": ((base, a), (base[4:6],)),
        "written at an offset": ((base[2:5], a), (base,)),
        "overlapping offsets": ((base[1:4],), (base[2:3],)),
    }[case]
    assert storages_distinct(written, others) == _storages_distinct_exact(written, others)
