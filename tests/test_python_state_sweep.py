"""Adversarial differential sweep of Python state changed by optimized code (the shadow heap,
docs/semantics.md "Shadow heap: deferred writes", "Relaxation", "Standard-library helpers").

Every case is differential (``differential.check`` / ``check_module``): eager and optimized run
on identical inputs over ~10 calls, and everything a user can observe must be the same: values,
the lists / dicts / sets / objects / modules passed in (after the call, also after an
exception: eager's partial writes), globals and closure cells (``state=``), which items of a
container are the same object (``_aliases``), stdout and exceptions. Most cases combine the
writes with a loop whose trip count changes from call to call (``for t in range(n)``, which
specularch rolls into one graph) and with branches on tensor values. Falling back to eager is
fine (``expect=None``), a wrong answer or an ``internal_error`` record is not."""
import collections
import dataclasses
import heapq
import sys

import pytest
import torch
from torch import nn

from differential import A, T, check, check_module, module_globals

CALLS = 10
# Trip counts, one per call; call 4 captures (profile_calls=3), later calls vary around it.
NS = [3, 2, 4, 3, 5, 1, 0, 6, 2, 4, 5, 3]

LOG = []
COUNT = 0
TABLE = {}


def n_of(i):
    return NS[i % len(NS)]


def vec(i):
    """A vector whose sign pattern changes from call to call (branches go both ways)."""
    return T(3) + (0.8 if i % 3 == 0 else -0.8 if i % 3 == 1 else 0.0)


def loop_args(i):
    return A(vec(i), [], n_of(i))


def _aliases(seq):
    """For each item, the index of the first item that is the same object."""
    seen = {}
    return [seen.setdefault(id(v), k) for k, v in enumerate(seq)]


def globals_state(**initial):
    """``module_globals`` plus the aliasing of the global lists' items."""
    reset, read = module_globals(__name__, **initial)

    def read_with_aliases():
        state = read()
        return state, {k: _aliases(v) for k, v in state.items() if isinstance(v, list)}

    return reset, read_with_aliases


def run(fn, make_args, **kw):
    kw.setdefault("calls", CALLS)
    report = check(fn, make_args, **kw)
    _show(fn.__name__, report)
    return report


def run_module(make_module, make_args, **kw):
    kw.setdefault("calls", CALLS)
    report = check_module(make_module, make_args, **kw)
    _show(make_module.__name__, report)
    return report


def _show(name, report):
    kinds = sorted({f.kind for f in report.fallbacks})
    print(f"[sweep] {name}: graphs={len(report.graphs)} captures={report.stats.captures} "
          f"fallback_calls={report.stats.fallback_calls} kinds={kinds}", file=sys.stderr)


# ------------------------------------------------------------------ lists appended in a loop

def append_sum(x, log, n):
    h = x
    for t in range(n):
        h = h * 0.5 + x
        log.append(h.sum())
    return h, len(log)


def append_index(x, log, n):
    h = x
    for t in range(n):
        h = torch.tanh(h + t)
        log.append(t)
    return h, log


def append_float(x, log, n):
    h = x
    for t in range(n):
        h = h * 0.9 + 1
        log.append(float(h.sum()))
    return h


def append_item_and_read_back(x, log, n):
    h = x
    for t in range(n):
        h = h + 1
        log.append(h.mean().item())
        h = h * log[-1]
    return h, len(log)


def append_in_tensor_branch(x, log, n):
    h = x
    for t in range(n):
        h = h - 0.3
        if h.sum() > 0:
            log.append(t)
        else:
            log.append(-t - 1)
    return h


def append_then_len_trip(x, log, n):
    """A list growing in the call, then used whole (its length a trip count)."""
    for t in range(n):
        log.append(x * t)
    total = torch.zeros(3)
    for k in range(len(log)):
        total = total + log[k]
    return total


@pytest.mark.parametrize("fn", [append_sum, append_index, append_float, append_item_and_read_back,
                                append_in_tensor_branch, append_then_len_trip])
def test_list_argument_appended_in_loop(fn):
    run(fn, loop_args)


def grows_across_calls(x, log):
    """The same list object passed on every call, growing (relaxed to append-only)."""
    log.append(x.sum())
    log.append(len(log))
    return x * len(log)


