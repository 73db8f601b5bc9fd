"""JANUS-style speculation, differential against eager including the whole heap after every call.

Profiling (the first ``config.profile_calls`` calls run eagerly while argument facts are
recorded; what varied is generalised in the first graph), the shadow heap (writes that outlive
the call are deferred and committed, all-or-nothing, after every guard and assertion passed),
in-graph assumptions on tensor values (``if loss > 0:``, ``while err > tol:``) that are checked
before the commit and fall back as ``assumption_failed`` when they do not hold, relaxation of
sizes and Python numbers that keep changing, and strict mode.

Every program runs through the harness in ``differential.py``: eager and optimized twins on
identical inputs; results, arguments, module parameters / buffers / public attributes, globals
(``state=``), stdout and the RNG compared after each call. Globals here *accumulate* across
calls (``carried_globals``): each call starts from the value eager left after the previous
call, on both sides.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import specularch
from differential import (A, Pair, T, assert_same, check, check_module, expect_fallback,
                          expect_graph, marker_line)
from speculation_helpers import carried_globals, run_calls


def module_pair(make_module, **kw) -> Pair:
    return Pair.of_module(make_module, **kw)


# =========================================================================== JANUS Figure 1 RNN

class FigureOneRNN(nn.Module):
    """JANUS Figure 1: the hidden state is kept on ``self`` between sequences."""

    def __init__(self, d_in=4, hidden=6):
        super().__init__()
        self.hidden = hidden
        self.cell = nn.RNNCell(d_in, hidden)
        self.out = nn.Linear(hidden, 2)
        self.state = None

    def forward(self, seq, reset=False):
        if reset or self.state is None:
            self.state = torch.zeros(seq.shape[1], self.hidden)
        outputs = []
        for t in range(seq.shape[0]):
            self.state = self.cell(seq[t], self.state)
            outputs.append(self.out(self.state))
        return torch.stack(outputs)


RNN_LENGTHS = [5, 5, 3, 7, 5, 5, 3, 5, 7, 5]
RNN_RESETS = {4, 8}


def rnn_args(i):
    return A(T(RNN_LENGTHS[i], 2, 4), reset=i in RNN_RESETS)


@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
def test_figure_one_rnn_keeps_state_on_self_across_sequences_of_varying_length(profile):
    with specularch.config.patch(profile_calls=profile):
        pair = module_pair(FigureOneRNN)
        what = run_calls(pair, rnn_args, len(RNN_LENGTHS))
    e = pair.explain()
    expect_graph(e, "FigureOneRNN")
    assert e.stats.profiled_calls == profile, str(e)
    assert what[:profile] == ["profiled"] * profile, what
    assert "fallback" not in what, what
    # The time loop is unrolled per length (or the length is dynamic): never one graph per call.
    # (3 lengths, each with and without an existing state / reset.)
    assert len(e.graphs) <= 2 * len(set(RNN_LENGTHS)), f"{what}\n{e}"
    # A length, state presence and reset flag seen before is a graph hit.
    assert what[-1] == "hit" and what[-3] == "hit", f"{what}\n{e}"
    # self.state is read back on the next call: it was committed as a tensor, not a stale one.
    assert isinstance(pair.opt.state, torch.Tensor) and pair.opt.state.shape == (2, 6)


def test_figure_one_rnn_state_is_committed_under_no_grad():
    """Same program, inference: the committed state does not require grad, like eager's."""
    with specularch.config.patch(profile_calls=0), torch.no_grad():
        pair = module_pair(FigureOneRNN)
        what = run_calls(pair, rnn_args, 6)
    assert not pair.opt.state.requires_grad
    expect_graph(pair.explain(), "FigureOneRNN (no_grad)")
    assert "fallback" not in what


# =========================================================================== BatchNorm in train mode

class BN1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


class BN2dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=0.3)

    def forward(self, x):
        return self.bn(self.conv(x)).mean((2, 3))


BN_CASES = [(BN1dNet, lambda: A(T(4, 5))), (BN2dNet, lambda: A(T(3, 2, 4, 4)))]


@pytest.mark.parametrize("make_module,make_args", BN_CASES, ids=["BatchNorm1d", "BatchNorm2d"])
@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
def test_batchnorm_train_mode_updates_running_stats_exactly(make_module, make_args, profile):
    calls = 7
    with specularch.config.patch(profile_calls=profile):
        pair = module_pair(make_module, atol=0, rtol=0)
        ids = {n: id(b) for n, b in pair.opt.named_buffers()}
        what = run_calls(pair, make_args, calls)
    e = pair.explain()
    expect_graph(e, make_module.__name__)
    assert pair.opt.training
    assert len(e.graphs) == 1, f"{what}\n{e}"
    assert what[profile] == "capture" and what[profile + 1:] == ["hit"] * (calls - profile - 1), f"{what}\n{e}"
    assert int(pair.opt.bn.num_batches_tracked) == calls
    # the same buffer objects, updated in place (committed, not replaced)
    assert {n: id(b) for n, b in pair.opt.named_buffers()} == ids


TOGGLES = ["train", "train", "eval", "eval", "train", "eval", "train", "train", "eval"]


@pytest.mark.parametrize("make_module,make_args", BN_CASES, ids=["BatchNorm1d", "BatchNorm2d"])
def test_train_eval_toggle_between_calls(make_module, make_args, no_profiling):
    """The case where a trace-based converter silently keeps using the first trace: eval calls
    must not update the running stats, train calls must; both match eager after every toggle."""
    pair = module_pair(make_module)
    what = run_calls(pair, make_args, len(TOGGLES), between=lambda m, i: m.train(TOGGLES[i] == "train"))
    e = pair.explain()
    expect_graph(e, make_module.__name__)
    assert len(e.graphs) >= 2, f"{what}\n{e}"
    assert what[-2:] == ["hit", "hit"], f"{what}\n{e}"  # both modes cached
    assert int(pair.opt.bn.num_batches_tracked) == TOGGLES.count("train")
    assert e.recompiles and all(r.reasons for r in e.recompiles), str(e)


def test_batchnorm_train_mode_with_a_varying_batch_size(no_profiling):
    e = check_module(BN1dNet, lambda i: A(T([4, 3, 5, 6, 2, 4, 7][i], 5)), calls=7, expect="graph")
    assert len(e.graphs) <= 2, str(e)


class DropoutBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


