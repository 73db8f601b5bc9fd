"""The shadow heap, one kind of write at a time, differential against eager including the heap.

Writes that outlive the call are deferred and committed in program order after every guard and
assertion passed: attribute assignments and ``+=`` on attributes, ``global`` and ``nonlocal``
assignments, item writes and ``del`` on lists and dicts that existed before the call,
``list.append/extend/pop/insert``, ``dict.update/setdefault/pop``, and in-place tensor ops on
tensors that outlive the frame (arguments, buffers, tensors inside argument lists), which keep
their identity. Reads later in the same call see the new values. These programs run as graphs
(no fallback) and leave the heap exactly as eager leaves it; programs whose writes are followed
by a failing assumption or a ``raise`` leave it exactly as eager too (nothing applied twice).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import specularch
from differential import A, Pair, T, check, check_module, expect_fallback, expect_graph, marker_line
from speculation_helpers import carried_globals, run_calls

pytestmark = pytest.mark.usefixtures("no_profiling")


class Box:
    def __init__(self, count=0):
        self.count = count
        self.items = []
        self.last = None


# --------------------------------------------------------------------------- lists and dicts passed in

def list_methods(x, lst):
    lst.append(x)
    lst.extend([x * 2, x * 3])
    first = lst.pop(0)
    lst.insert(1, x + 1)
    lst[0] = lst[0] - 1
    del lst[-1]
    last = lst.pop()
    return first + last + lst[-1], len(lst)


def dict_methods(x, d):
    d.update({"a": x, "b": 2})
    v = d.setdefault("c", x * 2)
    w = d.setdefault("b", 100)
    old = d.pop("old")
    missing = d.pop("missing", 7)
    del d["gone"]
    d["new"] = v + old
    return d["a"] + v * w + missing, sorted(d)


def object_attributes(x, obj):
    obj.count += 1
    obj.last = x * 2
    obj.items.append(obj.count)
    obj.fresh = obj.last + 1
    return x * obj.count + obj.fresh


def tensor_in_a_list(x, lst):
    lst[0].add_(x)
    lst[1].mul_(2)
    return lst[0] + lst[1]


def returns_the_mutated_list(x, lst):
    lst.append(x * 2)
    return lst


PROGRAMS = [
    (list_methods, lambda: A(T(3), [T(3), T(3)])),
    (dict_methods, lambda: A(T(3), {"old": T(3), "gone": 1, "keep": "k"})),
    (object_attributes, lambda: A(T(2), Box(3))),
    (tensor_in_a_list, lambda: A(T(3), [T(3), T(3)])),
    (returns_the_mutated_list, lambda: A(T(2), [T(2)])),
]


@pytest.mark.parametrize("fn,make_args", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_writes_to_arguments_run_as_graphs_and_match_eager(fn, make_args):
    check(fn, make_args, calls=4, expect="graph")


# --------------------------------------------------------------------------- tensors passed in

def add_inplace_and_read(x):
    x.add_(1)
    return x.sum(), x * 2


def setitem_on_argument(x, v):
    x[0] = 5
    x[1] = v
    return x.sum()


def copy_into_argument(x, y):
    x.copy_(y * 2)
    return x + y


def returns_the_argument_after_inplace(x):
    x.mul_(3).add_(1)
    return x


def aliased_arguments(a, b):
    a.add_(1)          # b is the same tensor: it sees the write
    return b * 2


def aliased_in_a_list(x, lst):
    lst.append(x)
    lst[0].mul_(2)     # lst[0] may be x itself when the list was passed in holding it
    return x + 1


TENSOR_PROGRAMS = [
    (add_inplace_and_read, lambda: A(T(3))),
    (setitem_on_argument, lambda: A(T(4), T(()))),
    (copy_into_argument, lambda: A(T(3), T(3))),
    (returns_the_argument_after_inplace, lambda: A(T(2, 2))),
    (aliased_arguments, lambda: (lambda t: A(t, t))(T(3))),
]


@pytest.mark.parametrize("fn,make_args", TENSOR_PROGRAMS, ids=[p[0].__name__ for p in TENSOR_PROGRAMS])
def test_inplace_writes_to_caller_tensors_keep_their_identity(fn, make_args):
    """The harness compares the arguments after the call and checks that a returned argument
    is the caller's object itself; this also checks the storage was written, not replaced."""
    check(fn, make_args, calls=4, expect="graph")