def test_list_growing_across_calls():
    shared = [[], []]  # one list per side, kept between calls

    def make(i):
        # make_args runs eager's then the optimized side's: alternate the two persistent lists.
        make.k += 1
        return A(T(3), shared[make.k % 2])
    make.k = -1
    run(grows_across_calls, make)


def append_global(x, n):
    h = x
    for t in range(n):
        h = torch.relu(h) + 0.1 * t
        LOG.append(h.mean())
    return h


def test_global_list_appended_in_loop():
    run(append_global, lambda i: A(vec(i), n_of(i)), state=globals_state(LOG=[]))


def global_counter_and_table(x, n):
    global COUNT
    h = x
    for t in range(n):
        h = h.sin() + x
        COUNT += 1
        TABLE[t] = COUNT
        if h.max() > 1:
            TABLE["big"] = TABLE.get("big", 0) + 1
    return h


def test_global_counter_and_dict():
    run(global_counter_and_table, lambda i: A(vec(i), n_of(i)),
        state=globals_state(COUNT=5, TABLE={"keep": 1}))


def global_rebound_list(x, n):
    global LOG
    for t in range(n):
        LOG = LOG + [t]
    LOG.append(x.sum())
    return x + len(LOG)


def test_global_list_rebound():
    run(global_rebound_list, lambda i: A(vec(i), n_of(i)), state=globals_state(LOG=[7]))


# ------------------------------------------------------------------ list methods

def list_methods(x, lst, n):
    h = x
    for t in range(n):
        h = h + 1
        lst.insert(0, t)
    lst.extend([h.sum(), 9])
    if len(lst) > 3:
        lst.pop()
        lst.pop(0)
    lst.remove(9) if 9 in lst else None
    return h, lst


def test_list_insert_extend_pop_remove():
    run(list_methods, lambda i: A(vec(i), [5, 9, 1], n_of(i)))


def list_sort_slices(x, lst, n):
    for t in range(n):
        lst.append((t * 7) % 5)
    lst.sort()
    lst[1:3] = [100, 200, 300]
    del lst[0]
    lst.reverse()
    lst[::2] = [-v for v in lst[::2]]
    return x * lst[0], lst[-2:]


def test_list_sort_slice_assign_reverse():
    run(list_sort_slices, lambda i: A(vec(i), [4, 1, 3], n_of(i)))


def list_pop_queue(x, q, n):
    h = x
    for t in range(n):
        if q:
            h = h + q.pop(0)
    q.append(h)
    return h, len(q)


def test_list_used_as_queue():
    run(list_pop_queue, lambda i: A(vec(i), [T(3) for _ in range(3)], n_of(i)))


def list_iadd_ops(x, lst, n):
    lst += [x.sum()]
    lst += lst  # (`lst *= 2` here: test_list_imul_argument_holding_tensor)
    for t in range(n):
        lst[t % len(lst)] = t
    lst.clear() if n == 0 else None
    return len(lst)


def test_list_iadd_clear():
    run(list_iadd_ops, lambda i: A(vec(i), [1, 2], n_of(i)))


def sort_by_key(x, lst, n):
    lst.sort(key=lambda v: -v)
    for t in range(n):
        lst[t % len(lst)] += t
    return x + sum(lst)


def test_list_sort_with_key():
    run(sort_by_key, lambda i: A(vec(i), [3, 1, 2, 5], n_of(i)))


def tensor_list_loop_then_mutated(x, ws, n):
    """A list of tensors used in a loop, then changed (items replaced, appended, removed)."""
    h = x
    for w in ws:
        h = torch.tanh(h * w)
    for t in range(n):
        ws[t % len(ws)] = ws[t % len(ws)] + h
    ws.append(h)
    del ws[0]
    return h


def test_tensor_list_loop_then_mutated():
    run(tensor_list_loop_then_mutated,
        lambda i: A(vec(i), [T(3) for _ in range(2 + i % 3)], n_of(i)))


# ------------------------------------------------------------------ aliasing

def aliased_lists(x, a, b, n):
    for t in range(n):
        a.append(t)
        b.append(x.sum() + t)
    return len(a), len(b), a is b


def test_list_aliasing_another_argument():
    def make(i):
        a = [1]
        return A(vec(i), a, a if i % 2 else [2], n_of(i))
    run(aliased_lists, make)


def aliased_lists_same(x, a, b, n):
    for t in range(n):
        a.append(t)
        b.append(len(a))
    return x * len(b)