def test_dropout_and_batchnorm_train_eval_toggle(no_profiling):
    # random numbers drawn in train mode only; the harness compares the RNG state too
    modes = ["train", "eval", "train", "train", "eval", "train"]
    e = check_module(DropoutBN, lambda: A(T(4, 5)), calls=len(modes), expect="graph",
                     between=lambda m, i: m.train(modes[i] == "train"))
    assert len(e.graphs) >= 2, str(e)


class CumulativeBN(nn.Module):
    """momentum=None: BatchNorm reads ``float(num_batches_tracked)`` right after incrementing it
    in place (a read after a deferred write, turned into a Python number)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3, momentum=None)

    def forward(self, x):
        return self.bn(x) * 2


def test_batchnorm_cumulative_average_reads_the_counter_it_just_incremented(no_profiling):
    # Graph or fallback both fine; the stats must be exactly eager's.
    check_module(CumulativeBN, lambda: A(T(4, 3)), calls=5)


# =========================================================================== bookkeeping on the heap

CALLS = 0
MEMO: dict = {}


class Bookkeeper(nn.Module):
    """Counts calls in a global, appends a tensor to a list attribute, memoises into a dict
    attribute and a global dict, and counts with ``+=`` on an attribute; reads its own writes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.history = []
        self.cache = {}
        self.count = 0

    def forward(self, x, key):
        global CALLS
        CALLS += 1
        self.count += 1
        y = self.fc(x)
        self.history.append(x.mean())
        self.cache[key] = y
        MEMO[key] = self.count
        # reads after the writes see the new values
        return y * CALLS + self.cache[key].sum() * self.count


BOOK_KEYS = {
    # the counters change every call, the key does not
    "one_key": ["a"] * 12,
    # the key changes too (a new guard failure on the key every call until each key has a
    # graph): the counters must still become inputs instead of exhausting config.cache_limit
    "cycling_keys": ["a", "b", "a", "c", "b", "a", "c", "c", "a", "b", "c", "a", "b", "c"],
}


@pytest.mark.parametrize("keys", list(BOOK_KEYS))
@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
def test_global_counter_list_append_and_dict_memo_match_eager_after_every_call(profile, keys):
    keys = BOOK_KEYS[keys]
    with specularch.config.patch(profile_calls=profile):
        pair = Pair.of_module(Bookkeeper, state=carried_globals(__name__, CALLS=0, MEMO={}))
        what = run_calls(pair, lambda i: A(T(2, 3), keys[i]), len(keys))
    e = pair.explain()
    assert e.fallbacks == [], str(e)
    assert what[:profile] == ["profiled"] * profile and "fallback" not in what, what
    assert len(pair.opt.history) == len(keys) and pair.opt.count == len(keys)
    assert CALLS == len(keys) and set(MEMO) == set(keys)
    assert len(e.graphs) <= len(set(keys)) + 1, f"{what}\n{e}"
    # once captured, the growing history and the changing counters do not keep failing guards
    assert what[-2:] == ["hit", "hit"], f"{what}\n{e}"


class RunningLog(nn.Module):
    """Reads back the item it has just appended (a read after a write in the same call)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.history = []

    def forward(self, x):
        self.history.append(self.fc(x).mean())
        return x * self.history[-1]


def test_reading_back_the_item_just_appended_to_a_list_attribute(no_profiling):
    pair = Pair.of_module(RunningLog)
    what = run_calls(pair, lambda: A(T(2, 3)), 12)
    e = pair.explain()
    assert e.fallbacks == [], f"{what}\n{e}"
    assert len(pair.opt.history) == 12
    assert what[-2:] == ["hit", "hit"], f"{what}\n{e}"


class Memo(nn.Module):
    """A real memo table on ``self``: a hit returns the stored tensor, a miss computes and
    stores it. The key set grows, so the dict is relaxed to keyed access."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.memo = {}
        self.misses = 0

    def forward(self, x, key):
        if key in self.memo:
            return self.memo[key] + x
        y = torch.tanh(self.fc(x))
        self.memo[key] = y
        self.misses += 1
        return y + x


def test_memo_table_with_a_growing_key_set_settles_on_one_graph_per_path(no_profiling):
    keys = ["a", "b", "a", "c", "b", "a", "c", "a", "b", "c"]
    pair = Pair.of_module(Memo)
    what = run_calls(pair, lambda i: A(T(2, 3), keys[i]), len(keys))
    e = pair.explain()
    assert e.fallbacks == [], f"{what}\n{e}"
    assert set(pair.opt.memo) == set(keys) and pair.opt.misses == 3
    relaxed = "\n".join(e.relaxations)
    assert "L['self'].memo: dict used through single keys" in relaxed, relaxed
    # one graph per (key, hit-or-miss) at most, never one per key set
    assert len(e.graphs) <= 2 * len(set(keys)), f"{what}\n{e}"
    guards = "\n".join(g for graph in e.graphs for g in graph.guards)
    assert "keys of L['self'].memo" not in guards, guards
    assert "in L['self'].memo) is" in guards, guards
    assert what[-3:] == ["hit"] * 3, f"{what}\n{e}"


class MemoThenSummed(nn.Module):
    """Writes single keys, then (from call 4 on) sums every value: the keyed relaxation is
    refused and the dict is tracked whole again."""

    def __init__(self):
        super().__init__()
        self.memo = {}
        self.calls = 0

    def forward(self, x, key):
        self.memo[key] = x * 2
        self.calls += 1
        if self.calls > 3:
            return sum(self.memo.values())
        return self.memo[key]


def test_a_keyed_dict_used_whole_is_tracked_again(no_profiling):
    keys = ["a", "b", "c", "d", "a", "e"]
    pair = Pair.of_module(MemoThenSummed)
    what = run_calls(pair, lambda i: A(T(2, 3), keys[i]), len(keys))
    e = pair.explain()
    assert e.fallbacks == [], f"{what}\n{e}"
    relaxed = "\n".join(e.relaxations)
    assert "L['self'].memo: dict used through single keys" in relaxed, relaxed
    assert "L['self'].memo: the code uses it as a whole" in relaxed, relaxed


