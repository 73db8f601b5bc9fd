"""Python-number inputs of a graph whose results need autograd (a model's ``forward(x, scale)``
optimized alone, loss and ``backward()`` eager): compiled with the numbers as 0-d tensor
inputs, once for every value: split into a forward and a backward (``fx_lower/split.py``), or
through AOT autograd where the split does not take the graph (dynamic sizes too:
``_torch_compilers.with_number_inputs``), instead of refused ("compiled without autograd but
returns tensors that need autograd"). Differential against eager: outputs, the gradients of
parameters and inputs, and what ran."""
import copy

import pytest
import torch
from torch import nn

import specularch
from specularch.fx_lower import _torch_compilers


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, scale, shift):
        h = torch.tanh(self.a(x)) * scale + shift  # a float and an int, arithmetic only
        return self.b(h) / (scale + 1.0), h.sum() * shift


@pytest.mark.parametrize("backend", ["torchscript", pytest.param("inductor", marks=pytest.mark.slow)])
def test_forward_with_number_inputs_is_compiled_once_for_every_value(backend, monkeypatch):
    """Split into a forward and a backward (``fx_lower/split.py``) with the numbers as 0-d
    tensor inputs of both: one compile serves every value."""
    from specularch.fx_lower import split
    compiles = []
    original = split._split
    monkeypatch.setattr(split, "_split", lambda *a: compiles.append(a[1]) or original(*a))
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    opt = specularch.optimize(model, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for i in range(8):
        x = torch.randn(5, 8, generator=gen, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        scale, shift = 0.5 + 0.25 * i, i % 3
        (out, total), (e_out, e_total) = opt(x, scale, shift), ref(x_ref, scale, shift)
        torch.testing.assert_close(out, e_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(total, e_total, rtol=1e-5, atol=1e-5)
        (out.square().sum() + total).backward()
        (e_out.square().sum() + e_total).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    e = specularch.explain(opt)
    assert [(g.backend, g.note) for g in e.graphs] == [(backend, "")], str(e)
    assert len(compiles) == 1  # every scale and shift after capture ran the same compile


def test_with_a_varying_batch_too_one_compile_serves_every_size_and_value():
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    opt = specularch.optimize(model, backend="torchscript")
    for i in range(10):
        x = torch.randn(3 + i, 8)
        (out, total), (e_out, e_total) = opt(x, 0.5 + i, 2), ref(x, 0.5 + i, 2)
        torch.testing.assert_close(out, e_out, rtol=1e-5, atol=1e-6)
        (out.sum() + total).backward()
        (e_out.sum() + e_total).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    (graph,) = specularch.explain(opt).graphs
    assert (graph.backend, graph.note) == ("torchscript", "")
    assert graph.sizes.startswith("compiled for every size where") and "0 call(s) outside" in graph.sizes


def test_a_compiled_form_that_changes_a_dtype_raises_on_its_first_call():
    """The guard against a number made a tensor promoting a result: the compiled form's first
    call compares its results' dtypes with capture's (raising sends the graph to fx)."""
    def f(x, s):
        return x * s
    gm = torch.fx.symbolic_trace(f)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders[0].meta["example"], placeholders[1].meta["example"] = torch.ones(2), 2.0
    (out,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    out.meta["example"] = torch.ones(2)

    def promoting(graph, inputs):  # as if the 0-d float64 number had promoted the product
        return lambda x, s: (x * s).double()
    run = _torch_compilers.with_number_inputs(gm, [torch.ones(2), 2.0], promoting)
    with pytest.raises(TypeError, match="changed output 0's dtype from torch.float32 to torch.float64"):
        run(torch.ones(2), 3.0)
    exact = _torch_compilers.with_number_inputs(gm, [torch.ones(2), 2.0], lambda g, i: g)
    assert torch.equal(exact(torch.ones(2), 3.0), torch.full((2,), 3.0))