def test_list_always_aliased():
    def make(i):
        a = [0]
        return A(vec(i), a, a, n_of(i))
    run(aliased_lists_same, make)


def store_then_inplace(x, n):
    h = x * 2
    LOG.append(h)
    for t in range(n):
        h.add_(1)
    LOG.append(h)
    h.mul_(-1)
    return h.sum()


def test_tensor_stored_then_modified_in_place():
    """The list holds the very tensor later written in place, twice (aliasing)."""
    run(store_then_inplace, lambda i: A(vec(i), n_of(i)), state=globals_state(LOG=[]))


def store_twice(x, n):
    h = x + 1
    LOG.append(h)
    LOG.append(h)
    for t in range(n):
        LOG.append(h if t % 2 else h * 1)
    return LOG[0] is LOG[1], h


def test_same_tensor_stored_twice():
    """Which items of the list are the same object is compared too (``globals_state``)."""
    run(store_twice, lambda i: A(vec(i), n_of(i)), state=globals_state(LOG=[]))


def stored_view_then_written(x, log, n):
    h = x.clone()
    log.append(h[:2])
    for t in range(n):
        h[0] = h[0] + t
    return h


def test_view_stored_then_base_written():
    run(stored_view_then_written, loop_args)


# ------------------------------------------------------------------ dicts

def dict_by_index(x, d, n):
    h = x
    for t in range(n):
        h = h * 0.5 + 1
        d[t] = h.sum()
    d["n"] = n
    return h, list(d)


def test_dict_keyed_by_loop_index():
    run(dict_by_index, lambda i: A(vec(i), {"pre": 1}, n_of(i)))


def dict_by_string(x, d, n):
    h = x
    for t in range(n):
        h = torch.tanh(h) + 0.5
        d["steps"] = d.get("steps", 0) + 1
        d["last"] = h
        if h.sum() > 1.5:
            d["hot"] = d.get("hot", 0) + 1
    return h


def test_dict_keyed_by_string_with_branch():
    run(dict_by_string, lambda i: A(vec(i), {"steps": i}, n_of(i)))


def dict_delete_update(x, d, n):
    for t in range(n):
        d[f"k{t}"] = t
    if "a" in d:
        del d["a"]
    d.update(b=x.sum(), c=n)
    d.pop("k0", None)
    d.setdefault("lst", []).append(n)
    return sorted(k for k in d if k.startswith("k"))


def test_dict_del_update_pop_setdefault():
    run(dict_delete_update, lambda i: A(vec(i), {"a": 1, "z": 0} if i % 2 else {"z": 0}, n_of(i)))


def dict_reorder(x, d, n):
    for t in range(n):
        v = d.pop("first", 0)
        d["first"] = v + t
    return x + len(d), list(d.items())


def test_dict_reinsert_changes_order():
    run(dict_reorder, lambda i: A(vec(i), {"first": 1, "second": 2}, n_of(i)))


def dict_iter_after_insert(x, d, n):
    for t in range(n):
        d[t] = x * t
    total = torch.zeros(3)
    for k, v in d.items():
        total = total + v
    return total


def test_dict_iterated_after_inserts():
    run(dict_iter_after_insert, lambda i: A(vec(i), {"z": T(3)}, n_of(i)))


def build(items, k, out):
    if k == len(items):
        return out
    out[items[k]] = out.get(items[k - 1], 0) + k if k else k
    return build(items, k + 1, out)


def recursive_dict(x, names):
    d = build(names, 0, {})
    return x * sum(d.values()), d


def test_recursion_over_list_building_dict():
    run(recursive_dict, lambda i: A(vec(i), ["a", "b", "c", "d", "e"][: 1 + i % 5]))


def recursive_dict_into_arg(x, names, out):
    build(names, 0, out)
    return x + len(out)


def test_recursion_writes_dict_argument():
    run(recursive_dict_into_arg, lambda i: A(vec(i), ["a", "b", "a", "c"][: 1 + i % 4], {"q": 1}))


# ------------------------------------------------------------------ exceptions

def mutate_then_raise(x, log, n):
    h = x
    for t in range(n):
        h = h + 1
        log.append(t)
    if n > 4:
        raise ValueError(f"too many: {len(log)}")
    return h


def test_mutation_then_python_raise():
    run(mutate_then_raise, loop_args)


def mutate_then_index_error(x, log, n):
    for t in range(n):
        log.append(x.sum() * t)
    return log[3]