def test_aliasing_through_a_list_matches_eager():
    # correctness only: the alias is created inside the call
    check(aliased_in_a_list, lambda: (lambda t: A(t, [t]))(T(3)), calls=3)


def test_caller_tensor_storage_is_written_not_replaced():
    opt = specularch.optimize(add_inplace_and_read)
    for _ in range(4):
        x = torch.zeros(3)
        ptr = x.data_ptr()
        version = x._version
        opt(x)
        assert torch.equal(x, torch.ones(3)) and x.data_ptr() == ptr and x._version > version
    expect_graph(specularch.explain(opt), "add_inplace_and_read")


def inplace_on_leaf_requiring_grad(w):
    w.add_(1)  # eager raises: a leaf that requires grad used in an in-place operation
    return w


def test_inplace_on_a_leaf_that_requires_grad_raises_like_eager():
    check(inplace_on_leaf_requiring_grad, lambda: A(T(3, requires_grad=True)), calls=2)


# --------------------------------------------------------------------------- globals and nonlocals

_TOTAL = 0.0
_SEEN = 0
REGISTRY: dict = {}
QUEUE: list = []


def rebinds_globals(x, key):
    global _TOTAL, _SEEN
    _SEEN = _SEEN + 1
    _TOTAL = _TOTAL + x.sum()        # a global rebound to a tensor
    REGISTRY[key] = _SEEN
    if key != "a" and "a" in REGISTRY:
        del REGISTRY["a"]
    QUEUE.append(key)
    if len(QUEUE) > 2:
        QUEUE.pop(0)
    return x * _SEEN + _TOTAL


GLOBAL_KEYS = ["a", "b", "a", "b", "c", "a", "a", "b"]


def test_global_rebinding_dict_del_and_list_pop_carry_over_calls():
    state = carried_globals(__name__, _TOTAL=0.0, _SEEN=0, REGISTRY={}, QUEUE=[])
    pair = Pair.of_function(rebinds_globals, state=state)
    what = run_calls(pair, lambda i: A(T(3), GLOBAL_KEYS[i]), len(GLOBAL_KEYS))
    e = pair.explain()
    assert e.fallbacks == [], f"{what}\n{e}"
    assert _SEEN == len(GLOBAL_KEYS) and list(QUEUE) == GLOBAL_KEYS[-2:]


def make_accumulator():
    acc = None
    calls = 0
    history = []

    def add(x):
        nonlocal acc, calls
        calls += 1
        acc = x.clone() if acc is None else acc + x
        history.append(calls)
        return acc * calls

    return add


def test_nonlocal_tensor_accumulator_and_counter():
    eager_fn, opt_fn = make_accumulator(), make_accumulator()
    opt = specularch.optimize(opt_fn)
    pair = Pair("make_accumulator.<locals>.add", eager_fn, opt, opt)
    what = run_calls(pair, lambda: A(T(3)), 8)
    e = pair.explain()
    assert e.fallbacks == [], f"{what}\n{e}"
    assert what[-1] == "hit", f"{what}\n{e}"
    cells_e = {n: c.cell_contents for n, c in zip(eager_fn.__code__.co_freevars, eager_fn.__closure__)}
    cells_o = {n: c.cell_contents for n, c in zip(opt_fn.__code__.co_freevars, opt_fn.__closure__)}
    assert cells_o["calls"] == cells_e["calls"] == 8 and cells_o["history"] == cells_e["history"]
    assert torch.equal(cells_o["acc"], cells_e["acc"])


# --------------------------------------------------------------------------- module state