class ReadsOldItems(nn.Module):
    """Appends every call; from call 4 on also reads the first item (an old one)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def forward(self, x):
        self.log.append(x.sum())
        if len(self.log) > 3:
            return x * self.log[0]
        return x * self.log[-1]


def test_an_append_only_list_whose_old_items_are_read_is_tracked_again(no_profiling):
    pair = Pair.of_module(ReadsOldItems)
    what = run_calls(pair, lambda: A(T(2, 3)), 6)
    e = pair.explain()
    assert e.fallbacks == [], f"{what}\n{e}"
    assert len(pair.opt.log) == 6
    relaxed = "\n".join(e.relaxations)
    assert "L['self'].log: list treated as append-only" in relaxed, relaxed
    assert "L['self'].log: the code uses it as a whole" in relaxed, relaxed


def make_counter():
    total = 0
    seen = []

    def add(x):
        nonlocal total
        total += 1
        seen.append(total)
        return x * total, total

    return add


def test_nonlocal_counter_in_a_closure(no_profiling):
    eager_fn, opt_fn = make_counter(), make_counter()
    opt = specularch.optimize(opt_fn)
    pair = Pair("make_counter.<locals>.add", eager_fn, opt, opt)
    what = run_calls(pair, lambda: A(T(3)), 12)
    e = pair.explain()
    assert e.fallbacks == [], str(e)
    assert "fallback" not in what and what[-1] == "hit", f"{what}\n{e}"
    cells = {name: cell.cell_contents for name, cell in zip(opt_fn.__code__.co_freevars, opt_fn.__closure__)}
    assert cells["total"] == 12 and cells["seen"] == list(range(1, 13))


# =========================================================================== tensor branches that flip

def flip(x):
    if x.sum() > 0:  # branch
        return x * 2
    return x - 1


FLIP_SIGNS = [1, 1, -1, 1, -1, -1, 1]


def test_tensor_branch_that_flips_is_speculated_then_falls_back(no_profiling):
    pair = Pair.of_function(flip)
    what = run_calls(pair, lambda i: A(T(3).abs() * FLIP_SIGNS[i] + 0.5 * FLIP_SIGNS[i]), len(FLIP_SIGNS))
    e = pair.explain()
    # the first calls run the speculated graph (the predicate is checked, not a fallback)
    assert what[:2] == ["capture", "hit"], f"{what}\n{e}"
    # the first flip: discarded graph result, eager re-run, recorded at the `if` line
    assert what[2] == "fallback", f"{what}\n{e}"
    found = expect_fallback(e, "assumption_failed", lineno=marker_line(flip, "branch"), what="flip")
    assert any("assum" in r.explanation.lower() for r in found), str(e)
    assert e.stats.assumption_failures >= 1, str(e)
    assert "assumption_failed" in str(e)
    # after both directions were seen, the branch is not speculated any more: fallbacks are
    # data_dependent_branch (or a graph with a real conditional), never another failed assumption
    assert {r.kind for r in e.fallbacks} <= {"assumption_failed", "data_dependent_branch"}, str(e)
    assert sum(r.count for r in found) == 1 and e.stats.assumption_failures == 1, str(e)


def flip_assign(x, w):
    h = x @ w
    if h.mean() > 0:
        y = h.relu()
    else:
        y = h.tanh() * 2
    z = y + 1 if y.sum() > 1 else y - 1  # a second, expression-level branch
    return z.sum(0)


def test_a_branch_seen_both_ways_becomes_a_select_in_the_graph(no_profiling):
    """JANUS: once a tensor branch has gone both ways, both sides (free of side effects) are
    kept in one graph and torch.where selects; no call falls back after the first flip."""
    signs = [1, 1, -1, 1, -1, -1, 1, -1, 1, 1]
    for fn, make in ((flip, lambda i: A(T(3).abs() * signs[i] + 0.5 * signs[i])),
                     (flip_assign, lambda i: A(T(3, 4).abs() * signs[i] + 0.5 * signs[i],
                                               torch.eye(4)))):
        pair = Pair.of_function(fn)
        what = run_calls(pair, make, len(signs))
        e = pair.explain()
        assert e.stats.assumption_failures <= 2 and what.count("fallback") <= 2, f"{what}\n{e}"
        assert what[-4:] == ["hit"] * 4, f"{what}\n{e}"
        assert "torch.where" in e.graphs[0].code, e.graphs[0].code
        assert {r.kind for r in e.fallbacks} <= {"assumption_failed"}, str(e)


def flip_with_effects(x, log):
    if x.sum() > 0:  # effects
        log.append(1)  # a write that outlives the call: the sides cannot both run
        return x * 2
    return x - 1


def flip_needing_grad(x):
    if x.sum() > 0:  # grad
        return x.sqrt()  # the side not taken would poison the gradient with NaN
    return -x


@pytest.mark.parametrize("fn, make, grad", [
    (flip_with_effects, lambda i: A(T(3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i], []), False),
    (flip_needing_grad, lambda i: A((T(3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i]).requires_grad_()),
     True)], ids=["heap_write", "requires_grad"])
def test_a_branch_whose_sides_cannot_be_merged_stops_speculating(no_profiling, fn, make, grad):
    pair = Pair.of_function(fn, grad=grad)
    run_calls(pair, make, len(FLIP_SIGNS))
    e = pair.explain()
    kinds = {r.kind for r in e.fallbacks}
    assert kinds == {"assumption_failed", "data_dependent_branch"}, str(e)
    assert e.stats.assumption_failures == 1, str(e)
    record = next(r for r in e.fallbacks if r.kind == "data_dependent_branch")
    assert "cannot be merged" in record.explanation, record.explanation


def flip_and(x, y):
    if (x > 0).all() and y.sum() > 1:  # the second condition is merged while a side runs
        z = x * 2
    else:
        z = x - y
    return z


def flip_or_returns(x, y):
    if x.sum() > 0 or (y.sum() > 0 and y.max() > 0.5):
        return x * 2
    return x - y


def flip_not_and(x, y):
    z = x + 1
    if not (x.sum() > 0 and y.sum() > 0):
        z = z + y
    return z * 3


QUADRANTS = [(1, 1), (-1, 1), (1, -1), (-1, -1), (1, 1), (1, -1), (-1, 1), (-1, -1),
             (1, 1), (1, -1), (-1, 1), (-1, -1)]


@pytest.mark.parametrize("fn", [flip_and, flip_or_returns, flip_not_and])
def test_short_circuit_conditions_seen_both_ways_become_selects(no_profiling, fn):
    """`a and b` / `a or b` / `not` on tensor conditions compile to chains of conditional
    jumps; once the first has gone both ways the whole chain is merged (the second operand
    is computed on both paths, which is safe because a merged side has no effects)."""
    def make(i):
        sx, sy = QUADRANTS[i]
        return A(T(3).abs() * sx + 0.5 * sx, T(3).abs() * sy + 0.5 * sy)
    pair = Pair.of_function(fn)
    what = run_calls(pair, make, len(QUADRANTS))
    e = pair.explain()
    assert what[-6:] == ["hit"] * 6, f"{what}\n{e}"
    assert "torch.where" in e.graphs[-1].code, e.graphs[-1].code
    assert {r.kind for r in e.fallbacks} <= {"assumption_failed"}, str(e)


class _Box:
    pass


def flip_writes_an_object_made_in_the_call(x):
    box = _Box()
    box.n = 0
    if x.sum() > 0:
        box.n = 1  # seen by the other side too if both ran on one object
        y = x * 2
    else:
        y = x * 3
    return y, box.n


def flip_advances_an_iterator(x, ts):
    it = iter(ts)
    if x.sum() > 0:
        a = next(it)
    else:
        a = next(it) * 2
    return a, list(it)


def flip_returns_its_argument(x):
    return x * 2 if x.sum() > 0 else x  # eager hands back `x` itself


@pytest.mark.parametrize("fn, make", [
    (flip_writes_an_object_made_in_the_call, lambda i: A(T(3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i])),
    (flip_advances_an_iterator, lambda i: A(T(3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i], [T(3), T(3)])),
    (flip_returns_its_argument, lambda i: A(T(3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i]))],
    ids=["object_attribute", "iterator", "argument_identity"])
def test_sides_sharing_state_or_returning_an_argument_are_not_merged(no_profiling, fn, make):
    pair = Pair.of_function(fn)
    run_calls(pair, make, len(FLIP_SIGNS))  # every call compared with eager
    e = pair.explain()
    assert {r.kind for r in e.fallbacks} == {"assumption_failed", "data_dependent_branch"}, str(e)
    record = next(r for r in e.fallbacks if r.kind == "data_dependent_branch")
    assert "cannot be merged" in record.explanation, record.explanation

# ---- a side that hands back a tensor it did not make: merged while nobody can tell

class ScaleDown(nn.Module):
    """The common pattern: the merged `x` is only read afterwards."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        if x.abs().max() > 10:  # scale
            x = x / 10
        return self.fc(x)


