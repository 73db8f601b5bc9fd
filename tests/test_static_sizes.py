"""Sizes of intermediate tensors that stay the same for every size of a graph's dynamic inputs
(``symbolic/static_sizes.py``) are numbers of the graph, not values it computes and checks:
an ``nn.GRU``/``nn.LSTM`` over sequences of varying length gives a graph of tensors only,
which the compiling backends take. Differential against eager (values, gradients, random
numbers) at every call, sizes of one included; a size that varies, or is fixed only under an
assumption (``x[:, :4]``), stays a graph value."""
import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of

pytestmark = pytest.mark.usefixtures("no_profiling")

LENGTHS = (5, 7, 9, 1, 3, 12)


class _LM(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.drop = nn.Dropout(0.25)  # the probe's zeros go through it: the stream is put back
        self.rnn = cell(16, 8, batch_first=True)
        self.out = nn.Linear(8, 50)

    def forward(self, x):
        h, _ = self.rnn(self.drop(self.emb(x)))
        return self.out(h)


def _twins(cell, backend):
    torch.manual_seed(0)
    model = _LM(cell)
    twin = _LM(cell)
    twin.load_state_dict(model.state_dict())
    return specularch.optimize(model, backend=backend), model, twin


def _step_both(opt, model, twin, length, exact):
    x = torch.randint(0, 50, (4, length), generator=torch.Generator().manual_seed(length))
    torch.manual_seed(length)
    got = opt(x)
    torch.manual_seed(length)
    want = twin(x)
    assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5), length
    got.square().mean().backward()
    want.square().mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad) if exact else torch.allclose(p.grad, q.grad, atol=1e-5)


def _dynamic_graph(opt):
    entries = _state_of(opt).entries
    dynamic = [e for e in entries if e.capture.graph_module.meta.get("dynamic_inputs")]
    assert dynamic, [e.capture.code for e in entries]
    return dynamic[-1]


def _sizes_of_two(entry, held: bool = True) -> list[str]:
    return [g.describe() for g in entry.capture.guards if g.describe().endswith(f">= 2) == {held}")]


def _folded_graph(opt):
    """The graph whose sizes were folded: it holds for dynamic sizes of at least 2 (guarded);
    a call with a length of 1 was captured again, without folding (``needs_two``)."""
    entries = [e for e in _state_of(opt).entries if _sizes_of_two(e)]
    assert len(entries) == 1, [e.capture.code for e in _state_of(opt).entries]
    return entries[0]


@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM])
def test_an_rnn_over_sequences_of_varying_length_is_a_graph_of_tensors_only(cell):
    opt, model, twin = _twins(cell, "auto")  # (runs fx: no graph gets hot in tests)
    for length in LENGTHS:
        _step_both(opt, model, twin, length, exact=True)
    entry = _folded_graph(opt)
    gm = entry.capture.graph_module
    code = gm.code
    # the batch, the embedding's width, the hidden state's sizes: numbers of the graph
    assert ".size(" not in code and "same_value" not in code, code
    assert not gm.meta["non_tensor_outputs"] and not gm.meta["in_graph_assumptions"]
    assert _sizes_of_two(entry) == ["(L['x'].shape[1] >= 2) == True"], _sizes_of_two(entry)
    # the first length, then every length of at least 2, then the length of 1 on its own
    # (guarded to sizes below 2: the later lengths run the folded graph again)
    assert _state_of(opt).stats.captures == 3
    [folded] = [g for g in specularch.explain(opt).graphs if any(">= 2) == True" in x for x in g.guards)]
    assert folded.hits == 4  # lengths 7, 9, 3 and 12
    small = [e for e in _state_of(opt).entries if _sizes_of_two(e, held=False)]
    assert len(small) == 1 and small[0].capture.graph_module.meta["in_graph_assumptions"]


def _compiled_for_one_length(opt, backend: str) -> None:
    """The compiled form fixes the length (torch's decomposition of the layer loops over
    time), which its size check states; other lengths run the graph's ``fx`` code."""
    [sizes] = [g.sizes for g in specularch.explain(opt).graphs if g.backend == backend]
    assert "L['x'].size()[1] == " in sizes and "call(s) outside ran fx" in sizes, sizes


@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM])
def test_torchscript_compiles_it_with_the_length_fixed_by_its_size_check(cell):
    opt, model, twin = _twins(cell, "torchscript")
    for length in LENGTHS:
        _step_both(opt, model, twin, length, exact=False)
    entry = _folded_graph(opt)
    assert entry.backend == "torchscript" and not entry.note, entry.note
    _compiled_for_one_length(opt, "torchscript")
    # the length of 1's graph: a compile for every size (traced at 2+) would never run there
    [small] = [e for e in _state_of(opt).entries if _sizes_of_two(e, held=False)]
    assert small.backend == "fx" and "below 2 only" in small.note, small.note


def _state_checked(x, hidden: int = 8):
    """What ``nn.LSTM`` does with its state: made from the input's batch, then its whole size
    compared with a tuple built from the input's (``check_hidden_size``)."""
    h = (x * 2).sum(1)
    state = torch.zeros(1, h.size(0), hidden)
    if state.size() != (1, h.size(0), hidden):
        raise RuntimeError("state of the wrong size")
    return state + h.sum()


def _shape_branch(x):
    y = x * 2
    if y.size() == (4, 3):  # true at one batch size only
        return y + 1
    return y - 1


