"""Tests of ``.item()`` values speculated like branches on tensor values
(``symbolic/speculation/item_args.speculated``): ``if tok.item() == EOS: break``,
``if loss.item() > limit``, ``if flag.item():`` take the direction they have at capture, the
graph computes the same Python test on the same number and the entry checks it before
committing; a call where it flips runs the original (nothing written), and the site is no
longer speculated. Every check is differential (``differential.check``)."""
import torch
from torch import nn

from differential import A, T, check, check_module, marker_line

EOS = 3
LIMIT = 100.0


def rarely_huge(x):
    loss = (x * x).sum()
    if loss.item() > LIMIT:  # test
        return loss * 0  # skip the step
    return loss


def test_a_test_that_holds_is_one_graph_and_one_that_flips_is_merged():
    """The flip runs eagerly once; the next capture takes both sides (two returns, no side
    effects) and selects with torch.where, so calls either way are graph hits again."""
    report = check(rarely_huge, lambda i: A(T(4) * (10 if i in (9, 12) else 1)), calls=16)
    assert report.stats.graph_hits == 16 - 3 - 2 - 1, report  # (profiled, captures, the flip)
    (failed,) = [f for f in report.fallbacks if f.kind == "assumption_failed"]
    assert failed.lineno == marker_line(rarely_huge, "test")
    assert "assumed this test on a `.item()` value is False, but it was True" in failed.explanation
    assert "torch.where" in failed.hint
    assert len(report.fallbacks) == 1 and "torch.where(" in report.graphs[-1].code, report


LOG = []


def logs_when_positive(v, x):
    if v.sum().item() > 0:  # logs
        LOG.append(1)
        return x * 2
    return x - 1


def test_a_flipped_test_whose_side_writes_state_runs_eagerly_and_says_why():
    LOG.clear()
    report = check(logs_when_positive, lambda i: A(T(3) + (5 if i % 2 else -5), T(2)), calls=8,
                   expect="fallback", fallback_kind="data_dependent_branch",
                   fallback_line=marker_line(logs_when_positive, "logs"))
    (record,) = [f for f in report.fallbacks if f.kind == "data_dependent_branch"]
    assert "both directions of this test on a `.item()` value" in record.explanation
    assert "a side writes state that outlives the call" in record.explanation


def truthy(flags, x):
    if flags[0].item():
        return x + 1
    return x - 1


def two_items(a, b):
    if a.max().item() < b.max().item():
        return a
    return b


def test_truth_and_two_item_values_are_speculated():
    report = check(truthy, lambda: A(torch.tensor([True, False]), T(2)), calls=6, expect="graph")
    assert report.stats.graph_hits == 2
    check(two_items, lambda i: A(T(3) + i, T(3) + 2 * i), calls=8, expect="graph")


def decode(x, steps):
    inp = torch.tensor(0)
    total = x.sum() * 0
    for _ in range(steps):
        scores = x[inp] * 2
        inp = scores.argmax()
        total = total + scores.sum()
        if inp.item() == EOS:  # break
            break
    return total, inp


def test_an_early_break_on_a_predicted_token_in_a_loop():
    """Tokens that never reach EOS: every call a graph (the loop over a varying number of
    steps, the test checked at each one); then a table that reaches EOS: eager's result."""
    table = torch.eye(5)[[1, 2, 0, 4, 1]]  # 0 -> 1 -> 2 -> 0 ...: never 3
    report = check(decode, lambda i: A(table.clone(), 3 + i % 3), calls=10, expect="graph")
    assert report.stats.graph_hits >= 4
    to_eos = torch.eye(5)[[1, 3, 0, 4, 1]]  # 0 -> 1 -> 3
    check(decode, lambda i: A(table.clone() if i < 6 else to_eos.clone(), 4), calls=9)


class Counter(nn.Module):
    """A test's outcome stored on the module, not branched on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.positive = []

    def forward(self, x):
        y = self.fc(x)
        self.positive.append(y.sum().item() > 0)
        return y


def test_an_outcome_stored_is_eager_s():
    check_module(Counter, lambda: A(T(2, 3)), calls=10)  # flips: some calls run eagerly


def guarded_division(v, x):
    if v.item() != 0 and 1.0 / v.item() > 0.5:  # guard
        return x * 2
    return x


def flag_is_true(flag, x):
    if flag.item() is True:
        return x + 1
    return x - 1


def test_a_graph_that_raises_past_a_flipped_test_is_that_test_s_failure():
    """``v != 0`` held at capture; where it flips, the graph raises in the division eager
    never reaches: the call runs eagerly and the record is the test's failure (with its own
    hint), not a backend error."""
    report = check(guarded_division, lambda i: A(torch.tensor(0.0 if i >= 6 else 1.0), T(2)),
                   calls=9, expect="fallback", fallback_kind="assumption_failed",
                   fallback_line=marker_line(guarded_division, "guard"))
    (failed,) = [f for f in report.fallbacks if f.kind == "assumption_failed"]
    assert "the graph raised on the path it assumed" in failed.explanation
    assert "its path runs eagerly" in failed.hint
    assert not [f for f in report.fallbacks if f.kind == "backend_error"], report


def test_identity_of_an_item_is_eager_s():
    check(flag_is_true, lambda i: A(torch.tensor(i < 5), T(2)), calls=8)
    check(lambda a, b: a.item() is b.item(), lambda: A(torch.tensor(1), torch.tensor(1)), calls=4)


def validated(x):
    if x.min().item() < 0:  # validation
        raise ValueError("x must be non-negative")
    return x.sqrt()


def test_a_validation_test_is_speculated_again_after_a_call_that_fails_it():
    """Like a tensor branch whose side raises (raising_branch.py): one invalid call raises
    eager's error, the valid calls after it run a graph again."""
    report = check(validated, lambda i: A(T(3).abs() * (-1 if i == 4 else 1)), calls=12)
    assert report.stats.graph_hits >= 6, report
    assert not [f for f in report.fallbacks if f.kind == "data_dependent_value"], report