class ScaleDownNormed(nn.Module):
    """The merged `x` goes into an op that writes other tensors in place (running stats)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        if x.abs().max() > 10:  # scale
            x = x / 10
        return self.bn(x.view(3, 1))


def scale_down_then_reduce(x):
    h = x + 1
    y = h / 10 if h.abs().max() > 10 else h  # `h` was made before the branch
    return y.sum(0) * 2, h


MAGNITUDES = [20, 20, 1, 20, 1, 1, 20, 20, 1, 20, 1]


def _magnitude_args(i):
    return A(T(3).abs() * MAGNITUDES[i] + MAGNITUDES[i] / 2)


@pytest.mark.parametrize("make_pair", [lambda: module_pair(ScaleDown),
                                       lambda: module_pair(ScaleDownNormed),
                                       lambda: Pair.of_function(scale_down_then_reduce)],
                         ids=["module", "running_stats", "tensor_made_before"])
def test_a_side_handing_back_an_existing_tensor_merges_when_unobservable(no_profiling, make_pair):
    pair = make_pair()
    what = run_calls(pair, _magnitude_args, len(MAGNITUDES))
    e = pair.explain()
    assert {r.kind for r in e.fallbacks} == {"assumption_failed"}, str(e)
    merged_from = what.index("fallback") + 1  # the flip runs eagerly; then both sides are kept
    assert what[merged_from] == "capture" and what[merged_from + 1:] == ["hit"] * (
        len(MAGNITUDES) - merged_from - 1), f"{what}\n{e}"
    assert {MAGNITUDES[i] for i in range(merged_from + 1, len(MAGNITUDES))} == {1, 20}
    assert "torch.where" in e.graphs[-1].code, e.graphs[-1].code


def observing_aliases(fn):
    """``fn`` plus what a caller can see of its result's identity and memory: for every tensor
    of the result and the arguments (list items and object attributes included), the first
    such tensor that is the same object and the first one sharing its storage."""
    def run(*args):
        out = fn(*args)
        found: list = []
        _tensors((out, args), found)
        ids = [next(j for j, u in enumerate(found) if u is t) for t in found]
        storages = [next(j for j, u in enumerate(found) if _same_storage(u, t)) for t in found]
        return out, ids, storages
    return run


def _tensors(v, found: list) -> None:
    if isinstance(v, torch.Tensor):
        found.append(v)
    elif isinstance(v, (tuple, list)):
        for item in v:
            _tensors(item, found)
    elif isinstance(v, _Box):
        for item in vars(v).values():
            _tensors(item, found)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def merged_returns_a_view(x):
    y = x * 2 if x.sum() > 0 else x
    return y[1:]  # eager: a view of the argument


def merged_is_stored(x, box):
    y = x * 2 if x.sum() > 0 else x
    box.last = y  # eager: the argument itself
    return y.sum()


def merged_view_is_stored(x, box):
    y = x * 2 if x.sum() > 0 else x
    box.rows = [y.view(3, 1)]
    return y.sum()


def merged_is_written_in_place(x):
    y = x * 2 if x.sum() > 0 else x
    y.mul_(3)  # eager writes into the argument
    return y.sum()


def merged_view_is_written_in_place(x):
    y = x * 2 if x.sum() > 0 else x
    y[0] = 7.0
    return y.sum()


def merged_is_made_to_require_grad(x):
    y = x * 2 if x.sum() > 0 else x
    y.requires_grad_()  # eager flags the argument
    return y.detach() * 1


def argument_written_after_the_branch(x):
    y = x * 2 if x.sum() > 0 else x
    x.add_(1)  # eager's `y` sees this
    return y * 1


def merged_identity_is_compared(x):
    y = x * 2 if x.sum() > 0 else x
    return y * (2 if y is x else 3)


def earlier_tensor_written_after_the_branch(x):
    h = x + 1
    y = h if x.sum() > 0 else x * 2
    h.add_(1)  # eager's `y` may be `h`
    return y * 1


def merged_written_then_earlier_tensor_read(x):
    h = x + 1
    y = h if x.sum() > 0 else x * 2
    y.add_(1)  # eager may write into `h`
    return h * 1


def merged_and_earlier_tensor_returned(x):
    h = x + 1
    y = h if x.sum() > 0 else x * 2
    return y, h  # eager: `y is h` on one side


def one_tensor_in_two_merged_slots(x):
    if x.sum() > 0:
        t = x * 2
        a, b = t, t
    else:
        t = x * 3
        a, b = t, x * 4
    a.add_(1)  # eager: also `b` on the first side
    return b * 1


def sides_with_different_layouts(x):
    y = x.t() * 2 if x.sum() > 0 else x * 3  # strides (1, 3) or (3, 1)
    return y * (1 if y.is_contiguous() else 2)


def _signed(i):
    return A(T(3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i])


def _signed_box(i):
    return A(T(3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i], _Box())


@pytest.mark.parametrize("fn, make", [
    (merged_returns_a_view, _signed), (merged_is_stored, _signed_box),
    (merged_view_is_stored, _signed_box), (merged_is_written_in_place, _signed),
    (merged_view_is_written_in_place, _signed), (merged_is_made_to_require_grad, _signed),
    (argument_written_after_the_branch, _signed),
    (merged_identity_is_compared, _signed), (earlier_tensor_written_after_the_branch, _signed),
    (merged_written_then_earlier_tensor_read, _signed),
    (merged_and_earlier_tensor_returned, _signed), (one_tensor_in_two_merged_slots, _signed),
    (sides_with_different_layouts, lambda i: A(T(3, 3).abs() * FLIP_SIGNS[i] + FLIP_SIGNS[i]))],
    ids=lambda v: getattr(v, "__name__", ""))
def test_a_merged_tensor_that_could_be_seen_as_a_copy_runs_eagerly(no_profiling, fn, make):
    """Eager hands out one side's tensor itself; the select is a new one. Whatever shows the
    difference (returning it or a view, storing it, writing it or the tensor it may be in
    place, `is`, a layout the select does not have) makes the path run eagerly, equal to
    eager by identity and memory too."""
    opt = specularch.optimize(fn)
    pair = Pair(fn.__name__, observing_aliases(fn), observing_aliases(opt), opt)
    run_calls(pair, make, len(FLIP_SIGNS))  # every call compared with eager
    e = pair.explain()
    assert {r.kind for r in e.fallbacks} == {"assumption_failed", "data_dependent_branch"}, str(e)
    record = next(r for r in e.fallbacks if r.kind == "data_dependent_branch")
    assert "cannot be merged" in record.explanation, record.explanation


def noisy_flip(x):
    noise = torch.randn_like(x) * 0.01
    if x.sum() > 0:  # noisy
        return x * 2 + noise
    return x - 1 + noise


def test_failed_assumption_in_a_random_graph_does_not_advance_the_rng(no_profiling):
    """The discarded graph drew random numbers; the eager re-run draws them again. The harness
    compares the global RNG state (and the noise) with eager's after every call."""
    e = check(noisy_flip, lambda i: A(T(3).abs() * FLIP_SIGNS[i] + 0.5 * FLIP_SIGNS[i]), calls=len(FLIP_SIGNS))
    expect_fallback(e, "assumption_failed", lineno=marker_line(noisy_flip, "noisy"))


