"""Differential programs, nn.Module family: MLP, Sequential, ModuleList and ModuleDict, a CNN with
BatchNorm in eval mode, LayerNorm with a residual, a causal attention block, LSTMCell and GRUCell
unrolled by Python loops, Embedding with slicing, nested submodules with helper methods, buffers,
weight sharing; and the state changes a module sees between calls: a Python flag attribute
(recompile), a replaced parameter, parameters updated in place, train/eval toggles. Outputs,
parameters, buffers, public attributes and (grad=True) parameter gradients are compared."""
import math

import pytest
import torch
from torch import nn

from differential import A, Pair, T, check, check_module, expect_graph

pytestmark = pytest.mark.usefixtures("no_profiling")

GRAD_TOL = dict(atol=1e-6, rtol=1e-5)


class MLP(nn.Module):
    def __init__(self, d_in=6, hidden=8, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_sequential():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 2))


class ResidualStack(nn.Module):
    def __init__(self, depth=3, d=6):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(depth)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = x + torch.tanh(layer(x)) / (i + 1)
        return x, len(self.layers)


class MultiHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.heads = nn.ModuleDict({"cls": nn.Linear(6, 3), "reg": nn.Linear(6, 1)})

    def forward(self, x, head=None):
        h = torch.relu(self.trunk(x))
        if head is not None:
            return self.heads[head](h)
        return {name: module(h) for name, module in self.heads.items()}


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = nn.functional.max_pool2d(x, 2)
        return self.fc(torch.flatten(x, 1))


def make_cnn_eval():
    m = SmallCNN()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 1.5)
    return m.eval()


class PreNormBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.ff(self.ln(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        h = self.heads
        q = self.q(x).view(b, t, h, c // h).transpose(1, 2)
        k = self.k(x).view(b, t, h, c // h).transpose(1, 2)
        v = self.v(x).view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // h)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.out(y)


class LSTMLoop(nn.Module):
    def __init__(self, d_in=3, hidden=5):
        super().__init__()
        self.hidden = hidden
        self.cell = nn.LSTMCell(d_in, hidden)
        self.proj = nn.Linear(hidden, 2)

    def forward(self, x):
        steps, batch, _ = x.shape
        h = x.new_zeros(batch, self.hidden)
        c = x.new_zeros(batch, self.hidden)
        outputs = []
        for t in range(steps):
            h, c = self.cell(x[t], (h, c))
            outputs.append(self.proj(h))
        return torch.stack(outputs), (h, c)


class GRULoop(nn.Module):
    def __init__(self, d_in=3, hidden=4):
        super().__init__()
        self.cell = nn.GRUCell(d_in, hidden)

    def forward(self, x, h):
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
        return h


class TokenModel(nn.Module):
    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.1)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.emb(tokens) + self.pos[:t]
        return self.head(x[:, :-1]), x[:, -1]


class Encoder(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.register_buffer("center", torch.linspace(-1, 1, d))
        self.scale = 0.5

    def _normalize(self, x):
        return (x - self.center) * self.scale

    def forward(self, x):
        return torch.tanh(self.inp(self._normalize(x)))


class EncoderDecoder(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.encoder = Encoder(d)
        self.decoder = nn.Linear(d, d)
        self.shared = nn.Linear(d, d)

    def _decode(self, z):
        return self.decoder(z) + self._skip(z)

    def _skip(self, z):
        return self.shared(self.shared(z))  # the same weights twice

    def forward(self, x):
        z = self.encoder(x)
        return self._decode(z), z


class SlicesAndIterators(nn.Module):
    """ModuleList / Sequential slices and nn.Module's iterator methods inside forward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = layer(x)
        for layer in self.layers[::-1]:
            x = torch.tanh(layer(x))
        x = self.seq[:2](x) + self.seq[-1:](x)
        penalty = sum(p.pow(2).sum() for p in self.parameters())
        names = [name for name, _ in self.named_parameters()]
        children = [name for name, _ in self.named_children()]
        scaled = [b * 2 for b in self.buffers()]
        return x * penalty * scaled[0], names, children, len(list(self.modules()))


def make_transformer_encoder_eval():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


MODULES = [
    (MLP, lambda: A(T(4, 6, requires_grad=True))),
    (SlicesAndIterators, lambda: A(T(2, 4))),
    (make_sequential, lambda: A(T(3, 5))),
    (ResidualStack, lambda: A(T(2, 6))),
    (make_cnn_eval, lambda: A(T(2, 2, 6, 6))),
    (PreNormBlock, lambda: A(T(2, 3, 8))),
    (CausalSelfAttention, lambda: A(T(2, 5, 8))),
    (LSTMLoop, lambda: A(T(4, 2, 3))),
    (GRULoop, lambda: A(T(5, 2, 3), T(2, 4))),
    (TokenModel, lambda: A(T(2, 6, dtype=torch.int64, low=0, high=11))),
    (EncoderDecoder, lambda: A(T(3, 6))),
]


@pytest.mark.parametrize("make_module, make_args", MODULES, ids=[m[0].__name__ for m in MODULES])
def test_module_forward_and_gradients(make_module, make_args):
    check_module(make_module, make_args, grad=True, expect="graph", **GRAD_TOL)


def test_transformer_encoder_in_eval_mode():
    """The eval fast path (``torch._transformer_encoder_layer_fwd``) under no_grad."""
    with torch.no_grad():
        check_module(make_transformer_encoder_eval, lambda: A(T(2, 5, 8)), expect="graph")


def make_partially_frozen_mlp():
    m = MLP()
    m.fc1.requires_grad_(False)
    return m


def test_partially_frozen_parameters_get_no_grad():
    check_module(make_partially_frozen_mlp, lambda: A(T(3, 6)), grad=True, expect="graph", **GRAD_TOL)


def test_module_dict_heads_selected_by_string():
    check_module(MultiHead, lambda i: A(T(2, 4), head=[None, "cls", "reg"][i]), expect="graph")
    check_module(MultiHead, lambda: A(T(2, 4)), grad=True, expect="graph", **GRAD_TOL)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.use_gate = True

    def forward(self, x):
        y = self.fc(x)
        if self.use_gate:
            y = y * torch.sigmoid(x)
        return y


def test_flag_attribute_change_recompiles():
    e = check_module(Gated, lambda: A(T(2, 4)), calls=6, expect="graph",
                     between=lambda m, i: setattr(m, "use_gate", i % 2 == 0))
    assert len(e.graphs) == 2, f"one graph per value of self.use_gate expected:\n{e}"
    assert e.stats.recompiles >= 1, str(e)


def test_replaced_parameter_is_followed():
    def replace(m, i):
        if i in (2, 4):
            m.fc.weight = nn.Parameter(torch.full_like(m.fc.weight, 0.1 * i))

    check_module(Gated, lambda: A(T(2, 4)), calls=6, expect="graph", between=replace)


def test_parameters_updated_in_place_between_calls():
    def sgd_like(m, i):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.9).add_(0.01 * i)

    check_module(MLP, lambda: A(T(3, 6)), calls=4, grad=True, expect="graph", between=sgd_like, **GRAD_TOL)


class MaxNormLinear(nn.Module):
    """Parameters constrained in place under no_grad inside forward, then used with grad: the
    gradients must still reach the parameters (they stay autograd leaves in eager)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            norms = self.fc.weight.norm(dim=1, keepdim=True).clamp(min=0.5)
            self.fc.weight.div_(norms)
            self.scale.clamp_(0.0, 2.0)
        y = self.fc(x) + self.scale  # (`+` saves no tensor that the next write would change)
        with torch.no_grad():
            self.scale.mul_(1.5)  # a second write, read again below
        return torch.cat([y, self.scale.expand(x.shape[0], 3)], 1), self.scale.requires_grad


def test_parameters_written_under_no_grad_then_read_keep_their_gradients():
    check_module(MaxNormLinear, lambda: A(T(2, 4)), calls=4, grad=True, expect="graph")


class LeakyHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def act(self, x, slope=0.1):
        return torch.where(x > 0, x, x * slope)

    def forward(self, x):
        return self.act(self.fc(x))


def test_method_defaults_assigned_after_capture_are_seen():
    saved = LeakyHelper.act.__defaults__

    def change(m, i):
        if i == 2 and type(m).act.__defaults__ == saved:  # once per class (both modules share it)
            type(m).act.__defaults__ = (0.5,)

    try:
        check_module(LeakyHelper, lambda: A(T(4, 3)), calls=4, expect="graph", between=change)
    finally:
        LeakyHelper.act.__defaults__ = saved


class ScaledChild(nn.Module):
    def forward(self, x, k=2.0):
        return x * k


class WithScaledChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = ScaledChild()

    def forward(self, x):
        return self.child(x) + 1


def test_submodule_forward_defaults_assigned_after_capture_are_seen():
    saved = ScaledChild.forward.__defaults__

    def change(m, i):
        if i == 2 and ScaledChild.forward.__defaults__ == saved:  # both modules share the class
            ScaledChild.forward.__defaults__ = (7.0,)

    try:
        check_module(WithScaledChild, lambda: A(T(2, 3)), calls=4, expect="graph", between=change)
    finally:
        ScaledChild.forward.__defaults__ = saved


def test_batchnorm_eval_graph_survives_a_train_toggle():
    """Eval calls run as graphs; one call in train mode (running stats update) must equal eager
    whatever path it takes; back in eval mode the eval graph is reused, not captured again."""
    pair = Pair.of_module(make_cnn_eval)
    args = lambda: A(T(4, 2, 6, 6))  # noqa: E731
    for _ in range(3):
        pair.step(args)
    expect_graph(pair.explain(), "SmallCNN (eval)")
    pair.apply(lambda m: m.train())
    pair.step(args)
    pair.apply(lambda m: m.eval())
    before = pair.explain()
    for _ in range(2):
        pair.step(args)
    after = pair.explain()
    assert len(after.graphs) == len(before.graphs), f"eval mode must reuse its graph:\n{after}"
    assert after.stats.graph_hits >= before.stats.graph_hits + 2, str(after)


class TrainingBranch(nn.Module):
    """No dropout: a branch on self.training alone."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            return y * 0.5
        return y.relu()


def test_training_flag_toggle_recompiles():
    e = check_module(TrainingBranch, lambda: A(T(2, 3)), calls=6, expect="graph",
                     between=lambda m, i: m.train(i % 2 == 0))
    assert len(e.graphs) == 2, str(e)


def _make_closure_program(scale, use_bias, activation):
    weight = T(4, 4, seed=21)
    bias = T(4, seed=22)

    def closure_with_flags(x):
        y = x @ weight * scale
        if use_bias:
            y = y + bias
        if activation == "tanh":
            return torch.tanh(y)
        return torch.relu(y)

    return closure_with_flags


@pytest.mark.parametrize("scale, use_bias, activation", [(2.0, True, "tanh"), (0.5, False, "relu")])
def test_function_with_closures_and_python_flags(scale, use_bias, activation):
    check(_make_closure_program(scale, use_bias, activation), lambda: A(T(3, 4)), expect="graph")


class HidesModuleMethod(nn.Module):
    """Assigns over nn.Module.zero_grad inside forward (eager: an instance attribute)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        self.zero_grad = 1
        return self.fc(x)


def test_assigning_over_a_modelled_module_method_is_an_explained_fallback():
    e = check_module(HidesModuleMethod, lambda: A(T(2, 3)), calls=3, expect="fallback",
                     fallback_kind="side_effect")
    assert not any(r.kind == "internal_error" for r in e.fallbacks)
    assert any("zero_grad" in r.explanation for r in e.fallbacks), str(e)