def test_mutation_then_index_error():
    run(mutate_then_index_error, loop_args)


def mutate_then_torch_error(x, d, n):
    d["before"] = x.sum()
    for t in range(n):
        d[t] = t
    y = torch.ones(n if n != 5 else 4, 3)
    return torch.cat([x[None].expand(n, 3), y], 1) if n == 0 else x + y


def test_mutation_then_torch_error():
    run(mutate_then_torch_error, lambda i: A(vec(i), {}, n_of(i)))


def mutate_then_raise_in_branch(x, log, n):
    h = x
    for t in range(n):
        h = h * 1.5
        log.append(t)
    if h.abs().max() > 4:
        raise RuntimeError("diverged")
    log.append("ok")
    return h


def test_mutation_then_raise_on_tensor_branch():
    run(mutate_then_raise_in_branch, lambda i: A(T(3) * (0.2 if i % 2 else 2), [], n_of(i)))


def obj_mutate_then_raise(x, st, n):
    for t in range(n):
        st.count += 1
        st.items.append(t)
    st.last = x.sum()
    if st.count > 5:
        raise OverflowError(st.count)
    return x


def test_object_mutation_then_raise():
    run(obj_mutate_then_raise, lambda i: A(vec(i), Box(count=i % 3, items=[]), n_of(i)))


def swallowed(x, d, log, n):
    for t in range(n):
        try:
            log.append(t)
            v = d[t]
            log.append(v)
        except KeyError:
            log.append("miss")
            d[t] = x.sum()
    return x + len(log)


def test_mutation_inside_try_except():
    run(swallowed, lambda i: A(vec(i), {0: 1, 2: 3}, [], n_of(i)))


def try_finally(x, log, n):
    try:
        for t in range(n):
            log.append(t)
            if t == 3:
                raise KeyError(t)
    finally:
        log.append("finally")
    return x


def test_mutation_in_try_finally_raise():
    run(try_finally, loop_args)


def raise_caught_outside_loop(x, log, n):
    h = x
    try:
        for t in range(n):
            h = h + 1
            log.append(h.sum())
            if t == 2:
                raise StopIteration
    except StopIteration:
        log.append("stopped")
    return h


def test_raise_in_loop_caught_outside():
    run(raise_caught_outside_loop, loop_args)


# ------------------------------------------------------------------ objects and modules

@dataclasses.dataclass
class Box:
    count: int = 0
    items: list = dataclasses.field(default_factory=list)
    last: object = None


def dataclass_fields(x, st, n):
    h = x
    for t in range(n):
        h = h + st.count
        st.count += 1
        if h.sum() > 0:
            st.items.append(t)
    st.last = h
    return h


def test_dataclass_fields():
    run(dataclass_fields, lambda i: A(vec(i), Box(count=i % 2), n_of(i)))


def string_attrs(x, obj, n):
    for t in range(n):
        name = f"a{t % 2}"
        setattr(obj, name, getattr(obj, name, 0) + 1)
    if hasattr(obj, "gone"):
        delattr(obj, "gone")
    setattr(obj, "out", x * getattr(obj, "a0", -1))
    return obj.out


def test_setattr_getattr_string_names():
    def make(i):
        obj = Box()
        if i % 2:
            obj.gone = 1
        return A(vec(i), obj, n_of(i))
    run(string_attrs, make)


class Stepper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.steps = 0
        self.hits = 0
        self.cache = None
        self.history = []

    def forward(self, x, n):
        h = x
        if self.cache is not None:
            h = h + self.cache
        for t in range(n):
            h = torch.tanh(self.lin(h))
            self.steps += 1
            if h.sum() > 0:
                self.hits += 1
        self.cache = h.detach()
        self.history.append(self.steps)
        return h


def test_module_counters_cache_history():
    run_module(Stepper, lambda i: A(vec(i), n_of(i)))


class Trimmer(nn.Module):
    def __init__(self):
        super().__init__()
        self.buf = []

    def forward(self, x, n):
        for t in range(n):
            self.buf.append(x * t)
        self.buf = self.buf[-3:]
        out = x
        for b in self.buf:
            out = out + b
        return out


def test_module_list_attribute_trimmed():
    run_module(Trimmer, lambda i: A(vec(i), n_of(i)))


class Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.stats = {}

    def forward(self, x, n):
        h = x
        for t in range(n):
            h = self.lin(h)
            key = "pos" if h.mean() > 0 else "neg"
            self.stats[key] = self.stats.get(key, 0) + 1
        return h