class EMATracker(nn.Module):
    """Buffers updated in place (exponential moving average, a call counter), a Python counter
    with ``+=``, a tensor attribute rebound every call, a list and a dict attribute."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.steps = 0
        self.prev = None
        self.norms = []
        self.by_parity = {}

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
        self.calls += 1
        self.steps += 1
        delta = y if self.prev is None else y - self.prev
        self.prev = y.detach()
        self.norms.append(delta.norm().detach())
        self.by_parity[self.steps % 2] = self.steps
        return delta + self.ema * self.calls


def test_module_buffers_and_attributes_match_eager_after_every_call():
    def make_args():
        return A(T(3, 4))

    e = check_module(EMATracker, make_args, calls=8, expect="graph")
    assert len(e.graphs) <= 3, str(e)


def test_module_buffer_identity_is_preserved():
    m = specularch.optimize(EMATracker())
    ids = {n: id(b) for n, b in m.named_buffers()}
    for _ in range(5):
        m(torch.randn(3, 4))
    assert {n: id(b) for n, b in m.named_buffers()} == ids
    assert int(m.calls) == 5 and m.steps == 5 and len(m.norms) == 5


STATS: dict = {}


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.hits = 0

    def forward(self, x):
        self.hits += 1
        return self.lin(x)


class Housekeeping(nn.Module):
    """Writes made inside inlined helpers and submodules, on a plain tensor attribute, on a
    tensor held in a global dict, and dict ``pop``/``del`` / list ``insert``/``pop`` on
    attributes, all carried over calls."""

    def __init__(self):
        super().__init__()
        self.sub = Counter()
        self.acc = torch.zeros(3)          # a plain tensor attribute, not a buffer
        self.window = [0, 0]
        self.pending = {"start": 1}
        self.ticks = 0

    def _bump(self, by):
        self.ticks += by
        self.window.insert(0, self.ticks)
        self.window.pop()
        return self.ticks

    def forward(self, x):
        y = self.sub(x)
        t = self._bump(2)
        self.acc.add_(y.detach().sum(0))
        STATS["sum"].add_(x.sum())
        if "start" in self.pending:
            del self.pending["start"]
        self.pending[t % 3] = x.sum()
        self.pending.pop((t + 1) % 3, None)
        return y * t + self.acc + STATS["sum"], list(self.window)


def test_writes_in_inlined_helpers_submodules_and_global_tensors():
    state = carried_globals(__name__, STATS={"sum": torch.zeros(())})
    pair = Pair.of_module(Housekeeping, state=state)
    what = run_calls(pair, lambda: A(T(2, 3)), 14)
    e = pair.explain()
    assert e.fallbacks == [], f"{what}\n{e}"
    assert pair.opt.sub.hits == 14 and pair.opt.ticks == 28
    # the dict's key set cycles through 3 states: once each has a graph, calls are hits
    assert what[-3:] == ["hit"] * 3, f"{what}\n{e}"


class SharedList(nn.Module):
    """Two attributes name the same list: a write through one is seen through the other."""

    def __init__(self):
        super().__init__()
        self.a = []
        self.b = self.a
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x):
        self.a.append(1)
        return x * self.w * len(self.b)


def test_write_through_one_name_is_seen_through_an_alias():
    check_module(SharedList, lambda: A(T(2)), calls=4)


# --------------------------------------------------------------------------- writes, then no commit

class BNThenBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.seen = []

    def forward(self, x):
        y = self.bn(x)                 # running stats and num_batches_tracked: deferred writes
        self.seen.append(y.shape[0])
        if x.mean() > 0:  # branch
            return y * 2
        return y - 1


BN_SIGNS = [1, 1, 1, -1, 1, -1, -1, 1]


def test_batchnorm_stats_are_not_updated_twice_when_an_assumption_fails():
    e = check_module(BNThenBranch, lambda i: A(T(4, 3).abs() * BN_SIGNS[i] + 0.2 * BN_SIGNS[i]),
                     calls=len(BN_SIGNS))
    expect_fallback(e, "assumption_failed", lineno=marker_line(BNThenBranch, "branch"))
    assert e.stats.graph_hits >= 1, str(e)


def writes_then_raises(x, lst, d, box, n):
    lst.append(n)
    d["n"] = n
    box.count += 1
    x.add_(1)
    if n < 0:
        raise ValueError(f"negative: {n}")  # raise
    return x * n


def test_writes_before_a_raise_happen_exactly_once():
    """Eager performs the writes and then raises; the optimized call must too (once, not twice:
    nothing was committed before the original Python re-ran)."""
    e = check(writes_then_raises, lambda i: A(T(3), [0], {}, Box(), [2, 3, -1, 4, -2][i]), calls=5)
    assert e.stats.graph_hits >= 1, str(e)


# --------------------------------------------------------------------------- aliasing
# The deferred writes assume that what they write is reached only through the sources that
# reached it at capture. Each program below is first captured with distinct objects, then
# called with aliased ones (and back): every call must equal eager, on twins of all state.

SHARED = {"k": 1}


def bump_then_read_the_global(d, x):
    d["k"] = d["k"] + 1
    return x * SHARED["k"]


def bump_one_read_other(p, q, x):
    p.count += 1
    return x * q.count


def write_one_read_other(a, b):
    a.add_(1)
    return b * 2


def _twin_calls(fn, make_state, pick_args, calls=6):
    """Run ``fn`` eagerly and optimized on twin states; ``pick_args(state, i)`` picks the
    arguments (aliased or not) from a state. Returns the optimized function's explanation."""
    opt = specularch.optimize(fn)
    eager_state, opt_state = make_state(), make_state()
    for i in range(calls):
        expected = fn(*pick_args(eager_state, i))
        got = opt(*pick_args(opt_state, i))
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"call {i}")
        for e_item, o_item in zip(eager_state, opt_state):
            if isinstance(e_item, torch.Tensor):
                assert torch.equal(e_item, o_item), f"call {i}: state {e_item} vs {o_item}"
            elif isinstance(e_item, Box):
                assert e_item.count == o_item.count, f"call {i}"
            else:
                assert e_item == o_item, f"call {i}: {e_item} vs {o_item}"
    return specularch.explain(opt)


