"""A TorchScript artefact (tiering worker, compile cache) loaded as a function made from its
graph's IR text (``fx_lower/_torch_script_ir.py``) instead of ``torch.jit.load``: the same
graph, the same results bit for bit, and ``torch.jit.load`` wherever the text would not give
the same graph back."""
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch import config
from specularch.api import _state_of
from specularch.fx_lower import _torch_compilers, _torch_script_ir, compile_cache
from specularch.fx_lower.passes import example_inputs

from differential import mse_train_step


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 3, 3), nn.Linear(3 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


def _step_graph():
    """The captured graph of an Adam training step of a small conv net (its backward has
    ``convolution_backward``, whose output mask is a ``bool[]`` constant)."""
    specularch.reset()
    torch.manual_seed(0)
    model = _ConvNet()
    step = specularch.optimize(mse_train_step(model, torch.optim.Adam(model.parameters())),
                               backend="fx")
    x, y = torch.randn(2, 1, 8, 8), torch.randn(2, 4)
    with config.patch(profile_calls=0):
        for _ in range(2):
            step(x, y)
    return _state_of(step).entries[0].capture.graph_module


def _copies(values):
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]


def _same_runs(a, b, inputs, calls=4):
    """``a`` and ``b`` give bit-identical outputs over ``calls`` calls (TorchScript's
    profiling executor optimises the graph on its second call)."""
    for _ in range(calls):
        outs_a, outs_b = a(*_copies(inputs)), b(*_copies(inputs))
        assert len(outs_a) == len(outs_b)
        for u, v in zip(outs_a, outs_b):
            assert torch.equal(u, v)


def test_training_step_loads_from_its_ir_text_with_identical_results(tmp_path):
    gm = _step_graph()
    scripted, meta = _torch_compilers.scripted_flattened(gm, example_inputs(gm))
    assert _torch_script_ir.function_text(scripted) is not None
    path = str(tmp_path / "step.pt")
    compile_cache.write_script(path, scripted, meta)
    loaded, meta_back = compile_cache.read_script(path)
    assert isinstance(loaded, torch.jit.ScriptFunction) and meta_back == meta
    _same_runs(_torch_compilers.run_scripted(scripted, meta),
               _torch_compilers.run_scripted(loaded, meta_back), example_inputs(gm))


class _WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor([1.5, -2.0, 0.25]))

    def forward(self, x):
        return (x * self.scale,)


def test_a_graph_its_text_cannot_give_back_is_loaded_with_torch_jit_load(tmp_path):
    frozen = torch.jit.freeze(torch.jit.script(_WithConstant()).eval())
    assert _torch_script_ir.function_text(frozen) is None  # a tensor constant: not in the text
    path = str(tmp_path / "constant.pt")
    compile_cache.write_script(path, frozen, {"converted": []})
    loaded, _ = compile_cache.read_script(path)
    assert isinstance(loaded, torch.jit.ScriptModule)
    _same_runs(frozen, loaded, [torch.randn(4, 3)])


def test_the_check_sees_a_constant_the_text_changed():
    gm = _step_graph()
    scripted, _ = _torch_compilers.scripted_flattened(gm, example_inputs(gm))
    text = _torch_script_ir.function_text(scripted)
    graph = _torch_script_ir._parsed(text)
    assert _torch_script_ir._signature(graph) == _torch_script_ir._signature(_torch_script_ir._parsed(text))
    changed = text.replace("prim::Constant[value=1]()", "prim::Constant[value=2]()", 1)
    assert changed != text
    assert _torch_script_ir._signature(_torch_script_ir._parsed(changed)) != _torch_script_ir._signature(graph)