def test_module_dict_keyed_by_tensor_branch():
    run_module(Tagged, lambda i: A(vec(i), n_of(i)))


# ------------------------------------------------------------------ sets and collections

def int_set(x, seen, n):
    for t in range(n):
        seen.add(t * 2 % 5)
    seen.discard(4)
    seen |= {n}
    return x * len(seen)


def test_set_of_ints_updated():
    run(int_set, lambda i: A(vec(i), {1, 4}, n_of(i)))


def deque_arg(x, dq, n):
    for t in range(n):
        dq.append(t)
        if len(dq) > 2:
            dq.popleft()
    dq.appendleft(x.sum())
    return x + len(dq)


def test_deque_argument():
    run(deque_arg, lambda i: A(vec(i), collections.deque([9], maxlen=3 if i % 2 else None), n_of(i)))


def defaultdict_arg(x, dd, n):
    for t in range(n):
        dd[t % 2].append(t)
    dd["x"].append(x.sum())
    return x + len(dd)


def test_defaultdict_argument():
    run(defaultdict_arg, lambda i: A(vec(i), collections.defaultdict(list), n_of(i)))


def counter_arg(x, c, n):
    for t in range(n):
        c[t % 3] += 1
    c.update("ab")
    return x * sum(c.values())


def test_counter_argument():
    run(counter_arg, lambda i: A(vec(i), collections.Counter({"a": 1}), n_of(i)))


def ordereddict_arg(x, od, n):
    for t in range(n):
        od[t] = t
    od.move_to_end("first")
    od.popitem(last=False)
    return x + len(od)


def test_ordereddict_argument():
    run(ordereddict_arg,
        lambda i: A(vec(i), collections.OrderedDict([("first", 1), ("second", 2)]), n_of(i)))


def collections_made_in_call(x, out, n):
    dq = collections.deque(maxlen=2)
    c = collections.Counter()
    dd = collections.defaultdict(int)
    h = x
    for t in range(n):
        h = h + 1
        dq.append(t)
        c[t % 2] += 1
        dd["k"] += t
    out.append(list(dq))
    out.append(dict(c))
    out.append(dict(dd))
    return h, dq


def test_collections_made_in_call_stored():
    run(collections_made_in_call, loop_args)


# ------------------------------------------------------------------ closures, generators, print

def make_counter_fn():
    count = 0

    def counted(x, n):
        nonlocal count
        h = x
        for t in range(n):
            h = h * 2 - 1
            count += 1
        return h, count
    return counted


def test_nonlocal_counter_from_outside():
    fn = make_counter_fn()
    cell = fn.__closure__[0]

    def reset():
        cell.cell_contents = 3

    def read():
        return cell.cell_contents
    run(fn, lambda i: A(vec(i), n_of(i)), state=(reset, read))


def inner_nonlocal(x, n):
    total = 0
    hist = []

    def bump(v):
        nonlocal total
        total += v
        hist.append(total)

    for t in range(n):
        bump(t)
    return x * total, hist


def test_nonlocal_counter_made_in_call():
    run(inner_nonlocal, lambda i: A(vec(i), n_of(i)))


def partial_generator(x, log, n):
    def gen():
        for t in range(5):
            log.append(t)
            yield x * t

    g = gen()
    out = x
    for _ in range(n if n < 5 else 4):
        out = out + next(g)
    return out


def test_generator_consumed_partially():
    run(partial_generator, loop_args)


def generator_argument(x, g, n):
    out = x
    for _ in range(min(n, 2)):
        out = out + next(g)
    return out


def test_generator_argument_consumed_partially():
    def make(i):
        items = [T(3) for _ in range(4)]
        return A(vec(i), (v * 2 for v in items), n_of(i))
    run(generator_argument, make)


def print_in_loop(x, log, n):
    h = x
    for t in range(n):
        h = h * 0.5 + 1
        print("step", t, round(h.sum().item(), 4))
        log.append(t)
    print(f"done {n}")
    return h


def test_print_inside_loop():
    run(print_in_loop, loop_args)


def print_in_branch_then_raise(x, log, n):
    h = x
    for t in range(n):
        h = h - 0.5
        if h.sum() > 0:
            print("pos", t)
        else:
            print("neg", t)
        log.append(t)
    if n == 5:
        raise ValueError("five")
    return h


