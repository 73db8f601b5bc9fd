"""A differential sweep of the default (tiered) mode with TorchScript's candidate forced kept:
each case trains an eager twin and the optimized model side by side for a few dozen steps of
a typical training pattern, comparing after every step the outputs, every parameter's value
and ``.grad``, the buffers, the Python-visible state (attributes the forward stores, whether
outputs require grad or are views, what they alias) and the global RNG state; at the end
every graph of the case must run on ``torchscript``, kept (``NotPromoted`` says why not,
from ``explain()``). It found a saved output the program changed in place that the compiled
form did not see (``glue.py``) and graphs taking every other call that never got hot
(``tiering/trial.py``)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from promotion import Recurrent, StepTwins, Twins, adam_step, assert_promoted, classified

STEPS = 24


def _views(outputs):
    """Which outputs are views, and which share storage with which (the aliasing a user sees)."""
    storages = [t.untyped_storage().data_ptr() for t in outputs]
    return [t._base is not None for t in outputs], [storages.index(s) for s in storages]


# --------------------------------------------------------------------------- dropout, eval


class _DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16),
                                 nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def _dropout_with_evaluation(evaluations):
    """A training step with dropout, then ``evaluations`` ``eval()`` passes under ``no_grad``."""
    torch.manual_seed(1)
    x, y, x_eval = torch.randn(6, 8), torch.randn(6, 3), torch.randn(5, 8)

    def step(net, module, adam, i):
        module.train()
        adam.zero_grad()
        out = net(x)
        F.mse_loss(out, y).backward()
        adam.step()
        module.eval()
        with torch.no_grad():
            evaluated = [net(x_eval + k) for k in range(evaluations)]
        return out.detach(), out.requires_grad, evaluated, [t.requires_grad for t in evaluated]
    return step


def test_dropout_mlp_training_with_eval_passes_under_no_grad(promoted):
    """Dropout in train mode (each step's seed the same on both sides: the masks must be
    eager's exactly), and after each step two ``eval()`` passes under ``no_grad`` (a
    validation set of two batches): the training graph and the evaluation graph promoted."""
    twins = Twins(_DropoutMLP)
    twins.run(32, _dropout_with_evaluation(2))
    assert_promoted(twins.opt)




def test_dropout_mlp_alternating_one_training_step_and_one_eval_pass(promoted):
    """One training step, one ``eval()`` pass under ``no_grad``, alternating strictly."""
    twins = Twins(_DropoutMLP)
    twins.run(32, _dropout_with_evaluation(1))
    assert_promoted(twins.opt)


# --------------------------------------------------------------------------- batch norm


class _SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn2 = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc, self.bn1 = nn.Linear(4 * 4 * 4, 8), nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn2(self.conv(x))), 2)
        return self.head(F.relu(self.bn1(self.fc(h.flatten(1)))))


def test_batch_norm_cnn_switching_between_train_and_eval(promoted):
    """BatchNorm2d and BatchNorm1d: running statistics and ``num_batches_tracked`` follow
    eager's in training steps, and the evaluation passes after each (``eval()``, without
    ``no_grad``: the outputs still require grad) use them."""
    twins = Twins(_SmallCNN)
    torch.manual_seed(1)
    x, labels, x_eval = torch.randn(4, 2, 8, 8), torch.randint(0, 3, (4,)), torch.randn(3, 2, 8, 8)

    def step(net, module, adam, i):
        module.train()
        adam.zero_grad()
        out = net(x)
        F.cross_entropy(out, labels).backward()
        adam.step()
        module.eval()
        evaluated = [net(x_eval), net(x_eval.flip(0))]
        return out.detach(), [t.detach() for t in evaluated], [t.requires_grad for t in evaluated]
    twins.run(32, step)
    assert_promoted(twins.opt)
    assert twins.model.bn2.num_batches_tracked.item() == 32


# --------------------------------------------------------------------------- views


class _Gaussian(nn.Module):
    """A VAE-like head: mean and log-variance sliced from one layer's output, plus the
    hidden state and a view of it."""

    def __init__(self):
        super().__init__()
        self.enc, self.head = nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x):
        hidden = torch.tanh(self.enc(x))
        h = self.head(hidden)
        return h[:, :2], h[:, 2:], hidden, hidden[:, 0]


def test_tuple_of_views_of_an_intermediate_and_of_an_output(promoted):
    """``h[:, :k]``, ``h[:, k:]`` (views of a value not returned) and ``hidden``,
    ``hidden[:, 0]`` (a view of an output): which are views and what shares storage is
    eager's, and the gradients through all four match."""
    twins = Twins(_Gaussian)
    torch.manual_seed(1)
    x = torch.randn(5, 8)

    def step(net, module, adam, i):
        adam.zero_grad()
        outs = net(x)
        mean, logvar, hidden, pooled = outs
        (mean.pow(2).mean() + logvar.exp().mean() + hidden.sum() * 0.1 + pooled.pow(2).sum()).backward()
        adam.step()
        return [t.detach() for t in outs], [t.requires_grad for t in outs], _views(outs)
    twins.run(STEPS, step)
    assert_promoted(twins.opt)