SIZED = [(6, 5), (9, 5), (3, 5), (12, 5), (2, 5)]
BRANCHING = [(4, 3), (5, 3), (4, 3), (7, 3), (4, 3), (2, 3)]


@pytest.mark.parametrize("backend", ["auto", "fx"])
def test_a_size_tuple_compared_with_one_built_from_the_same_sizes_keeps_one_graph(backend):
    """Compared item by item: the items equal for every size need no check (``auto``) or
    one in-graph check each (``fx``); before, the whole tuple was specialised, the check
    failed at the next size and sizes became static: a graph per size."""
    opt = specularch.optimize(_state_checked, backend=backend)
    for shape in SIZED:
        x = torch.randn(*shape)
        torch.testing.assert_close(opt(x), _state_checked(x), rtol=0, atol=0)
    state = _state_of(opt)
    assert state.stats.captures == 2 and state.stats.assumption_failures == 0
    gm = _dynamic_graph(opt).capture.graph_module
    assert bool(gm.meta["in_graph_assumptions"]) == (backend == "fx"), gm.code


@pytest.mark.parametrize("backend", ["auto", "fx"])
def test_a_size_tuple_that_equals_a_constant_at_some_sizes_decides_as_eager(backend):
    opt = specularch.optimize(_shape_branch, backend=backend)
    for shape in BRANCHING:
        x = torch.randn(*shape)
        torch.testing.assert_close(opt(x), _shape_branch(x), rtol=0, atol=0)


def test_an_rnn_over_a_varying_batch_and_length_keeps_one_graph():
    """``nn.LSTM`` time-major, batch and length drawn each call: its state check compares
    ``hx.size()`` with the input's batch (the benchmark's ``rnn_lm`` had a graph per size,
    then hit the cache limit)."""
    torch.manual_seed(0)
    rnn, twin = nn.LSTM(16, 8), nn.LSTM(16, 8)
    twin.load_state_dict(rnn.state_dict())
    opt = specularch.optimize(rnn)
    for batch, length in [(3, 5), (6, 7), (2, 4), (9, 5), (4, 9), (7, 3)]:
        x = torch.randn(length, batch, 16)
        got, want = opt(x)[0], twin(x)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _state_of(opt).stats.captures == 2


def test_pinned_fx_keeps_its_size_checks_and_pays_nothing_to_decide():
    """Only ``fx`` runs the graph: its checks cost microseconds; deciding costs seconds once."""
    opt, model, twin = _twins(nn.GRU, "fx")
    for length in LENGTHS:
        _step_both(opt, model, twin, length, exact=True)
    assert _dynamic_graph(opt).capture.graph_module.meta["in_graph_assumptions"]


def _sliced(x):
    y = (x * 2)[:, :4]  # 4 wide while the input is, fewer below: fixed only if x.size(1) >= 4
    return y.sum(1) + torch.ones(y.size(1)).sum(), torch.ones(y.size(1))


def _flat(x):
    h = x * 2
    return h.reshape(h.size(0), -1).sum(1)


@pytest.mark.parametrize("fn, sizes", [(_sliced, [(3, 7), (3, 9), (3, 3), (3, 2), (3, 1), (3, 30)]),
                                       (_flat, [(6, 2, 3), (9, 2, 3), (1, 2, 3), (2, 2, 3)])])
def test_a_size_that_varies_or_is_fixed_only_under_an_assumption_stays_a_graph_value(fn, sizes):
    opt = specularch.optimize(fn)
    for shape in sizes:
        x = torch.randn(*shape)
        torch.testing.assert_close(opt(x), fn(x), rtol=0, atol=0)
    assert ".size(" in _dynamic_graph(opt).capture.code
    # nothing was folded, so nothing holds only for sizes of 2 and more: the size of 1 runs
    # the same graph (it had a graph of its own, guarded below 2, before)
    assert not _sizes_of_two(_dynamic_graph(opt)) and _state_of(opt).stats.captures == 2


@pytest.mark.slow
def test_inductor_compiles_it_and_a_second_compile_is_not_answered_by_a_cache_of_other_sizes(cache_dir,
                                                                                             monkeypatch):
    """Inductor's on-disk caches answered a dynamic compile of the GRU's graph with code
    fixed to one length ("expected size 4==4, stride 5==11") that the size check let every
    length through: dynamic compiles no longer use them."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    for _ in range(2):  # the second model's compile finds the first's in the caches
        opt, model, twin = _twins(nn.GRU, "inductor")
        for length in LENGTHS:
            _step_both(opt, model, twin, length, exact=False)
        entry = _folded_graph(opt)
        assert entry.backend == "inductor" and not entry.note, entry.note
        _compiled_for_one_length(opt, "inductor")


def test_past_probe_bytes_nothing_more_is_folded(monkeypatch):
    """The probe keeps its tensors for the capture: past ``PROBE_BYTES`` (a large model's
    activations held twice) it stops, and sizes stay graph values (checked, as before)."""
    from specularch.symbolic import static_sizes
    monkeypatch.setattr(static_sizes, "PROBE_BYTES", 0)
    opt, model, twin = _twins(nn.GRU, "torchscript")
    for length in LENGTHS:
        _step_both(opt, model, twin, length, exact=False)
    assert _dynamic_graph(opt).capture.graph_module.meta["in_graph_assumptions"]
