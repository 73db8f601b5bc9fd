"""Python-number graph inputs that reach a torch function: TorchScript compiles the graph per
value of them (``fx_lower/specialise.py``) instead of leaving it to fx."""
import pytest
import torch

from specularch.fx_lower import specialise

from differential import A, T, check

VALUES = [0.5, 1.0, 1.5, 0.5, 2.0, -0.0, 0.0, 3.0, 1.0, -2.5, 4.0, 0.25]


def fill_and_clamp(x, k, lr):
    # k reaches torch functions (a fill value, a bound); lr only arithmetic (a run-time input)
    return torch.clamp(x * 2, max=k) + torch.full((3,), k) * lr, torch.full((2,), k).signbit()


def _args(i):
    return A(T(3), VALUES[i], 0.1 * (i + 1))


@pytest.mark.parametrize("limit", [specialise.LIMIT, 2])
def test_number_reaching_torch_functions_is_specialised_per_value(monkeypatch, limit):
    """Every value gives eager's result bit for bit (``-0.0`` after ``0.0``'s compile too):
    a new value never reuses another's compile; past the limit, values run the fx code."""
    monkeypatch.setattr(specialise, "LIMIT", limit)
    compiled = []
    original = specialise.PerValue.add
    monkeypatch.setattr(specialise.PerValue, "add",
                        lambda self, inputs: (compiled.append(inputs[1]), original(self, inputs)))
    e = check(fill_and_clamp, _args, calls=len(VALUES), expect="graph", backend="torchscript")
    assert [g.backend for g in e.graphs] == ["torchscript"], str(e)
    # compiled at capture (the 4th call, after 3 profiled ones), then per new value, in order
    expected = [0.5, 2.0, -0.0, 0.0, 3.0, 1.0, -2.5, 4.0][:limit]
    assert list(map(repr, compiled)) == list(map(repr, expected))  # repr tells -0.0 from 0.0

def test_lr_only_in_arithmetic_stays_a_run_time_input(monkeypatch):
    """A number that only feeds arithmetic is not specialised: one compile for all values."""
    compiled = []
    monkeypatch.setattr(specialise.PerValue, "add", lambda self, inputs: compiled.append(inputs))

    def scaled(x, lr):
        return x * lr + 1

    e = check(scaled, lambda i: A(T(3), 0.1 * (i + 1)), calls=6, expect="graph", backend="torchscript")
    assert [g.backend for g in e.graphs] == ["torchscript"] and compiled == [], str(e)


def test_specialised_copy_keeps_the_signature():
    def f(x, k):
        return torch.full((2,), k) + x
    gm = torch.fx.symbolic_trace(f)
    spec = specialise.with_values(gm, {1: 7.0})
    assert torch.equal(spec(torch.ones(2), 123.0), torch.full((2,), 8.0))
    assert spec.meta["specialised"] == {1: 7.0}


def zero_d(x, lr, n):
    s = x.sum()
    t = s.clone()
    t.lerp_(s * 2, lr)  # a tensor weight must have the tensor's dtype
    return s * lr, s + n, (x > 0).sum() * lr, s.pow(n), t, s.clone().addcdiv_(s, s + 1, value=lr)


def test_numbers_meet_0d_tensors_in_eagers_dtype():
    """A run-time number input is a 0-d float64/int64 tensor in the compiled graph, and a 0-d
    float64 tensor promotes a 0-d float32 one where a Python number does not: cast to the
    op's eager dtype first, every result is eager's dtype and value (was float64)."""
    check(zero_d, lambda i: A(T(3, seed=i), 0.1 * (i + 1), i % 3 + 1), calls=6, expect="graph",
          backend="torchscript", rtol=1e-6)


def test_flattening_that_changes_an_outputs_dtype_raises():
    """The net under the cast above: a compiler is not used on a flattened graph whose
    result dtypes are not capture's (the graph stays on fx, saying why)."""
    from specularch.fx_lower._torch_compilers import flatten
    gm = torch.fx.symbolic_trace(lambda x, k: x.sum() * k)
    (x, k), (out,) = [n for n in gm.graph.nodes if n.op == "placeholder"], \
        [n for n in gm.graph.nodes if n.op == "call_function"][-1:]
    x.meta["example"], k.meta["example"] = torch.ones(3), 2.0
    out.meta["example"] = torch.tensor(6.0, dtype=torch.float16)  # what capture saw, say
    with pytest.raises(TypeError, match="output 0's dtype from torch.float16 to torch.float32"):
        flatten(gm, [torch.ones(3), 2.0], tracing_mode="fake")