# --------------------------------------------------------------------------- Python state


class _Remembers(nn.Module):
    """Stores its hidden state, detached, on ``self`` (for a later look, as a hook would)."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.last = h.detach()
        return self.out(h)


def test_forward_storing_a_detached_tensor_on_self(promoted):
    """``self.last = h.detach()`` is eager's after every call: its value, no grad, a view
    (of a value the forward does not return) as eager's is."""
    twins = Twins(_Remembers)
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def step(net, module, adam, i):
        adam.zero_grad()
        out = net(x)
        F.mse_loss(out, y).backward()
        adam.step()
        last = module.last
        return out.detach(), last, last.requires_grad, last._base is not None, last.is_contiguous()
    twins.run(STEPS, step)
    assert_promoted(twins.opt)


class _Sized(nn.Module):
    """Returns its output with Python numbers taken from the input's sizes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(x), x.shape[0] * x.shape[1], x.size(0) / 4.0


def test_forward_returning_python_numbers_from_sizes(promoted):
    """An int and a float computed from sizes come back as Python numbers of eager's
    values (the float scales the loss)."""
    twins = Twins(_Sized)
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def step(net, module, adam, i):
        adam.zero_grad()
        out, count, scale = net(x)
        (F.mse_loss(out, y) * scale).backward()
        adam.step()
        return out.detach(), count, scale
    twins.run(STEPS, step)
    assert_promoted(twins.opt)


class _Counts(_Remembers):
    """Counts its calls on ``self`` (a step counter, as schedules and logging keep)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.out(torch.tanh(self.fc(x)))


def test_forward_counting_its_calls_on_self(promoted):
    """``self.calls += 1`` in the forward: the counter is eager's after every call. The new
    count is a Python number the graph computes beside results that need autograd: the
    split's forward part returns it as a 0-d tensor and the glue makes it a number again
    (refused before: "returns Python numbers computed inside the graph")."""
    twins = Twins(_Counts)
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def step(net, module, adam, i):
        adam.zero_grad()
        out = net(x)
        F.mse_loss(out, y).backward()
        adam.step()
        return out.detach(), module.calls, type(module.calls)
    twins.run(STEPS, step)
    assert_promoted(twins.opt)


class _Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, temperature):
        return F.log_softmax(self.fc2(torch.relu(self.fc1(x))) / temperature, dim=-1)


def test_forward_taking_a_python_float_that_varies_per_call(promoted):
    """A temperature that changes every step: each call's value is used (not the first
    one compiled in)."""
    twins = Twins(_Tempered)
    torch.manual_seed(1)
    x, labels = torch.randn(6, 8), torch.randint(0, 4, (6,))

    def step(net, module, adam, i):
        adam.zero_grad()
        out = net(x, 0.5 + 0.3 * (i % 7))
        F.nll_loss(out, labels).backward()
        adam.step()
        return out.detach()
    twins.run(30, step)
    assert_promoted(twins.opt)