def test_print_in_tensor_branch_then_raise():
    run(print_in_branch_then_raise, loop_args)


# ------------------------------------------------------------------ tolist and numbers

def tolist_stored(x, log, n):
    h = x
    for t in range(n):
        h = h * 2
    log.append(h.tolist())
    log.append(h.int().tolist())
    return h


def test_tolist_stored():
    run(tolist_stored, loop_args)


def item_arithmetic_stored(x, d, n):
    acc = 0.0
    for t in range(n):
        acc = acc + x[t % 3].item() * t
        d[t] = acc
    d["acc"] = acc
    return x * 2


def test_item_arithmetic_stored_in_dict():
    run(item_arithmetic_stored, lambda i: A(vec(i), {}, n_of(i)))


def int_counters_list(x, counts, n):
    for t in range(n):
        counts[t % len(counts)] += 1
        if x[t % 3] > 0:
            counts[0] -= 1
    return x + counts[0]


def test_int_list_items_incremented_with_branch():
    run(int_counters_list, lambda i: A(vec(i), [0, 0, 0], n_of(i)))


# ------------------------------------------------------------------ nested containers

def nested(x, state, n):
    h = x
    for t in range(n):
        h = h.cos()
        state["hist"].append(h.sum())
        state["meta"]["n"] += 1
    state["hist"] = state["hist"][-2:]
    return h


def test_nested_containers():
    run(nested, lambda i: A(vec(i), {"hist": [1.0], "meta": {"n": i}}, n_of(i)))


def shared_inner_list(x, a, b, n):
    """Two dict arguments holding the same inner list."""
    for t in range(n):
        a["l"].append(t)
    b["l"].append(x.sum())
    return len(b["l"])


def test_shared_inner_list():
    def make(i):
        inner = [0]
        return A(vec(i), {"l": inner}, {"l": inner if i % 2 else [1]}, n_of(i))
    run(shared_inner_list, make)


def zipped_lists(xs, out, n):
    h = torch.zeros(3)
    for k, (x, o) in enumerate(zip(xs, out)):
        h = h + x
        out[k] = o + k
    for t in range(n):
        out.append(t)
    return h


def test_enumerate_zip_then_item_writes():
    run(zipped_lists, lambda i: A([T(3) for _ in range(2 + i % 3)], [10, 20, 30], n_of(i)))


def loop_list_mutated_during_iteration(x, lst, n):
    h = x
    for v in lst:
        h = h + v
        if len(lst) < 4 + n:
            lst.append(v + 1)
    return h, len(lst)


def test_list_appended_while_iterating():
    run(loop_list_mutated_during_iteration, lambda i: A(vec(i), [1, 2], n_of(i)))


# ------------------------------------------------------------------ list `*=`
# (`lst *= k` on a list holding a tensor was captured as `lst = lst * k`: the argument list or
# an alias of it was left as it was; symbolic/operators._sequence_op does it in place now)

def imul_argument(x, lst):
    lst.append(x.sum())
    lst *= 2
    return x + len(lst)


def test_list_imul_argument_holding_tensor():
    run(imul_argument, lambda i: A(vec(i), [1, 2]))


def imul_local_alias(x):
    a = [x]
    b = a
    a *= 3
    return len(b), b


def test_list_imul_local_alias():
    run(imul_local_alias, lambda i: A(vec(i)), calls=5)


def imul_zero(x, lst, n):
    for t in range(n):
        lst.append(x * t)
    lst *= 0
    return len(lst)


def test_list_imul_zero_clears_argument():
    run(imul_zero, loop_args)


def iadd_list_itself(x, lst):
    lst.append(x)
    lst += lst
    lst.append(x)
    return lst


def test_list_iadd_itself_holding_tensor():
    run(iadd_list_itself, lambda i: A(vec(i), [1]), calls=6)


# ------------------------------------------------------------------ rolled loops writing state
# These bodies roll (one graph for every trip count, explain() says "rolled loop"): the list
# item, the dict key and the nested item are written once per iteration by the rolled node.

ROLLED_NS = [3, 2, 4, 3, 5, 0, 6, 1, 4, 5]


def rolled_n(i):
    return ROLLED_NS[i % len(ROLLED_NS)]


def _rolled(report):
    return any(loop.rolled for graph in report.graphs for loop in graph.loops)


