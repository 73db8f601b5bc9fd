"""`print(...)` inside an optimized function is a deferred effect: the commit prints, in program
order, after the graph ran and every check passed; strings formatted from `.item()` values and
symbolic numbers are rendered there with Python's own `format`/`str`/`repr`/`%`, so the text is
byte-identical to eager's. Differential on stdout/stderr and values; refusals keep their kind."""
import io
import sys

import pytest
import torch
from torch import nn

import specularch
from differential import A, T, check, marker_line


def _hits(opt) -> int:
    return specularch.explain(opt).stats.graph_hits


# ------------------------------------------------------------------ the training step

def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _training(make_opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = make_opt(model.parameters())
    loss_fn = nn.MSELoss()

    def train_step(i, x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if i % 5 == 0:
            print(f"step {i} loss {loss.item():.4f} ({loss.item()!r})")
        return loss
    return model, opt, train_step


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1),
                                      lambda p: torch.optim.Adam(p, lr=1e-2)], ids=["sgd", "adam"])
def test_training_step_prints_the_logged_loss_without_falling_back(make_opt, capsys):
    m_ref, o_ref, ref = _training(make_opt)
    m_fast, o_fast, fast = _training(make_opt)
    opt = specularch.optimize(fast)
    for i in range(20):
        x, y = _batch(i)
        expected = ref(i, x, y)
        eager_out = capsys.readouterr().out
        got = opt(i, x, y)
        assert capsys.readouterr().out == eager_out, f"step {i}"
        assert torch.equal(got, expected), f"step {i}"
    for p, q in zip(m_fast.parameters(), m_ref.parameters()):
        assert torch.equal(p, q)
    explanation = specularch.explain(opt)
    assert not explanation.fallbacks, explanation
    assert explanation.stats.graph_hits >= 15, explanation


# ------------------------------------------------------------------ formatting and options

def print_options(x):
    v = x.sum().item()
    print("a", 1, 2.5, None, True, v, sep=" | ", end=" <\n")
    print("no newline", end="")
    print()
    print("flushed", v, flush=True)
    print("tuple", (1, 2.0, "s"), x.shape, [v, 3], {"k": v})
    return x * 2


def print_formats(x):
    v, w = x.sum().item(), x.max().item()
    print(f"{v:.4f} {v:+.2e} {v!r} {v!s:>30} {w:10.3f}| {v!a}")
    print(str(v), repr(w), format(v, ".2%"), "%.3f / %d" % (v, 7), "%s" % w)
    print("{} and {:.1f} and {name:>8.2f}".format(v, w, name=v))
    s = "loss=" + f"{v:.3f}"
    s += "!"
    print(s, "[" + str(w) + "]")
    return x + 1


def print_in_loop(x):
    total = x.new_zeros(())
    for j in range(x.shape[0]):
        total = total + x[j].sum()
        print(j, f"row {j}: {x[j].sum().item():.3f}", total.item())
    return total


@pytest.mark.parametrize("fn", [print_options, print_formats, print_in_loop])
def test_printed_text_is_byte_identical(fn):
    check(fn, lambda i: A(T(3, 4, seed=i)), calls=6, expect="graph")


def returns_formatted(x, log):
    v = x.mean().item()
    log.append(f"mean={v:.5f}")
    return f"{v!r}", "%.2f" % v


def test_formatted_strings_can_be_returned_and_stored():
    check(returns_formatted, lambda i: A(T(4, seed=i), ["old"]), calls=6, expect="graph")


# ------------------------------------------------------------------ symbolic numbers

def print_step_counter(step, x):
    print(f"step {step:05d}", step * 2, str(step + 1), x.shape, len(x))
    return x * step


def test_symbolic_numbers_are_printed_without_specialising():
    explanation = check(print_step_counter, lambda i: A(i, T(i + 2, 3, seed=i)), calls=10,
                        expect="graph")
    assert len(explanation.graphs) == 1 and explanation.stats.graph_hits >= 6, explanation


def compares_formatted_counter(step, x):
    s = f"{step}"
    print(s)
    if s == "5":  # the text is needed now: guarded on the value, still exact
        return x + 1
    return x - 1


def test_a_formatted_symbolic_number_used_as_text_is_guarded():
    check(compares_formatted_counter, lambda i: A(i, T(3, seed=i)), calls=8, expect="graph")


# ------------------------------------------------------------------ commit order and failures

LOG = []


