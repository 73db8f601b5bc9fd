"""A sweep of merged ``.item()`` tests (item_args.speculated + branch_merge.merge): each case
flips early so the merged graph (torch.where on the in-graph test outcome) runs many calls
both ways; every check is differential."""
import math

import pytest
import torch
from torch import nn

from differential import A, T, check, check_module

N = 16


def alt(i):
    """True for the first calls, then alternating: the site flips at call 5."""
    return i < 5 or i % 2 == 0


def sign(i):
    return 1.0 if alt(i) else -1.0


def merged(report):
    return any("torch.where(" in g.code for g in report.graphs)


# --------------------------------------------------------------- sides of different kinds

def dtypes(v, x):
    if v.sum().item() > 0:
        return x.long()
    return x * 1.5


def test_sides_of_different_dtypes():
    check(dtypes, lambda i: A(T(3).abs() * sign(i), T(3) * 3), calls=N)


def shapes_broadcastable(v, x):
    if v.sum().item() > 0:
        return x
    return x.sum()


def test_sides_of_broadcastable_shapes():
    check(shapes_broadcastable, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def shapes_apart(v, x):
    if v.sum().item() > 0:
        return x[:2] * 2
    return x + 1


def test_sides_of_incompatible_shapes():
    check(shapes_apart, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def number_or_tensor(v, x):
    if v.sum().item() > 0:
        return 1.0
    return x.sum()


def test_a_number_on_one_side_a_tensor_on_the_other():
    check(number_or_tensor, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def numbers(v):
    if v.sum().item() > 0:
        return 1
    return 2.5


def test_int_or_float_numbers():
    check(numbers, lambda i: A(T(3).abs() * sign(i)), calls=N)


def item_arith(v, x):
    s = v.sum().item()
    if s > 0:
        return s * 2
    return s - 1


def test_item_arithmetic_on_both_sides_returns_python_floats():
    check(item_arith, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def none_side(v, x):
    if v.sum().item() > 0:
        return None
    return x * 2


def test_none_on_one_side():
    check(none_side, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def tuples(v, x):
    if v.sum().item() > 0:
        return x, x + 1
    return x - 1, x * 2


def test_tuples_of_tensors_and_the_argument_itself():
    check(tuples, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def identity(v, x):
    if v.sum().item() > 0:
        return x
    return x + 1


def test_one_side_returns_the_argument_itself():
    check(identity, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def grads(v, x):
    if v.sum().item() > 0:
        return x.sin() * 2
    return x * x


def test_gradients_through_the_merge():
    check(grads, lambda i: A(T(3).abs() * sign(i), T(3, requires_grad=True)), calls=N, grad=True)


def grad_one_side(v, x):
    if v.sum().item() > 0:
        return torch.zeros(3)
    return x * 2


def test_requires_grad_differs_between_sides():
    check(grad_one_side, lambda i: A(T(3).abs() * sign(i), T(3, requires_grad=True)), calls=N)


def divide(v, x):
    if v.item() == 0:
        return x * 0
    return 1.0 / v.item() + x


def test_the_side_not_taken_divides_by_a_zero_item():
    check(divide, lambda i: A(torch.tensor(0.0 if not alt(i) else 2.0), T(3)), calls=N)


def int_divide(v, x):
    n = v.item()
    if n == 0:
        return x * 0
    return x * (7 // n)


def test_the_side_not_taken_floor_divides_an_int_item_by_zero():
    check(int_divide, lambda i: A(torch.tensor(0 if not alt(i) else 3), T(3)), calls=N)


def sqrt_item(v, x):
    s = v.item()
    if s >= 0:
        return x * math.sqrt(s)
    return x + 1


def test_the_side_not_taken_calls_math_sqrt_on_a_negative_item():
    check(sqrt_item, lambda i: A(torch.tensor(4.0 if alt(i) else -4.0), T(3)), calls=N)


# --------------------------------------------------------------- in-place and state

def fresh_inplace(v, x):
    if v.sum().item() > 0:
        y = x.clone()
        y.add_(1)
        return y
    return x - 1


def test_in_place_on_a_fresh_tensor():
    check(fresh_inplace, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def arg_inplace(v, x):
    if v.sum().item() > 0:
        x.add_(1)
        return x
    return x - 1


def test_in_place_on_an_argument_refuses_the_merge():
    check(arg_inplace, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def one_sided(v, x):
    y = x
    if v.sum().item() > 0:
        y = x * 2
    return y + 1


def test_assignment_on_one_side():
    check(one_sided, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def randoms(v, x):
    if v.sum().item() > 0:
        return x + torch.rand(3)
    return x


def test_a_random_draw_on_one_side():
    check(randoms, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


# --------------------------------------------------------------- shapes of the test

def nested(a, b, x):
    if a.item() > 0:
        if b.item() > 0:
            return x + 1
        return x + 2
    if b.item() > 0:
        return x + 3
    return x + 4


def test_nested_merged_tests():
    check(nested, lambda i: A(torch.tensor(sign(i)), torch.tensor(1.0 if i < 7 or i % 3 else -1.0), T(3)),
          calls=20)


def loop(x, n):
    total = x * 0
    for k in range(n):
        if x[k % 3].item() > 0:
            total = total + x
        else:
            total = total - x
    return total


def test_a_merged_test_in_a_loop_of_varying_trip_count():
    check(loop, lambda i: A(T(3) if i >= 3 else T(3).abs(), 1 + i % 4), calls=N)


def compare_two(a, b, x):
    if a.sum().item() > b.sum().item():
        return x * a
    return x * b


def test_comparing_two_items():
    check(compare_two, lambda i: A(T(3) + 3 * sign(i), T(3), T(3)), calls=N)


def truth(f, x):
    if f.item():
        return x + 1
    return x - 1


@pytest.mark.parametrize("values", [
    [1.0, 0.0], [1.0, -0.0], [0.0, float("nan")], [3, 0], [-3, 0], [True, False],
], ids=["float0", "negzero", "nan", "int", "negint", "bool"])
def test_truth_tests_on_items(values):
    check(truth, lambda i: A(torch.tensor(values[0] if alt(i) else values[1]), T(3)), calls=N)


def ternary(v, x):
    return x * 2 if v.sum().item() > 0 else x - 3


def test_a_ternary():
    check(ternary, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def both(a, b, x):
    if a.item() > 0 and b.item() > 0:
        return x + 1
    return x - 1


def either(a, b, x):
    if a.item() > 0 or b.item() > 0:
        return x + 1
    return x - 1


def test_and_or_conditions():
    make = lambda i: A(torch.tensor(sign(i)), torch.tensor(1.0 if i % 3 else -1.0), T(3))  # noqa: E731
    check(both, make, calls=20)
    check(either, make, calls=20)


def negated(v, x):
    if not v.sum().item() > 0:
        return x + 1
    return x - 1


def test_not():
    check(negated, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def elifs(v, x):
    s = v.item()
    if s > 1:
        return x + 1
    elif s > 0:
        return x * 2
    else:
        return x - 1


def test_an_elif_chain():
    check(elifs, lambda i: A(torch.tensor([2.0, 0.5, -1.0][0 if i < 5 else i % 3]), T(3)), calls=20)


def validated(v, x):
    if v.sum().item() < 0:
        raise ValueError("negative")
    return x * 2


def test_a_raising_side_keeps_speculating():
    report = check(validated, lambda i: A(T(3).abs() * (-1 if i in (6, 9) else 1), T(3)), calls=N)
    assert not merged(report) and report.stats.graph_hits >= 8, report


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x, gate):
        y = self.fc(x)
        if gate.item() > 0:
            return y.relu()
        return y * 0.5


def test_a_merged_test_in_a_module_with_backward():
    check_module(Gate, lambda i: A(T(2, 3), torch.tensor(sign(i))), calls=N, grad=True)


def test_torchscript_backend():
    report = check(grads, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N, backend="torchscript")
    check(dtypes, lambda i: A(T(3).abs() * sign(i), T(3) * 3), calls=N, backend="torchscript")
    assert report is not None


def test_inductor_backend():
    check(ternary, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N, backend="inductor")


# --------------------------------------------------------------- more merged shapes

def listed(v, x):
    out = []
    if v.sum().item() > 0:
        out.append(x + 1)
    else:
        out.append(x - 1)
    return out


def test_a_local_list_appended_on_each_side():
    check(listed, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def dicts(v, x):
    if v.sum().item() > 0:
        return {"a": x + 1, "b": x.sum()}
    return {"a": x * 3, "b": x.mean()}


def test_dicts_of_tensors():
    check(dicts, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def test_shapes_change_after_the_merge():
    check(ternary, lambda i: A(T(3).abs() * sign(i), T(3 + (i > 8) * (i % 3))), calls=20)


def test_requires_grad_of_the_argument_changes_after_the_merge():
    check(ternary, lambda i: A(T(3).abs() * sign(i), T(3, requires_grad=i > 8 and i % 3 == 0)), calls=20)


def scaled(v, x):
    s = v.item()
    if s > 0:
        return x * s
    return x - s


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_item_arithmetic_with_tensors_of_other_dtypes(dtype):
    check(scaled, lambda i: A(torch.tensor(sign(i) * 1.5), T(3, dtype=dtype)), calls=N)


def scaled_int(v, x):
    n = v.item()
    if n > 0:
        return x * n
    return x - n


def test_int_item_arithmetic_with_int_tensors():
    check(scaled_int, lambda i: A(torch.tensor(int(sign(i)) * 3), T(3, dtype=torch.int64)), calls=N)


def reciprocal(v, x):
    s = v.item()
    if s != 0:
        return x + 1.0 / s
    return x * 2


def test_the_side_not_taken_divides_a_float_by_a_zero_item():
    check(reciprocal, lambda i: A(torch.tensor(2.0 if alt(i) else 0.0), T(3)), calls=N)


def ints_tie(a, b, x):
    if a.item() >= b.item():
        return x + 1
    return x - 1


def test_ties_between_two_int_items():
    check(ints_tie, lambda i: A(torch.tensor(i % 3), torch.tensor(1), T(3)), calls=N)


def no_grad_inside(v, x):
    with torch.no_grad():
        if v.sum().item() > 0:
            y = x * 2
        else:
            y = x + 1
    return y


def test_a_merge_under_no_grad_with_an_argument_requiring_grad():
    check(no_grad_inside, lambda i: A(T(3).abs() * sign(i), T(3, requires_grad=True)), calls=N)


@pytest.mark.parametrize("backend", ["torchscript", "inductor"])
def test_the_side_not_taken_raises_in_a_backend(backend):
    def pick(idx, x):
        if idx.item() < 4:
            return x[idx] * 2
        return x.sum()
    check(pick, lambda i: A(torch.tensor(1 if i % 3 else 9), T(4)), calls=12, backend=backend)
    check(int_divide, lambda i: A(torch.tensor(0 if not alt(i) else 3), T(3)), calls=12, backend=backend)


def test_the_taken_side_raises_after_the_merge():
    def pick(idx, x):
        if idx.item() < 6:
            return x[idx] * 2
        return x.sum()
    check(pick, lambda i: A(torch.tensor([1, 9, 5][0 if i < 5 else i % 3]), T(4)), calls=14)


def nan_aware(v, x):
    if not v.item() <= 0:
        return x + 1
    return x - 1


def is_nan(v, x):
    s = v.item()
    return x * 0 if s != s else x * s


def test_nan_items_in_negated_and_self_comparisons():
    vals = lambda i: torch.tensor([1.0, float("nan"), -2.0][0 if i < 5 else i % 3])  # noqa: E731
    check(nan_aware, lambda i: A(vals(i), T(3)), calls=N)
    check(is_nan, lambda i: A(vals(i), T(3)), calls=N)


W = torch.randn(3, generator=torch.Generator().manual_seed(5)).requires_grad_()


def closure_grad(v, x):
    if v.sum().item() > 0:
        return x * W
    return x + 1


def test_a_side_using_a_global_tensor_that_requires_grad():
    check(closure_grad, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)


def test_an_identity_refusal_names_the_item_test():
    report = check(identity, lambda i: A(T(3).abs() * sign(i), T(3)), calls=N)
    (record,) = [f for f in report.fallbacks if f.kind == "data_dependent_branch"]
    assert "this test on a `.item()` value" in record.explanation, record