def member(t, x):
    if t.item() not in (1, 2.5):
        return x + 1
    return x - 1


def test_membership_in_a_constant_tuple_is_speculated():
    report = check(member, lambda i: A(torch.tensor(1 if i < 6 else 3), T(2)), calls=9)
    assert report.stats.graph_hits >= 2 and report.stats.assumption_failures == 1, report


STOP_IDS = [2, 5]


class Stopper(nn.Module):
    """Stop tokens in a list attribute and a global list: ``tok.item() in self.stop_ids``."""

    def __init__(self):
        super().__init__()
        self.stop_ids = [3, 7]

    def forward(self, t, x):
        if t.item() in self.stop_ids:
            x = x + 1
        else:
            x = x * 2
        if t.argmax().item() not in STOP_IDS:
            return x * 3
        return x - 1


def test_membership_in_a_list_of_the_program_is_speculated_then_merged_and_guarded():
    """Speculated against the list's items (guarded like any read of them); once it flips,
    merged like a comparison; the lists changed between calls recapture, with eager's
    answer every call."""
    def between(m, i):
        if i == 9:
            m.stop_ids.append(4)
        if i == 11:
            STOP_IDS.append(1)
    STOP_IDS[:] = [2, 5]
    try:
        report = check_module(Stopper, lambda i: A(torch.tensor(i % 4 + 1), T(2)), calls=14,
                              between=between)
    finally:
        STOP_IDS[:] = [2, 5]
    assert report.stats.assumption_failures == 1 and len(report.fallbacks) == 1, report
    assert report.stats.graph_hits >= 6 and "torch.where(" in report.graphs[-1].code, report


class SetStopper(nn.Module):
    def __init__(self):
        super().__init__()
        self.stop_set, self.skip = {3, 7}, frozenset({1.5})

    def forward(self, t, x):
        if t.item() in self.skip:
            return x
        if t.item() in self.stop_set:
            return x + 1
        return x * 2


def test_membership_in_a_set_of_the_program_is_guarded_on_its_contents():
    """A set attribute: speculated against its members, the entry guarded on the set being
    equal to what it was (a member added between calls recaptures; eager's answer always)."""
    def between(m, i):
        if i == 8:
            m.stop_set.add(4)
        if i == 11:
            m.stop_set.discard(3)
    report = check_module(SetStopper, lambda i: A(torch.tensor(i % 4 + 3), T(2)), calls=14,
                          between=between)
    assert report.stats.graph_hits >= 5 and report.stats.recompiles >= 2, report


def safe_pick(idx, x):
    if idx.item() < 4:
        return x[idx] * 2
    return x.sum()


def test_a_merged_test_whose_other_side_raises_returns_eager_s_result():
    """Merged, both sides run in the graph: ``x[idx]`` raises for an index the test keeps
    eager away from; the call returns eager's result (the other side's), recorded as the
    branch's side, not as an assumption that failed."""
    report = check(safe_pick, lambda i: A(torch.tensor(1 if i % 3 else 9), T(4)), calls=12)
    assert report.stats.assumption_failures == 1, report
    assert [f.kind for f in report.fallbacks].count("assumption_failed") == 1, report
    (side,) = [f for f in report.fallbacks if f.kind == "data_dependent_branch"]
    assert "the side this call does not take raised IndexError" in side.explanation
    assert side.explanation.startswith("the test on a `.item()` value at "), side


def flagged(flag, x):
    if flag.item():
        y = x * 2
    else:
        y = x - 1
    return y + 1


def test_a_truth_test_that_flipped_is_merged_too():
    report = check(flagged, lambda i: A(torch.tensor(i < 6 or i % 2 == 0), T(2)), calls=14)
    assert report.stats.assumption_failures == 1 and len(report.fallbacks) == 1, report
    assert "torch.where(" in report.graphs[-1].code, report


def nested(a, b, x):
    if a.item() > 0:
        if b.item() > 0:
            y = x * 2
        else:
            y = x * 3
    else:
        y = x - 1
    return y + 1


def test_a_test_inside_a_merged_side_is_merged_too():
    report = check(nested, lambda i: A(T(()) if i > 5 else torch.tensor(1.0), T(()), T(2)),
                   calls=24)
    assert not [f for f in report.fallbacks if f.kind != "assumption_failed"], report
    assert report.graphs[-1].code.count("torch.where(") == 2, report


def test_membership_in_a_set_holding_nan_is_not_speculated():
    """A NaN member makes a set unequal to a copy holding another NaN: guarded on its
    contents, such a set would capture again on every call; it is not speculated (``in``
    on it falls back, eager's answer)."""
    from specularch.guards.sources import GlobalSource
    from specularch.symbolic.speculation import item_args
    from specularch.symbolic.values import ObjV

    class Tracer:
        def add_guard(self, *args):
            added.append(args)
    added = []
    assert item_args.members(Tracer(), ObjV({3, 7}, GlobalSource("S"))).value in ((3, 7), (7, 3))
    assert item_args.members(Tracer(), ObjV({3, float("nan")}, GlobalSource("S"))) is None
    assert len(added) == 1