def test_a_written_dict_that_becomes_the_global_it_reads():
    global SHARED

    def make_state():
        return [{"k": 1}, {"k": 1}, {"k": 5}]

    def pick(state, i):  # state[2] plays SHARED: the global is swapped per side
        global SHARED
        SHARED = state[2]
        return (state[2] if i in (2, 3) else state[i % 2], torch.ones(2))

    saved = SHARED
    try:
        e = _twin_calls(bump_then_read_the_global, make_state, pick)
    finally:
        SHARED = saved
    guards = [g for graph in e.graphs for g in graph.guards]
    assert any("not the same object as" in g and "G['SHARED']" in g for g in guards), str(e)


def test_the_same_object_passed_twice_after_distinct_ones():
    e = _twin_calls(bump_one_read_other, lambda: [Box(), Box(10)],
                    lambda s, i: (s[0], s[0] if i >= 2 else s[1], torch.ones(2)))
    guards = [g for graph in e.graphs for g in graph.guards]
    assert any(g.startswith("L['q'] is L['p']") for g in guards), str(e)  # the aliased graph


def test_a_written_tensor_whose_view_is_also_an_argument():
    e = _twin_calls(write_one_read_other, lambda: [torch.zeros(2, 3), torch.zeros(3)],
                    lambda s, i: (s[0], s[0][0] if i >= 2 else s[1]))
    assert e.graphs and any("aliasing changed" in str(r) for r in e.recompiles), str(e)
    assert {f.kind for f in e.fallbacks} == {"input_mutation"}, str(e)