def item_written_each_iteration(x, log, n):
    h = x
    for t in range(n):
        h = h * 0.5 + log[0]
        log[0] = h
    return h


def dict_key_written_each_iteration(x, d, n):
    h = x
    for t in range(n):
        h = torch.tanh(h + x)
        d["last"] = h
    return h


def nested_item_written_each_iteration(x, st, n):
    h = x
    for t in range(n):
        h = h * 0.5 + st["w"][0]
        st["w"][0] = h
        st["last"] = h
    return h


def items_swapped_each_iteration(x, log, n):
    h = x
    for t in range(n):
        h = h * 0.5 + log[1]
        log[0], log[1] = log[1], h
    return h


def stack_stored_after_loop(x, log, n):
    h = x
    outs = [x]
    for t in range(n):
        h = h * 0.5 + x
        outs.append(h)
    log.append(torch.stack(outs))
    return h


def _same_tensor_twice(i):
    t = T(3)
    return A(vec(i), [t, t], rolled_n(i))


@pytest.mark.parametrize("fn, make", [
    (item_written_each_iteration, lambda i: A(vec(i), [T(3)], rolled_n(i))),
    (dict_key_written_each_iteration, lambda i: A(vec(i), {"a": 1}, rolled_n(i))),
    (nested_item_written_each_iteration, lambda i: A(vec(i), {"w": [T(3)]}, rolled_n(i))),
    (items_swapped_each_iteration, _same_tensor_twice),
    (stack_stored_after_loop, lambda i: A(vec(i), [], rolled_n(i))),
])
def test_rolled_loop_writes(fn, make):
    report = run(fn, make, calls=12)
    assert _rolled(report), report


def rolled_aliased_args(x, a, b, n):
    h = x
    for t in range(n):
        h = h * 0.5 + b[0]
        a[0] = h
    return h


def test_rolled_loop_writes_list_aliasing_another_argument():
    def make(i):
        a = [T(3)]
        return A(vec(i), a, a if i % 2 else [T(3)], rolled_n(i))
    run(rolled_aliased_args, make, calls=12)


def rolled_global_twice(x, n):
    h = x
    for t in range(n):
        h = torch.tanh(h + x)
        LOG[0] = h
        LOG[1] = h
    return h


def test_rolled_loop_stores_same_tensor_twice_in_global():
    run(rolled_global_twice, lambda i: A(vec(i), rolled_n(i)), calls=12,
        state=globals_state(LOG=[0, 1]))


def rolled_grad(x, log, n):
    h = x
    for t in range(n):
        h = torch.tanh(h * 2 + x)
        log[0] = h
    return h


def test_rolled_loop_write_with_grad():
    run(rolled_grad, lambda i: A(T(3, requires_grad=True), [0], rolled_n(i) or 1), calls=12,
        grad=True)


def rolled_then_runtime_error(x, log, idx, n):
    h = x
    for t in range(n):
        h = h * 0.5 + x
        log[0] = h
    return h.gather(0, idx)


def test_rolled_loop_write_then_graph_op_raises():
    """The gather raises at run time on some calls: eager leaves ``log[0]`` written."""
    run(rolled_then_runtime_error,
        lambda i: A(vec(i), [0], torch.tensor([0, 2 if i % 3 else 7]), rolled_n(i)), calls=12)


def rolled_then_raise(x, log, n):
    h = x
    for t in range(n):
        h = h * 0.5 + x
        log[0] = h
    if h.sum() > 1:
        raise ValueError("big")
    return h


def test_rolled_loop_write_then_raise_on_tensor_branch():
    run(rolled_then_raise, lambda i: A(vec(i), [0], rolled_n(i)), calls=12)


# ------------------------------------------------------------------ state kept across calls
# check_module keeps one module per side for all calls: the relaxations of docs/semantics.md
# (counter -> graph input, growing list -> append-only, dict -> single keys) are exercised.

class Memo(nn.Module):
    def __init__(self):
        super().__init__()
        self.memo = {}
        self.misses = 0

    def forward(self, x, n):
        if n in self.memo:
            return x * self.memo[n]
        self.misses += 1
        self.memo[n] = float(n) + 0.5
        return x + n


def test_memo_dict_across_calls():
    run_module(Memo, lambda i: A(vec(i), [1, 2, 1, 3, 2, 4, 5, 1, 6, 4, 7, 2][i]), calls=12)


