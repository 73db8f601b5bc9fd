"""Differential programs, exceptions family: ``try``/``except``/``finally`` and ``with`` blocks
on Python context managers are captured (CPython 3.11 exception tables, see
specularch/symbolic/exceptions.py): the no-exception path, handlers taken for Python-level
raises (a ``raise``, a missing dict key, an empty list, ...), nested try, re-raise, ``finally``
writing to the heap, user ``__enter__``/``__exit__``, ``@contextmanager``, ``suppress``.
Exceptions that leave the function still run eagerly (eager raises them); an op of the graph
that raises at run time inside a ``try`` makes the call run eagerly, which takes the handler."""
import contextlib

import pytest
import torch

from differential import A, T, assert_uses_opcode, check, marker_line

pytestmark = pytest.mark.usefixtures("no_profiling")


# ------------------------------------------------------------------ the no-exception path

def try_around_safe_code(x, w):
    try:
        y = torch.relu(x @ w)
    except RuntimeError:
        y = x
    return y * 2


def test_try_around_code_that_does_not_raise_is_one_graph():
    assert_uses_opcode(try_around_safe_code, "CHECK_EXC_MATCH")
    check(try_around_safe_code, lambda: A(T(2, 3), T(3, 4)), expect="graph")


# ------------------------------------------------------------------ taken handlers

def lookup_with_default(x, table):
    try:
        scale = table["scale"]
    except KeyError:
        scale = 0.5
    return x * scale


def test_key_error_handler_taken_or_not_across_calls():
    """The key is missing on some calls only: both paths are graphs (the key's presence is
    guarded), each giving eager's answer."""
    check(lookup_with_default, lambda i: A(T(3), {"scale": 3.0} if i % 2 else {"bias": 1.0}),
          calls=4, expect="graph")


def finally_writes_heap(x, d, log):
    try:
        y = x * d["k"]
    except KeyError:
        y = x - 1
    finally:
        log.append("done")
        d["calls"] = d.get("calls", 0) + 1
    return y


def test_finally_writes_the_heap_on_both_paths():
    check(finally_writes_heap, lambda i: A(T(2), {"k": 2.0} if i % 2 else {}, []),
          calls=4, expect="graph")


def nested_try(x, items):
    try:
        try:
            first = items.pop()
        except IndexError:
            raise ValueError("empty")
        out = x * first
    except ValueError as e:
        out = x + len(e.args[0])
    return out


def test_nested_try_with_raise_in_inner_handler():
    check(nested_try, lambda i: A(T(3), [2.0] if i % 2 else []), calls=4, expect="graph")


def describe_error(x, d, i):
    try:
        v = d["a"] + [1.0, 2.0][i]
    except (KeyError, IndexError) as e:
        return x, f"{type(e).__name__}: {e}"
    return x * v, "ok"


def test_except_tuple_as_e_uses_the_message():
    args = [({"a": 1.0}, 0), ({}, 0), ({"a": 1.0}, 5), ({"a": 2.0}, 1)]
    check(describe_error, lambda i: A(T(2), *args[i]), calls=4, expect="graph")


def checked_div(x, n):
    try:
        k = 12 // n
    except ZeroDivisionError:
        k = -1
    return x * k


def test_zero_division_on_python_numbers():
    check(checked_div, lambda i: A(T(2), [3, 0, 4][i]), expect="graph")


def first_or_default(x, xs):
    it = iter(xs)
    try:
        head = next(it)
    except StopIteration:
        return x
    return x + head


def test_stop_iteration_from_next():
    check(first_or_default, lambda i: A(T(2), [T(2)] if i % 2 else []), calls=4, expect="graph")


class Invalid(Exception):
    pass


def validate(n):
    if n < 0:
        raise Invalid(f"negative: {n}")
    return n


def user_function_raises(x, n):
    try:
        k = validate(n)
    except Invalid as e:
        return x, str(e)
    return x * k, "valid"


def test_exception_raised_by_an_inlined_function_is_caught():
    check(user_function_raises, lambda i: A(T(2), [2, -3, 1][i]), expect="graph")


# ------------------------------------------------------------------ exceptions leaving the call

def reraise_in_handler(x, d):
    try:
        return x * d["k"]
    except KeyError:
        d["missed"] = True
        raise  # mark


def test_reraise_in_handler_raises_eagers_exception():
    e = check(reraise_in_handler, lambda i: A(T(2), {} if i % 2 else {"k": 3.0}), calls=4,
              expect="fallback", fallback_kind="exception_handling",
              fallback_line=marker_line(reraise_in_handler, "mark"))
    assert e.graphs, str(e)  # the path with the key is still a graph


def translate_error(x, d):
    try:
        return x * d["k"]
    except KeyError as e:
        raise LookupError(f"no {e}") from e  # mark


def test_raise_from_in_handler_raises_eagers_exception():
    check(translate_error, lambda: A(T(2), {}), expect="fallback",
          fallback_kind="exception_handling", fallback_line=marker_line(translate_error, "mark"))


def raise_escapes(x, n):
    try:
        if n > 1:
            raise ValueError(f"too big: {n}")  # mark
    except KeyError:
        return x
    return x + n


def test_raise_escaping_the_function_still_runs_eagerly():
    check(raise_escapes, lambda: A(T(2), 3), expect="fallback", fallback_kind="exception_handling",
          fallback_line=marker_line(raise_escapes, "mark"))
    check(raise_escapes, lambda: A(T(2), 1), expect="graph")