class ViewAttributes(nn.Module):
    """``b`` is a view of ``a`` made before any call: a write to ``a`` must be seen in ``b``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.zeros(2))
        self.b = self.a.view(2)

    def forward(self, x):
        self.a.add_(x)
        return self.b + 0


def test_a_pre_existing_view_of_a_written_buffer():
    e = check_module(ViewAttributes, lambda: A(T(2)), calls=4)
    expect_fallback(e, "input_mutation")


def counts_and_accumulates(box, x, acc):
    box.count += 1
    acc.add_(x)
    return x * 2


def accumulates_in_inference_mode(x, acc):
    with torch.inference_mode():
        acc.add_(x)
    return x * 2


def test_an_inference_tensor_written_inside_an_inference_block():
    """Eager may write an inference tensor inside the block; the graph's commit runs outside
    inference mode, where torch refuses: such calls run eagerly (they were captured with a
    guard that rejected the very call: internal_error), normal tensors are graphs."""
    def make(i):
        if i % 2:
            return A(T(3), torch.zeros(3))
        with torch.inference_mode():
            return A(T(3), torch.zeros(3))

    e = check(accumulates_in_inference_mode, make, calls=4, expect="fallback",
              fallback_kind="input_mutation")
    assert e.graphs and e.stats.graph_hits == 1


def test_an_inference_tensor_written_outside_inference_mode_commits_nothing():
    """torch refuses in-place updates of inference tensors outside inference mode: a call
    given one (at capture, or after a graph was captured with a normal tensor) raises like
    eager with the heap as eager leaves it — the earlier writes once, not again by a commit
    that failed halfway before the eager re-run."""
    def inference_zeros():
        with torch.inference_mode():
            return torch.zeros(3)

    opt = specularch.optimize(counts_and_accumulates)
    for inference_call in (0, 1):  # before any graph exists; after one was captured
        specularch.reset()
        boxes, accs = (Box(), Box()), ([], [])
        for i in range(4):
            make = inference_zeros if i == inference_call else (lambda: torch.zeros(3))
            outcomes = []
            for fn, box, seen in zip((counts_and_accumulates, opt), boxes, accs):
                acc = make()
                seen.append(acc)
                try:
                    outcomes.append(fn(box, torch.ones(3), acc))
                except RuntimeError as e:
                    outcomes.append(type(e))
            if isinstance(outcomes[0], torch.Tensor):
                assert torch.equal(*outcomes), i
            else:
                assert outcomes[0] is outcomes[1] is RuntimeError, (i, outcomes)
            assert boxes[0].count == boxes[1].count and torch.equal(*(s[-1] for s in accs)), i
        assert specularch.explain(opt).stats.graph_hits >= 1


# --------------------------------------------------------------------------- the container view

def test_a_written_list_reads_through_its_view_and_discard_gives_back_what_was_read():
    """The first write to a pre-existing list opens its view in the shadow heap: later reads
    (len, index, iteration, ``in``) see the writes, the items read before stay the view's
    base, and ``discard`` hands the value back those items."""
    from specularch.shadow_heap import ShadowHeap
    from specularch.shadow_heap.writes import ReplaceList
    from specularch.symbolic.values import ConstV, ListV
    heap = ShadowHeap()
    a, b, c = ConstV(1), ConstV(2), ConstV(3)
    lst = ListV([a, b])
    held = lst.items  # a reference taken before the first write still sees later ones
    heap.touch_container(lst)
    lst.items.append(c)
    view = heap.view(lst)
    assert (len(view), view[2], c in view, list(view), held[-1]) == (3, c, True, [a, b, c], c)
    assert view.base == [a, b] and view.changed()
    assert [type(w) for w in heap.pending()] == [ReplaceList]
    heap.discard()
    assert lst.items == [a, b] and heap.view(lst) is None


def test_a_written_dict_reads_through_its_view():
    from specularch.shadow_heap import ShadowHeap
    from specularch.shadow_heap.writes import ReplaceDict
    from specularch.symbolic.values import ConstV, DictV
    heap = ShadowHeap()
    one, two = ConstV(1), ConstV(2)
    d = DictV({"a": one})
    heap.touch_container(d)
    d.items["b"] = two
    del d.items["a"]
    view = heap.view(d)
    assert (len(view), view["b"], "a" in view, list(view)) == (1, two, False, ["b"])
    assert view.base == {"a": one} and view.changed()
    assert [type(w) for w in heap.pending()] == [ReplaceDict]
    heap.discard()
    assert d.items == {"a": one}


def reads_after_writes(x, lst, d):
    lst.append(x)
    d["k"] = x * 2
    seen = [len(lst), len(d), "k" in d, "z" in d]
    total = sum(v for v in lst if isinstance(v, torch.Tensor))
    for key in d:
        seen.append(key)
    return total + d["k"] + lst[-1], seen


def test_reads_after_writes_to_passed_in_containers_match_eager():
    check(reads_after_writes, lambda: A(T(3), [T(3), T(3)], {"a": T(3)}), expect="graph")
