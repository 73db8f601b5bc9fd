"""Standard-library objects made in the optimized call are captured (differential vs eager):
deque, namedtuple instances, Counter, more itertools, dataclasses, enum members,
lru_cache-wrapped pure helpers, operator.methodcaller; corners that cannot be modelled
faithfully fall back with a recorded reason."""
import collections
import dataclasses
import enum
import functools
import itertools
import operator

import pytest
import torch

from differential import A, T, check

pytestmark = pytest.mark.usefixtures("no_profiling")

Pair = collections.namedtuple("Pair", "x y", defaults=(0,))


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    n: int = 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    loss: torch.Tensor
    n: int


class Color(enum.Enum):
    RED = 1
    GREEN = 2


@functools.lru_cache(maxsize=None)
def _scales(n):
    return tuple(n * i for i in range(4))


@functools.lru_cache(maxsize=None)
def _scale_list(n):
    return [n * i for i in range(4)]


# ---- programs -------------------------------------------------------------------------------
def deque_window(xs):
    d = collections.deque(xs[:1], maxlen=3)
    for x in xs:
        d.append(x * 2)
    d.appendleft(xs[0])
    d.rotate(1)
    first = d.popleft()
    d.extendleft([first + 1])
    return d, len(d), d[0] + d[-1], d.maxlen, collections.deque([1, 2]) + collections.deque([3])


def namedtuple_made(x):
    p = Pair(x, 2)
    q = p._replace(y=x * 3)
    return p, q, Pair(x), p.x * p.y, q._asdict()


def counter_made(x, word):
    c = collections.Counter(word)
    c["z"] += 2
    c.update("ab")
    d = c + collections.Counter(a=1, q=3)
    return c, d, c.most_common(3), c["missing"], x * c["a"], sorted(c.elements()), d - c


def itertools_made(xs):
    sliced = [t * i for i, t in enumerate(itertools.islice(xs, 1, None, 2))]
    pairs = [a * b for a, b in itertools.combinations(xs, 2)]
    perms = list(itertools.permutations(range(3), 2))
    longest = [(a, b) for a, b in itertools.zip_longest(xs, [1], fillvalue=0)]
    repeated = list(itertools.repeat(xs[0], 2))
    counted = list(zip(itertools.count(5, 2), xs))
    groups = [(k, len(list(g))) for k, g in itertools.groupby("aabbbcaa")]
    return sliced, pairs, perms, longest, repeated, counted, groups


def itertools_shared_iterator(xs):
    it = iter(xs)
    head = list(itertools.islice(it, 2))
    grouped = [(k, list(g)) for k, g in itertools.groupby([1, 1, 2, 3, 3], key=lambda v: v % 2)]
    return head, list(it), grouped


def dataclass_made(x):
    o = Out(x * 2, 3)
    f = Frozen(x, 1)
    g = dataclasses.replace(f, n=5)
    return o, o.loss + o.n, f, g, g.n, dataclasses.astuple(Out(1, 2)), dataclasses.asdict(Out("a"))


def enum_members(x):
    c = Color.RED
    table = {Color.RED: x, Color.GREEN: x * 2}
    return x * c.value, c.name, c == Color.GREEN, table[c], Color(2), table[Color(2)], c is Color.RED


def lru_helper(x, n):
    return x * _scales(n)[1], _scales(n)


def methodcaller_made(x):
    return operator.methodcaller("add", 1)(x), operator.methodcaller("sum", dim=0)(x)


PROGRAMS = [
    (deque_window, lambda i: A([T(2) for _ in range(2 + i % 3)])),
    (namedtuple_made, lambda: A(T(2))),
    (counter_made, lambda i: A(T(2), ["abracadabra", "banana"][i % 2])),
    (itertools_made, lambda i: A([T(2) for _ in range(2 + i % 2)])),
    (itertools_shared_iterator, lambda: A([T(2) for _ in range(4)])),
    (dataclass_made, lambda: A(T(2))),
    (enum_members, lambda: A(T(2))),
    (lru_helper, lambda i: A(T(2 + i), 2)),
    (methodcaller_made, lambda: A(T(2, 3))),
]


@pytest.mark.parametrize("fn, make_args", PROGRAMS, ids=[p[0].__name__ for p in PROGRAMS])
def test_stdlib_objects_made_in_the_call_are_captured(fn, make_args):
    check(fn, make_args, calls=3, expect="graph")


# ---- faithful refusals ------------------------------------------------------------------------
def lru_mutable_result(x):
    return x * _scale_list(2)[1]


def frozen_write(x):
    f = Frozen(x, 1)
    f.n = 2  # eager: FrozenInstanceError
    return f


def deque_slice(x):
    return collections.deque([x, x])[0:1]  # eager: TypeError


def deque_passed_in(d, x):
    d.append(x)
    return len(d)


@pytest.mark.parametrize("fn, make_args, line", [
    (lru_mutable_result, lambda: A(T(2)), lru_mutable_result.__code__.co_firstlineno + 1),
    (frozen_write, lambda: A(T(2)), frozen_write.__code__.co_firstlineno + 2),
    (deque_slice, lambda: A(T(2)), deque_slice.__code__.co_firstlineno + 1),
    (deque_passed_in, lambda: A(collections.deque([1]), T(2)), deque_passed_in.__code__.co_firstlineno + 1),
], ids=["lru_mutable_result", "frozen_write", "deque_slice", "deque_passed_in"])
def test_stdlib_corners_fall_back(fn, make_args, line):
    check(fn, make_args, expect="fallback", fallback_kind=("unsupported_call", "exception_handling"),
          fallback_line=line)


def test_lru_cache_stale_entry_falls_back():
    """A cached entry computed from state that changed since: eager returns the stale entry;
    a fresh inlined computation would not, so the call runs eagerly."""
    state = {"k": 2}

    @functools.lru_cache(maxsize=None)
    def scaled(n):
        return n * state["k"]

    def fn(x):
        return x * scaled(3)

    scaled(3)  # cached as 6
    state["k"] = 5
    check(fn, lambda: A(T(2)), expect="fallback", fallback_kind="unsupported_call")
