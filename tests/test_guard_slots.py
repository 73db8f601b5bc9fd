"""A big generated entry's locals share slots once dead (guards/slots.py), so its frame fits
CPython's data stack instead of being mapped from the OS at every call. The renaming is
checked on functions of each shape it must handle or leave alone, then on whole training
steps against eager with every entry and check compacted."""
import pytest
import torch
from torch import nn

import specularch
from specularch.api import _state_of
from specularch.guards import slots
from specularch.guards.slots import compact_locals
from differential import mse_train_step


def _function(src: str, name: str = "f"):
    ns: dict = {}
    exec(src, ns)
    return ns[name]


def _compacted(fn):
    return type(fn)(compact_locals(fn.__code__, threshold=0), fn.__globals__, fn.__name__,
                    fn.__defaults__, fn.__closure__)


def _chain(n: int) -> str:
    """``n`` locals, each live for two lines, and one (``keep``) live throughout; a try block
    whose handler returns, as in an entry function."""
    body = ["    keep = a * 3", "    x0 = a + 1"]
    body += [f"    x{i} = x{i - 1} + {i}" for i in range(1, n)]
    body += ["    try:", f"        y = 10 / (x{n - 1} - b)", "    except ZeroDivisionError:",
             "        return 'miss', keep"]
    return "def f(a, b):\n" + "\n".join(body) + "\n    return y + keep, keep\n"


@pytest.mark.parametrize("n", [5, 300, 700])  # 300, 700: slot numbers past 255 (EXTENDED_ARG)
def test_a_straight_line_function_keeps_its_results_with_fewer_locals(n):
    fn = _function(_chain(n))
    small = _compacted(fn)
    assert small.__code__.co_nlocals < 8 < fn.__code__.co_nlocals
    last = 1 + sum(range(1, n))
    for a, b in ((1, 0), (2, 5), (1, last)):  # the last one divides by zero: the handler
        assert small(a, b) == fn(a, b)


def test_many_locals_live_at_once_keep_slots_of_their_own():
    src = "def f(a):\n" + "".join(f"    v{i} = a + {i}\n" for i in range(600))
    src += "    return [" + ", ".join(f"v{i}" for i in range(600)) + "]\n"
    fn = _function(src)
    small = _compacted(fn)
    assert small.__code__.co_nlocals == fn.__code__.co_nlocals and small(2) == fn(2)


@pytest.mark.parametrize("src", [
    "def f(a, b):\n    t = 0\n    for i in range(a):\n        u = i * b\n        t = t + u\n    return t\n",
    "def f(a, b):\n    c = a + 1\n    g = lambda: c + b\n    d = b + 2\n    return g() + d\n",
    "def f(a, b):\n    if a:\n        c = 1\n    d = a + b\n    return c + d if a else d\n",
])
def test_code_that_is_not_straight_line_or_closes_over_locals_is_left_as_it_is(src):
    # a loop (a backward jump), a closure (a cell), a local maybe read before its store
    fn = _function(src)
    code = compact_locals(fn.__code__, threshold=0)
    if "if a:" in src:  # no local is read unbound here: renaming is still exact
        assert _compacted(fn)(1, 2) == fn(1, 2) and _compacted(fn)(0, 2) == fn(0, 2)
    else:
        assert code is fn.__code__


def test_small_functions_are_not_touched():
    fn = _function(_chain(5))
    assert compact_locals(fn.__code__) is fn.__code__  # under REUSE_FROM


def _mlp(width: int, layers: int):
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    model = nn.Sequential(*blocks, nn.Linear(width, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _batch(i, width, rows=3):
    g = torch.Generator().manual_seed(i)
    return torch.randn(rows, width, generator=g), torch.randn(rows, 2, generator=g)


def test_compacted_training_steps_run_like_eager(no_profiling, monkeypatch):
    monkeypatch.setattr(slots, "REUSE_FROM", 0)  # every entry and check is compacted
    model, opt = _mlp(4, 3)
    ref_model, ref_opt = _mlp(4, 3)
    fast = specularch.optimize(mse_train_step(model, opt))
    ref = mse_train_step(ref_model, ref_opt)
    for i, rows in enumerate([3, 3, 3, 5, 5, 3]):  # other batch sizes: guard misses
        assert fast(*_batch(i, 4, rows)) == ref(*_batch(i, 4, rows))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[q][key])
    for entry in _state_of(fast).entries:
        full = compile(entry.entry_source, "<entry>", "exec").co_consts
        full = next(c for c in full if getattr(c, "co_name", None) == "entry")
        assert entry.hits and _entry_code(entry.fn).co_nlocals < full.co_nlocals / 2


def _entry_code(fn):
    """The generated entry's code inside its wrappers (a tiered graph's current tier, the
    commit lock)."""
    while True:
        if callable(getattr(fn, "fn", None)):
            fn = fn.fn
        elif getattr(fn, "__closure__", None):
            fn = next(c.cell_contents for c in fn.__closure__ if callable(c.cell_contents))
        else:
            return fn.__code__


def test_a_big_step_is_compacted_by_default(no_profiling):
    model, opt = _mlp(2, 40)
    ref_model, ref_opt = _mlp(2, 40)
    fast = specularch.optimize(mse_train_step(model, opt))
    ref = mse_train_step(ref_model, ref_opt)
    for i in range(3):
        assert fast(*_batch(i, 2)) == ref(*_batch(i, 2))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    entry = max(_state_of(fast).entries, key=lambda e: e.hits)
    assert entry.hits and _entry_code(entry.fn).co_nlocals < slots.REUSE_FROM