def print_then_speculate(x):
    print("before", x.sum().item())
    LOG.append(1)
    if x.sum() > 0:  # speculated: a side that prints cannot be merged
        print("positive")
        return x * 2
    print("negative")
    return x - 1


def test_an_assumption_failure_prints_exactly_once(capsys):
    opt = specularch.optimize(print_then_speculate)
    signs = [1, 1, 1, 1, 1, -1, 1, -1]
    for i, sign in enumerate(signs):
        x = T(3, seed=i).abs() * sign
        LOG.clear()
        expected = print_then_speculate(x)
        eager_out, eager_log = capsys.readouterr().out, list(LOG)
        LOG.clear()
        got = opt(x)
        assert capsys.readouterr().out == eager_out, f"call {i}"
        assert LOG == eager_log and torch.equal(got, expected), f"call {i}"
    stats = specularch.explain(opt).stats
    assert stats.assumption_failures == 1 and stats.graph_hits >= 1, specularch.explain(opt)


def print_to_streams(x):
    v = x.sum().item()
    print("to stderr", f"{v:.3f}", file=sys.stderr)
    print("to stdout", v, file=sys.stdout)
    print("err again", file=sys.stderr, end="!\n")
    return x * 3


def test_printing_to_stderr_and_stdout(capsys):
    opt = specularch.optimize(print_to_streams)
    for i in range(6):
        x = T(4, seed=i)
        expected = print_to_streams(x)
        eager = capsys.readouterr()
        got = opt(x)
        assert capsys.readouterr() == eager and torch.equal(got, expected), f"call {i}"
    explanation = specularch.explain(opt)
    assert not explanation.fallbacks and explanation.stats.graph_hits >= 2, explanation


# ------------------------------------------------------------------ refusals

def format_item_in_a_list(x):
    print("start")
    v = x.sum().item()
    s = f"{[v]}"  # mark
    return x + len(s)


def item_string_as_dict_key(x):
    v = x.sum().item()
    d = {f"{v:.1f}": 1}  # mark
    return x + d.get("0.0", 0)


def item_to_int(x):
    n = int(x.sum().item())  # printed by the commit (symbolic/speculation/deferred.py), and computed
    print(n)                 # in the graph for the torch op (symbolic/speculation/item_args.py)
    return x + n


def item_string_joined(x):
    v = x.sum().item()
    s = ", ".join([f"{v}", "b"])  # mark
    return x, s


def test_int_of_item_printed_and_used_in_a_torch_op_is_captured():
    check(item_to_int, lambda i: A(T(3, seed=i)), calls=5, expect="graph")


@pytest.mark.parametrize("fn", [format_item_in_a_list, item_string_as_dict_key,
                                item_string_joined])
def test_item_text_needed_in_python_falls_back_as_data_dependent(fn):
    explanation = check(fn, lambda i: A(T(3, seed=i)), calls=5, expect="fallback",
                        fallback_kind="data_dependent_value", fallback_line=marker_line(fn, "mark"))
    assert "item()" in str(explanation) or "tensor" in str(explanation)


def print_tensor_requiring_grad(x, w):
    print("w is", w)  # mark
    return x * w


def test_printing_a_tensor_falls_back_as_data_dependent():
    explanation = check(print_tensor_requiring_grad,
                        lambda i: A(T(3, seed=i), T(3, seed=9, requires_grad=True)), calls=4,
                        expect="fallback", fallback_kind="data_dependent_value",
                        fallback_line=marker_line(print_tensor_requiring_grad, "mark"))
    assert "grad_fn" in str(explanation)


SINK = io.StringIO()


class Box:
    def __str__(self):
        return "box"


def print_to_a_file(x):
    print("to a file", file=SINK)  # mark
    return x + 1


def print_an_object(x):
    print("object", Box())  # mark
    return x + 1


@pytest.mark.parametrize("fn, says", [(print_to_a_file, "sys.stdout and sys.stderr"),
                                      (print_an_object, "__str__")])
def test_other_prints_fall_back(fn, says):
    SINK.seek(0)
    SINK.truncate()
    explanation = check(fn, lambda i: A(T(3, seed=i)), calls=4, expect="fallback",
                        fallback_kind="unsupported_call", fallback_line=marker_line(fn, "mark"))
    assert says in str(explanation)
    if fn is print_to_a_file:
        assert SINK.getvalue() == "to a file\n" * 8  # eager and optimized sides, once per call