def test_flipping_branch_under_default_profiling_is_always_eager_equal():
    check(flip, lambda i: A(T(4).abs() * FLIP_SIGNS[i % len(FLIP_SIGNS)] + 0.1 * FLIP_SIGNS[i % len(FLIP_SIGNS)]),
          calls=12)


def loss_with_branch(pred, target):
    loss = (pred - target).square().mean()
    if loss > 1.0:  # loss
        loss = loss.sqrt()
    return loss


def test_branch_on_a_loss_value_is_checked_in_graph(no_profiling):
    # targets far away (loss > 1) on every call: one graph, the assumption holds every time
    e = check(loss_with_branch, lambda: A(T(4), T(4) + 10.0), calls=4, expect="graph")
    assert len(e.graphs) == 1 and e.stats.graph_hits == 3, str(e)


# =========================================================================== failed assumption after earlier writes

GLOBAL_DICT: dict = {}


class WritesThenBranches(nn.Module):
    """Writes to every kind of heap location, then branches on a tensor value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.steps = 0
        self.log = []
        self.table = {"seen": 0}
        self.last = None
        self.register_buffer("buf", torch.zeros(3))

    def forward(self, x, acc):
        self.steps += 1
        self.log.append(self.steps)
        self.table["seen"] = self.table["seen"] + 1
        self.table["last_sum"] = x.sum()
        GLOBAL_DICT["k"] = self.steps
        GLOBAL_DICT.setdefault("first", self.steps)
        self.buf.add_(1)
        acc.add_(x)
        self.last = x * 3
        y = self.fc(x) + self.buf
        if x.sum() > 0:  # flips
            return y * self.steps, acc * 2
        return y - self.steps, acc - 1


def _snapshot(module, acc) -> dict:
    """Everything the forward writes, deep-copied."""
    with torch.no_grad():
        return {
            "steps": module.steps,
            "log": list(module.log),
            "table": {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                      for k, v in module.table.items()},
            "last": None if module.last is None else module.last.detach().clone(),
            "buf": module.buf.clone(),
            "buf_id": id(module.buf),
            "GLOBAL_DICT": copy.deepcopy(GLOBAL_DICT),
            "acc": acc.clone(),
            "acc_id": id(acc),
            "params": [p.detach().clone() for p in module.parameters()],
        }


# enough positive calls for the graph to settle (the counters become inputs), then flips
WTB_SIGNS = [1, 1, 1, 1, 1, 1, 1, -1, 1, -1, 1]


def test_failed_assumption_after_earlier_writes_commits_nothing_before_the_eager_rerun(monkeypatch, no_profiling):
    torch.manual_seed(0)
    eager = WritesThenBranches()
    torch.manual_seed(0)
    opt = WritesThenBranches()
    specularch.optimize(opt)

    current = {}        # acc of the optimized call in progress
    at_fallback = []    # the heap when an eager (re-)run of the optimized module started
    original = specularch.frames.Target.call_original

    def spy(self, slots, cells):
        if slots and slots[0] is opt:
            at_fallback.append(_snapshot(opt, current["acc"]))
        return original(self, slots, cells)

    monkeypatch.setattr(specularch.frames.Target, "call_original", spy)

    before_call = []

    def opt_call(x, acc):
        current["acc"] = acc
        before_call.append(_snapshot(opt, acc))
        at_fallback.clear()
        return opt(x, acc)

    pair = Pair("WritesThenBranches", eager, opt_call, opt, eager_roots={"self": eager},
                opt_roots={"self": opt}, state=carried_globals(__name__, GLOBAL_DICT={}))

    def make_args(i):
        return A(T(3).abs() * WTB_SIGNS[i] + 0.1 * WTB_SIGNS[i], T(3))

    flip = WTB_SIGNS.index(-1)
    what = []
    for i in range(len(WTB_SIGNS)):
        # compares the result and, after the call, the module (steps, log, table, last, buf),
        # the caller's `acc` and GLOBAL_DICT with eager's
        what += run_calls(pair, make_args, 1)
        if i == flip:
            assert what[i - 1] == "hit", f"test premise: a graph with commits ran before the flip: {what}"
            assert what[i] == "fallback" and at_fallback, \
                f"the first flip must discard the graph's writes and run eagerly: {what}"
        for seen in at_fallback:  # the eager re-run started from exactly the state before the call
            assert_same(before_call[-1], seen, f"heap when the eager re-run of call #{i + 1} started")
        if what[i] != "fallback":
            assert not at_fallback

    e = specularch.explain(opt)
    expect_fallback(e, "assumption_failed", lineno=marker_line(WritesThenBranches, "flips"))
    assert e.stats.graph_hits >= 1, str(e)  # calls before the flip were graph hits with commits
    assert opt.steps == len(WTB_SIGNS) and int(opt.buf[0]) == len(WTB_SIGNS)


# =========================================================================== relaxation

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        b = x.shape[0]
        return self.fc(x).view(b, 2, 2).sum(-1)


BATCHES = [4, 3, 5, 7, 2, 6, 4, 9]


def test_varying_batch_size_settles_on_one_dynamic_graph(no_profiling):
    pair = module_pair(Head)
    what = run_calls(pair, lambda i: A(T(BATCHES[i], 8)), len(BATCHES))
    e = pair.explain()
    expect_graph(e, "Head")
    assert len(e.graphs) <= 2, f"{what}\n{e}"
    assert what[-3:] == ["hit"] * 3, f"{what}\n{e}"
    assert e.relaxations, str(e)
    # a readable line naming the argument and the dimension (0) that became dynamic
    assert any(re.search(r"L\['x'\].*\b0\b", r) and "dynamic" in r for r in e.relaxations), e.relaxations
    assert e.recompiles and any("L['x']" in reason for r in e.recompiles for reason in r.reasons), str(e)


def test_batch_size_that_varied_while_profiling_is_dynamic_in_the_first_graph():
    with specularch.config.patch(profile_calls=3):
        pair = module_pair(Head)
        what = run_calls(pair, lambda i: A(T(BATCHES[i], 8)), len(BATCHES))
    e = pair.explain()
    expect_graph(e, "Head")
    assert e.stats.profiled_calls == 3 and what[:3] == ["profiled"] * 3, what
    assert len(e.graphs) == 1 and e.recompiles == [], f"{what}\n{e}"
    assert what[3] == "capture" and what[4:] == ["hit"] * (len(BATCHES) - 4), f"{what}\n{e}"
    assert any("L['x']" in r and "profil" in r for r in e.relaxations), e.relaxations


class LoopOverTime(nn.Module):
    """Iterates over its input's first dimension, whose length varies between calls."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1], 4)
        outs = []
        for x_t in xs:
            h = self.cell(x_t, h)
            outs.append(h)
        return torch.stack(outs), xs.split(2), xs.unbind(1), [r.sum() for r in xs]