class History(nn.Module):
    def __init__(self):
        super().__init__()
        self.history = []

    def forward(self, x):
        self.history.append(x.sum())
        if len(self.history) > 5:
            self.history.pop(0)
        return x * self.history[0] + self.history[-1]


def test_history_list_grows_then_trimmed():
    run_module(History, lambda i: A(vec(i)), calls=12)


class AppendOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.log = []

    def forward(self, x, n):
        h = x
        for t in range(n):
            h = h * 0.5 + 1
        self.log.append(h.sum())
        if n == 5:
            return h + self.log[0]  # an old item read once the list was relaxed to append-only
        return h + self.log[-1]


def test_append_only_list_then_old_item_read():
    run_module(AppendOnly, lambda i: A(vec(i), rolled_n(i)), calls=12)


class CountBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.ema = 0.0

    def forward(self, x):
        self.count += 1
        h = x * 2 if self.count % 3 == 0 else x - 1
        self.ema = 0.9 * self.ema + 0.1 * h.sum().item()
        return h, self.count


def test_counter_relaxed_then_branched_on():
    run_module(CountBranch, lambda i: A(vec(i)), calls=12)


class RaisesLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []
        self.calls = 0

    def forward(self, x, n):
        self.calls += 1
        for t in range(n):
            self.seen.append(t)
        if len(self.seen) > 12:
            self.seen.clear()
            raise RuntimeError(f"overflow at call {self.calls}")
        return x + len(self.seen)


def test_module_state_then_raise():
    run_module(RaisesLater, lambda i: A(vec(i), n_of(i)), calls=12)


# ------------------------------------------------------------------ more shapes of state

def print_then_raise_in_loop(x, log, n):
    h = x
    for t in range(n):
        h = h + 1
        print("t", t, end=";")
        log.append(t)
        if t == 3:
            raise ValueError(t)
    return h


def test_print_then_raise_inside_loop():
    """Eager prints and appends up to the raise, then the exception leaves the call."""
    run(print_then_raise_in_loop, loop_args)


def heap_ops(x, lst, n):
    for t in range(n):
        heapq.heappush(lst, (t * 7) % 4)
    return x + heapq.heappop(lst) if lst else x


def test_heapq_on_list_argument():
    run(heap_ops, lambda i: A(vec(i), [2, 5], n_of(i)))


def index_and_count(x, lst, n):
    for t in range(n):
        lst.append(t % 2)
    return x * lst.count(1) + lst.index(0) if 0 in lst else x


def test_list_count_index_after_appends():
    run(index_and_count, loop_args)


def sorted_into_attributes(x, obj, n):
    obj.vals = sorted([(t * 3) % 5 for t in range(n)], reverse=True)
    obj.maxv = max(obj.vals, default=-1)
    return x + obj.maxv


def test_sorted_list_into_new_attributes():
    run(sorted_into_attributes, lambda i: A(vec(i), Box(), n_of(i)))


def dict_delete_while_listing(x, d, n):
    for t in range(n):
        d[t] = x * t
    for k in list(d):
        if isinstance(k, int) and k % 2:
            del d[k]
    return sum(d.values(), torch.zeros(3))


def test_dict_of_tensors_deleted_over_key_list():
    run(dict_delete_while_listing, lambda i: A(vec(i), {"z": T(3)}, n_of(i)))


def list_of_aliased_lists(x, grid, n):
    for t in range(n):
        grid[t % 2].append(t)
    grid.append(grid[0])
    grid[0].append(-1)
    return x + len(grid[1])


def test_list_of_aliased_inner_lists():
    def make(i):
        a = []
        return A(vec(i), [a, [9]] if i % 2 else [a, a], n_of(i))
    run(list_of_aliased_lists, make)


def nested_try_finally(x, log, n):
    try:
        log.append(1)
        try:
            log.append(2)
            raise KeyError("a")
        finally:
            log.append(3)
    except KeyError as e:
        log.append(str(e))
    for t in range(n):
        log.append(x.sum() * t)
    return x


def test_nested_try_finally_writes_then_loop():
    run(nested_try_finally, loop_args)


def live_keys_view(x, d, log, n):
    keys = d.keys()
    for t in range(n):
        d[f"k{t}"] = x * t
    log.append(list(keys))
    return x + len(keys)


def test_keys_view_taken_before_inserts():
    run(live_keys_view, lambda i: A(vec(i), {"a": 0}, [], n_of(i)))