# ------------------------------------------------------------------ a graph op raising at run time

def gather_or_zeros(table, idx):
    try:
        rows = torch.index_select(table, 0, idx)
    except IndexError:
        rows = torch.zeros(idx.shape[0], table.shape[1])
    return rows * 2


def test_graph_op_raising_inside_try_reruns_eagerly_and_takes_the_handler():
    good, bad = torch.tensor([0, 2]), torch.tensor([0, 9])
    e = check(gather_or_zeros, lambda i: A(T(4, 3), bad if i == 2 else good), calls=4)
    assert e.graphs, str(e)
    assert [f.kind for f in e.fallbacks] == ["exception_handling"], str(e)
    assert e.fallbacks[0].count == 1 and "try block" in e.fallbacks[0].explanation, str(e)


def index_is_valid(table, idx):
    try:
        table[idx]  # only to see whether it raises
        valid = True
    except IndexError:
        valid = False
    return table.sum(0) if valid else torch.zeros(table.shape[1])


def test_op_kept_only_for_its_error_still_raises_in_the_graph():
    """The unused ``table[idx]`` stays in the graph (dead-code elimination would make a bad
    index return the valid-path result): the graph raises, the eager rerun takes the handler."""
    good, bad = torch.tensor([0, 2]), torch.tensor([1, 7])
    e = check(index_is_valid, lambda i: A(T(4, 3), bad if i == 1 else good), calls=3)
    assert e.graphs and [f.kind for f in e.fallbacks] == ["exception_handling"], str(e)


# ------------------------------------------------------------------ with blocks

class Counter:
    def __init__(self):
        self.entered = 0
        self.exited = 0
        self.last_error = None

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, kind, value, tb):
        self.exited += 1
        self.last_error = None if kind is None else kind.__name__
        return kind is KeyError


def with_user_manager(x, counter, d):
    with counter as c:
        x = x * (c.entered + d["k"])
    return x + counter.exited


def test_user_context_manager_enter_exit_write_attributes():
    check(with_user_manager, lambda i: A(T(2), Counter(), {"k": 1.0} if i % 2 else {}),
          calls=4, expect="graph")


@contextlib.contextmanager
def timed(log, name):
    log.append(f"start {name}")
    try:
        yield len(log)
    finally:
        log.append(f"end {name}")


def with_contextmanager(x, log):
    with timed(log, "fwd") as n:
        y = x * n
    with timed(log, "bwd"):
        y = y + 1
    return y


def test_contextmanager_helper():
    check(with_contextmanager, lambda: A(T(3), ["init"]), expect="graph")


@contextlib.contextmanager
def swallow_key_errors(log):
    try:
        yield
    except KeyError as e:
        log.append(f"swallowed {e}")


def with_contextmanager_catching(x, d, log):
    with swallow_key_errors(log):
        x = x + d["k"]
    return x


def test_contextmanager_catching_the_blocks_exception():
    check(with_contextmanager_catching, lambda i: A(T(2), {"k": 1.0} if i % 2 else {}, []),
          calls=4, expect="graph")


def with_suppress(x, d):
    with contextlib.suppress(KeyError, IndexError):
        x = x + d["missing"]
    with contextlib.nullcontext(3) as k:
        x = x * k
    return x


def test_suppress_and_nullcontext():
    check(with_suppress, lambda i: A(T(2), {"missing": 1.0} if i % 2 else {}), calls=4,
          expect="graph")


def no_grad_inside_try(x, w, d):
    try:
        with torch.no_grad():
            y = x @ w * d["k"]
    except KeyError:
        y = x @ w
    return y, x * 2


def test_no_grad_inside_try():
    check(no_grad_inside_try, lambda i: A(T(2, 2, requires_grad=True), T(2, 2),
                                          {"k": 2.0} if i % 2 else {}),
          calls=4, expect="graph", grad=True)


class Lazy:
    def __init__(self, ready):
        if ready:
            self.cache = 2.0


def cached_or_computed(x, holder):
    try:
        c = holder.cache
    except AttributeError:
        c = 1.0
        holder.cache = c + 1
    return x * c


def test_attribute_error_on_an_object_from_outside():
    """The attribute's absence is guarded: an object that has it takes the other graph."""
    check(cached_or_computed, lambda i: A(T(2), Lazy(ready=i % 2 == 1)), calls=4, expect="graph")


@torch.inference_mode()
def scaled_lookup(x, d):
    return x * d["k"]


def caught_inside_inference_decorator(x, d):
    try:
        y = scaled_lookup(x, d)
    except KeyError:
        y = x + 1  # outside inference mode again, as in eager
    return y, torch.is_inference_mode_enabled()


def test_exception_leaving_an_inference_mode_function_is_caught():
    check(caught_inside_inference_decorator, lambda i: A(T(2), {"k": 2.0} if i % 2 else {}),
          calls=4, expect="graph")


def stop_iteration_in_genexpr(x, xs):
    it = iter(xs)
    try:
        firsts = tuple(next(it) for _ in range(2))  # PEP 479: RuntimeError, not StopIteration
    except StopIteration:
        return x, "stop"
    except RuntimeError as e:
        return x, str(e)
    return x + firsts[0], "ok"


def test_stop_iteration_leaving_a_generator_expression_is_runtime_error():
    check(stop_iteration_in_genexpr, lambda i: A(T(2), [T(2)] * (i % 2 + 1)), calls=4,
          expect="graph")