@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
def test_how_many_pieces_a_dynamic_size_gives_is_guarded(profile):
    """Iterating over, splitting or unbinding a tensor whose size was made dynamic: the count
    of pieces is fixed in each graph (one graph per length), never silently truncated."""
    lengths = [5, 6, 7, 5, 9, 3, 6, 2]
    with specularch.config.patch(profile_calls=profile):
        pair = module_pair(LoopOverTime)
        run_calls(pair, lambda i: A(T(lengths[i], 2, 3)), len(lengths))
    assert pair.explain().fallbacks == [], str(pair.explain())


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class SteeredBySize(nn.Module):
    def forward(self, x):
        h = torch.relu(x)
        if h.shape[0] > 3:  # the size of an intermediate tensor steers Python
            return h * 2
        return h - 1


def test_sizes_of_intermediate_tensors_that_steer_python_make_sizes_static_again():
    """A branch on the size of an intermediate tensor: with a dynamic batch that size is only
    known inside the graph, so the first size on the other side fails that assumption once;
    sizes are then static (one guarded graph per batch size, then hits)."""
    sizes = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5]
    with specularch.config.patch(profile_calls=3):
        pair = module_pair(SteeredBySize)
        what = run_calls(pair, lambda i: A(T(sizes[i], 5, 8)), len(sizes))
    e = pair.explain()
    assert e.stats.assumption_failures <= 1, f"{what}\n{e}"
    assert any("made static again" in r for r in e.relaxations), e.relaxations
    assert what[-3:] == ["hit"] * 3, f"{what}\n{e}"


def test_attention_with_a_dynamic_batch_is_one_graph():
    """nn.MultiheadAttention's forward returns a pair (output, weights): a fixed count, so it
    does not fix its inputs' sizes as split or chunk must; one graph for every batch size."""
    sizes = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5]
    with specularch.config.patch(profile_calls=3):
        pair = module_pair(Attention)
        what = run_calls(pair, lambda i: A(T(sizes[i], 5, 8)), len(sizes))
    e = pair.explain()
    assert what[3:] == ["capture"] + ["hit"] * 8, f"{what}\n{e}"
    assert e.stats.assumption_failures == 0 and len(e.graphs) == 1, f"{what}\n{e}"


def test_profiling_runs_eagerly_then_captures():
    def affine(x, w):
        return x @ w + 1

    with specularch.config.patch(profile_calls=2):
        pair = Pair.of_function(affine)
        what = run_calls(pair, lambda: A(T(3, 4), T(4, 2)), 4)
    e = pair.explain()
    assert what == ["profiled", "profiled", "capture", "hit"], f"{what}\n{e}"
    assert e.stats.profiled_calls == 2 and len(e.graphs) == 1, str(e)
    # nothing varied: the first graph is fully specialised and nothing was relaxed
    assert e.relaxations == [], e.relaxations


def scaled(x, scale):
    return x * scale + scale / 2


SCALES = [0.5, 1.5, 2.0, -3.0, 0.25, 4.0]


@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
def test_python_float_that_changes_every_call_becomes_a_graph_input(profile):
    with specularch.config.patch(profile_calls=profile):
        pair = Pair.of_function(scaled)
        what = run_calls(pair, lambda i: A(T(3), SCALES[i]), len(SCALES))
    e = pair.explain()
    expect_graph(e, "scaled")
    assert len(e.graphs) <= 2, f"{what}\n{e}"
    assert what[-2:] == ["hit", "hit"], f"{what}\n{e}"
    assert any("L['scale']" in r for r in e.relaxations), e.relaxations
    if profile:
        assert e.recompiles == [], str(e)  # it varied while profiling: an input from the start