# --------------------------------------------------------------------------- gradient penalty


class _Critic(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc, self.drop, self.out = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.fc(x))))


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_gradient_penalty_with_create_graph(promoted, p):
    """A WGAN-GP-like critic step: ``autograd.grad(create_graph=True)`` w.r.t. the input,
    the penalty's gradient w.r.t. the weights (a double backward through the promoted
    graph, replaying dropout's mask where there is one)."""
    twins = Twins(lambda: _Critic(p))
    torch.manual_seed(1)
    x = torch.randn(5, 8)

    def step(net, module, adam, i):
        adam.zero_grad()
        x_ = x.clone().requires_grad_()
        out = net(x_)
        (gx,) = torch.autograd.grad(out.sum(), [x_], create_graph=True)
        penalty = (gx.norm(2, dim=1) - 1).pow(2).mean()
        (out.mean() + 10 * penalty).backward()
        adam.step()
        return out.detach(), gx.detach(), gx.requires_grad, x_.grad
    twins.run(30, step)
    assert_promoted(twins.opt)


# --------------------------------------------------------------------------- sequence models


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_recurrent_classifier_on_the_last_step(promoted, cell):
    """An LSTM / GRU over fixed-size sequences, classified from ``out[:, -1]``."""
    twins = Twins(lambda: Recurrent(cell))
    torch.manual_seed(1)
    x, labels = torch.randn(4, 5, 6), torch.randint(0, 3, (4,))

    twins.run(STEPS, classified([(x, labels)]))
    assert_promoted(twins.opt)


class _Cell(nn.Module):
    """A recurrent cell the caller unrolls: ``(x, h) -> (output, new h)``."""

    def __init__(self):
        super().__init__()
        self.i2h, self.h2h, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x, h):
        h = torch.tanh(self.i2h(x) + self.h2h(h))
        return self.out(h), h


def test_recurrent_cell_unrolled_by_the_caller_with_truncated_backpropagation(promoted):
    """Two cell calls per step, the state carried over detached between steps: the first
    call's ``h`` needs no grad, the second's does (two graphs, alternating); states,
    losses and gradients are eager's."""
    twins = Twins(_Cell)
    torch.manual_seed(1)
    xs, ys = torch.randn(4, 3, 4), torch.randn(4, 3, 2)
    states = {}

    def step(net, module, adam, i):
        h = states.get(id(module), torch.zeros(3, 6))
        adam.zero_grad()
        loss = 0
        for t in range(2):
            out, h = net(xs[(i + t) % 4], h)
            loss = loss + F.mse_loss(out, ys[(i + t) % 4])
        loss.backward()
        adam.step()
        states[id(module)] = h.detach()
        return h.detach(), loss.detach()
    twins.run(30, step)
    assert_promoted(twins.opt)


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


def test_transformer_encoder_layer_classifier_with_dropout(promoted):
    """``nn.TransformerEncoderLayer`` (dropout 0.1, ``batch_first``) in training: its
    attention and dropout masks are eager's."""
    twins = Twins(_Encoder)
    torch.manual_seed(1)
    x, labels = torch.randn(3, 5, 8), torch.randint(0, 3, (3,))

    twins.run(STEPS, classified([(x, labels)]))
    assert_promoted(twins.opt)