def steps_times(x, n):
    return x * n - n


@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
def test_python_int_that_changes_every_call_becomes_a_graph_input(profile):
    with specularch.config.patch(profile_calls=profile):
        pair = Pair.of_function(steps_times)
        what = run_calls(pair, lambda i: A(T(3), [2, 5, 7, 11, 3, 8][i]), 6)
    e = pair.explain()
    expect_graph(e, "steps_times")
    assert len(e.graphs) <= 2 and what[-2:] == ["hit", "hit"], f"{what}\n{e}"
    assert any("L['n']" in r for r in e.relaxations), e.relaxations


# Relaxed values that steer Python control flow or become Python arithmetic: the decision must
# be guarded (or computed at run time), never baked in from the call that was captured.

def branch_on_scalar(x, scale):
    if scale > 1.0:
        return x * scale
    return x / scale


def loop_over_int(x, n):
    for _ in range(n):
        x = x * 0.5 + 1
    return x


def mean_by_hand(x):
    return x.sum(0) / x.shape[0], x.shape[0] * 2


def branch_on_batch(x):
    if x.shape[0] > 4:
        return x[:4].sum(0)
    return torch.cat([x, x.new_zeros(4 - x.shape[0], x.shape[1])]).sum(0) + 1


def shape_from_scalar(x, n):
    return x.new_ones(n, x.shape[1]) @ x.T, x.view(-1, n).sum(1) if x.numel() % n == 0 else x


SCALAR_ROUND = [0.5, 2.0, 1.5, 0.25, 3.0, 0.75, 1.0, 4.0, 0.5, 2.0]
INT_ROUND = [2, 3, 5, 2, 4, 1, 3, 6, 2, 5]
BATCH_ROUND = [4, 3, 5, 7, 2, 6, 4, 8, 1, 5]

# (program, make_args, most graphs expected: one per side of a guarded decision, or one per
# trip count of an unrolled loop)
RELAXED_CONTROL = [
    (branch_on_scalar, lambda i: A(T(3), SCALAR_ROUND[i]), 3),
    (loop_over_int, lambda i: A(T(3), INT_ROUND[i]), len(set(INT_ROUND))),
    (mean_by_hand, lambda i: A(T(BATCH_ROUND[i], 3)), 2),
    (branch_on_batch, lambda i: A(T(BATCH_ROUND[i], 3)), 3),
    (shape_from_scalar, lambda i: A(T(BATCH_ROUND[i], 6), [1, 2, 3, 6, 2, 3, 1, 6, 2, 3][i]), 3),
]


@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
@pytest.mark.parametrize("fn,make_args,most", RELAXED_CONTROL, ids=[p[0].__name__ for p in RELAXED_CONTROL])
def test_relaxed_values_that_steer_python_stay_exact(fn, make_args, most, profile):
    with specularch.config.patch(profile_calls=profile):
        e = check(fn, make_args, calls=10, expect="graph")
    assert len(e.graphs) <= most, str(e)
    assert e.relaxations, str(e)


class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.temperature = 1.0

    def forward(self, x):
        return torch.softmax(self.fc(x) / self.temperature, -1)


def test_module_number_attribute_changed_between_calls_becomes_an_input(no_profiling):
    temps = [1.0, 2.0, 0.5, 3.0, 1.5, 0.7, 2.5]
    e = check_module(Temperature, lambda: A(T(2, 3)), calls=len(temps), expect="graph",
                     between=lambda m, i: setattr(m, "temperature", temps[i]))
    assert len(e.graphs) <= 2, str(e)


def test_every_recompile_has_a_reason(no_profiling):
    pair = module_pair(Head)
    run_calls(pair, lambda i: A(T([4, 4, 3, 5][i], 8)), 4)
    e = pair.explain()
    assert e.stats.recompiles == len(e.recompiles) >= 1, str(e)
    for r in e.recompiles:
        assert r.reasons and all(isinstance(s, str) and s for s in r.reasons), str(e)
        assert "relax" in str(r), str(r)


# =========================================================================== while loops on tensor predicates

def newton_sqrt(a):
    x = a.clone()
    while (x * x - a).abs().max() > 1e-3:  # while
        x = 0.5 * (x + a / x)
    return x


def newton_trips(a) -> int:
    x, n = a.clone(), 0
    while (x * x - a).abs().max() > 1e-3:
        x, n = 0.5 * (x + a / x), n + 1
    return n


def newton_args(i):
    base = torch.tensor([4.0, 9.0, 2.0])
    return A(base + 0.01 * i)


def test_while_loop_on_tensor_predicate_with_a_stable_trip_count_runs_as_a_graph(no_profiling):
    trips = {newton_trips(newton_args(i)[0][0]) for i in range(4)}
    assert len(trips) == 1, f"test premise: the trip count should be stable, got {trips}"
    pair = Pair.of_function(newton_sqrt)
    what = run_calls(pair, newton_args, 4)
    e = pair.explain()
    expect_graph(e, "newton_sqrt")
    assert what == ["capture", "hit", "hit", "hit"], f"{what}\n{e}"

    far = A(torch.tensor([400.0, 900.0, 2.0]))
    assert newton_trips(far[0][0]) not in trips, "test premise: a different trip count"
    before = e.stats.recompiles
    what = run_calls(pair, lambda: far, 1)  # eager-equal (checked by the harness)
    e = pair.explain()
    kinds = {r.kind for r in e.fallbacks}
    assert kinds <= {"assumption_failed"}, str(e)
    assert kinds == {"assumption_failed"} or e.stats.recompiles > before, str(e)
    if kinds:
        expect_fallback(e, "assumption_failed", lineno=marker_line(newton_sqrt, "while"))
    # back to the usual inputs: still exact (graph, or eager now that the loop went both ways)
    run_calls(pair, newton_args, 3)


# =========================================================================== strict mode

def flagged(x, flag):
    return x + 1 if flag else x - 1


def test_strict_mode_makes_a_recompile_an_error(no_profiling):
    opt = specularch.optimize(flagged)
    opt(torch.ones(2), True)
    with specularch.config.patch(strict=True):
        opt(torch.ones(2), True)  # a graph hit is fine
        with pytest.raises(specularch.SpecularchStrictError, match="recompile") as info:
            opt(torch.ones(2), False)
    assert "flag" in str(info.value), str(info.value)  # names the reason (the guard on L['flag'])