class _TiedLM(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embedding.weight

    def forward(self, tokens):
        return self.decoder(torch.tanh(self.mix(self.embedding(tokens))))


def test_weight_tied_language_model(promoted):
    """``decoder.weight = embedding.weight``: one parameter, its gradient the sum of both
    uses, updated once, still shared after every step."""
    twins = Twins(_TiedLM)
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, 11, (3, 6)), torch.randint(0, 11, (3, 6))

    def step(net, module, adam, i):
        adam.zero_grad()
        logits = net(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        adam.step()
        return logits.detach(), module.decoder.weight is module.embedding.weight
    twins.run(STEPS, step)
    assert_promoted(twins.opt)


# --------------------------------------------------------------------------- training loops


def test_whole_training_step_optimized_as_a_function(promoted):
    """``zero_grad``, forward, loss, ``backward``, Adam's ``step`` and ``loss.item()`` as
    one optimized function: losses, parameters, gradients and Adam's state follow eager's."""
    twins = StepTwins(_DropoutMLP, lambda ps: torch.optim.Adam(ps, lr=0.01), adam_step(F.mse_loss))
    torch.manual_seed(1)
    x, y = torch.randn(6, 8), torch.randn(6, 3)
    twins.run([(x, y)] * STEPS)
    assert_promoted(twins.steps[1])


def test_gradient_accumulation_with_evaluation_in_between(promoted):
    """Two forwards with one ``backward`` each, then one Adam step; between them an
    evaluation pass under ``no_grad`` (train mode kept: dropout draws there too)."""
    twins = Twins(_DropoutMLP)
    torch.manual_seed(1)
    xs, ys = torch.randn(2, 4, 8), torch.randn(2, 4, 3)
    x_eval = torch.randn(3, 8)

    def step(net, module, adam, i):
        adam.zero_grad()
        first = net(xs[0])
        (F.mse_loss(first, ys[0]) / 2).backward()
        grads = [p.grad.clone() for p in module.parameters()]
        with torch.no_grad():
            evaluated = net(x_eval)
        second = net(xs[1])
        (F.mse_loss(second, ys[1]) / 2).backward()
        adam.step()
        return first.detach(), second.detach(), evaluated, grads
    twins.run(32, step)
    assert_promoted(twins.opt)


# --------------------------------------------------------------------------- callers' in-place ops


class _Outputs(nn.Module):
    """``linear``: a final Linear (its output is not saved for the backward); ``tanh``: a
    tanh output (saved: eager's backward raises once it is changed in place); ``view``:
    a Linear's output and a view of it; ``halves``: two views of a value not returned."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(x)))
        if self.kind == "tanh":
            return torch.tanh(h)
        if self.kind == "view":
            return h, h[:, 1:]
        if self.kind == "halves":
            return h[:, :2], h[:, 2:]
        return h


def _in_place_step(kind, x, y):
    def step(net, module, adam, i):
        adam.zero_grad()
        out = net(x)
        if kind == "view":
            hidden, tail = out
            tail.mul_(2)  # (writes into hidden too)
            loss = F.mse_loss(hidden, y) + tail.sum()
            seen = (hidden.detach().clone(), tail._base is not None, tail.grad_fn is not None)
        elif kind == "halves":
            first, second = out
            first.mul_(2)
            loss = first.pow(2).sum() + (first.sum(1, keepdim=True) * second).sum()
            seen = (first.detach().clone(), second.detach().clone(), _views(out))
        else:
            out.mul_(2)
            loss = F.mse_loss(out, y)
            seen = (out.detach().clone(), out.requires_grad)
        try:
            loss.backward()
        except RuntimeError as e:
            return seen, type(e).__name__, str(e).split("[")[0]
        adam.step()
        return seen, None, None
    return step


@pytest.mark.parametrize("kind", ["linear", "view", "halves", "tanh"])
def test_caller_changing_outputs_in_place(promoted, kind):
    """The caller multiplies an output in place before the loss: where eager's backward
    works (a Linear's output, a view of one) so must the optimized model's, with eager's
    gradients; where eager's raises (tanh saved its output) the optimized one raises too
    (it did not: the glue saved a copy of the output the compiled forward returned twice,
    whose version the caller's write did not change, and the backward read the old value)."""
    twins = Twins(lambda: _Outputs(kind))
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    twins.run(STEPS, _in_place_step(kind, x, y))
    assert_promoted(twins.opt)