def test_strict_mode_makes_a_relaxation_recompile_an_error(no_profiling):
    opt = specularch.optimize(Head())
    with torch.no_grad():
        opt(torch.randn(4, 8))
        with specularch.config.patch(strict=True):
            with pytest.raises(specularch.SpecularchStrictError, match="recompile") as info:
                opt(torch.randn(3, 8))
    assert "L['x']" in str(info.value), str(info.value)


def test_strict_mode_makes_a_failed_assumption_an_error_and_commits_nothing(no_profiling):
    opt = WritesThenBranches()
    specularch.optimize(opt)
    GLOBAL_DICT.clear()
    for _ in range(7):  # capture, relax the counters, then graph hits: no recompile pending
        hits = specularch.explain(opt).stats.graph_hits
        opt(torch.ones(3), torch.zeros(3))
    assert specularch.explain(opt).stats.graph_hits == hits + 1, str(specularch.explain(opt))
    acc = torch.zeros(3)
    before = _snapshot(opt, acc)
    with specularch.config.patch(strict=True), pytest.raises(specularch.SpecularchStrictError,
                                                             match="assumption_failed"):
        opt(-torch.ones(3), acc)
    assert_same(before, _snapshot(opt, acc), "heap after a strict-mode failed assumption")


def test_strict_mode_makes_a_fallback_an_error(no_profiling):
    def prints(x):
        print(x.sum())
        return x

    opt = specularch.optimize(prints)
    with specularch.config.patch(strict=True), pytest.raises(specularch.SpecularchStrictError,
                                                             match="data_dependent_value"):
        opt(torch.ones(2))


def test_strict_and_profile_calls_from_the_environment(tmp_path):
    script = tmp_path / "strict_env.py"
    script.write_text(textwrap.dedent("""
        import torch, specularch
        assert specularch.config.strict is True and specularch.config.profile_calls == 1
        def f(x, flag):
            return x + 1 if flag else x - 1
        g = specularch.optimize(f)
        g(torch.ones(2), True)            # profiled
        g(torch.ones(2), True)            # captured
        assert specularch.explain(g).stats.profiled_calls == 1
        try:
            g(torch.ones(2), False)
        except specularch.SpecularchStrictError as e:
            print("STRICT", "recompile" in str(e))
    """))
    env = dict(os.environ, SPECULARCH_STRICT="1", SPECULARCH_PROFILE_CALLS="1")
    env.pop("SPECULARCH", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "STRICT True" in out.stdout, out.stdout + out.stderr


# =========================================================================== SGD under no_grad

def sgd_step(model, lr):
    with torch.no_grad():
        for p in (model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias):
            p -= lr * p.grad
    return lr


def sgd_step_over_parameters(model, lr):
    # `model.parameters()` is a generator: a graph or a `generator` fallback, but always exact
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return lr


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


LRS = [0.1, 0.1, 0.05, 0.05, 0.025, 0.0125, 0.1]


def _sgd_pair(step_fn):
    torch.manual_seed(0)
    m_eager = TinyNet()
    torch.manual_seed(0)
    m_opt = TinyNet()
    opt_step = specularch.optimize(step_fn)

    def step(model, stepper):
        def call(x, y, lr):
            model.zero_grad()
            (model(x) - y).square().mean().backward()  # gradients outside the optimized function
            return stepper(model, lr)
        return call

    return Pair(step_fn.__name__, step(m_eager, step_fn), step(m_opt, opt_step), opt_step,
                eager_roots={"model": m_eager}, opt_roots={"model": m_opt})


@pytest.mark.parametrize("profile", [0, 3], ids=["capture_first_call", "default_profiling"])
def test_parameters_updated_under_no_grad_inside_the_optimized_function(profile):
    with specularch.config.patch(profile_calls=profile):
        pair = _sgd_pair(sgd_step)
        m_opt = pair.opt_roots["model"]
        ids = [id(p) for p in m_opt.parameters()]
        what = run_calls(pair, lambda i: A(T(5, 3), T(5, 2), LRS[i]), len(LRS))
    e = pair.explain()
    expect_graph(e, "sgd_step")
    assert "fallback" not in what and what[-1] == "hit", f"{what}\n{e}"
    assert len(e.graphs) <= 2, f"{what}\n{e}"  # the learning rate becomes an input
    assert [id(p) for p in m_opt.parameters()] == ids
    assert all(p.is_leaf and p.requires_grad for p in m_opt.parameters())
    # the parameters really moved (the test is not vacuous)
    torch.manual_seed(0)
    assert not torch.equal(TinyNet().fc1.weight, m_opt.fc1.weight)


def test_sgd_step_iterating_model_parameters_is_exact(no_profiling):
    pair = _sgd_pair(sgd_step_over_parameters)
    run_calls(pair, lambda i: A(T(5, 3), T(5, 2), LRS[i]), len(LRS))


class MomentumSGD:
    """A hand-written optimizer: momentum buffers created on the first step (list appends),
    then updated in place (tensors that outlive the call, reached through a list attribute)."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        self.params = list(params)
        self.lr, self.momentum = lr, momentum
        self.bufs = []
        self.steps = 0

    def step(self):
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if len(self.bufs) <= i:
                    self.bufs.append(p.grad.clone())
                else:
                    self.bufs[i].mul_(self.momentum).add_(p.grad)
                p.add_(self.bufs[i], alpha=-self.lr)
        self.steps += 1
        return self.steps


def test_hand_written_momentum_optimizer_step(no_profiling):
    torch.manual_seed(0)
    m_eager = TinyNet()
    torch.manual_seed(0)
    m_opt = TinyNet()
    o_eager, o_opt = MomentumSGD(m_eager.parameters()), MomentumSGD(m_opt.parameters())
    fast_step = specularch.optimize(o_opt.step)

    def step(model, stepper):
        def call(x, y):
            model.zero_grad()
            (model(x) - y).square().mean().backward()
            return stepper()
        return call

    pair = Pair("MomentumSGD.step", step(m_eager, o_eager.step), step(m_opt, fast_step), fast_step,
                eager_roots={"model": m_eager, "optimizer": o_eager},
                opt_roots={"model": m_opt, "optimizer": o_opt})
    buf_ids = None
    what = []
    for i in range(6):
        what += run_calls(pair, lambda: A(T(5, 3), T(5, 2)), 1)
        if i == 0:
            buf_ids = [id(b) for b in o_opt.bufs]
    e = pair.explain()
    expect_graph(e, "MomentumSGD.step")
    assert what[-1] == "hit" and len(e.graphs) <= 2, f"{what}\n{e}"
    assert [id(b) for b in o_opt.bufs] == buf_ids  # momentum buffers updated in place
