"""A differential sweep of the default (tiered) mode with TorchScript's candidate forced kept,
where input sizes vary from call to call (a short last batch, varying sequence lengths,
batch sizes of 1 and 2, an evaluation batch of another size): each case trains an eager twin
and the optimized model side by side, comparing after every step the outputs, every
parameter's value and ``.grad``, the buffers and the global RNG state (the harness of
``test_tiered_promotion_sweep.py``). At the end the graph(s) that run most calls must run on
``torchscript``, kept; where the graph's dynamic sizes make it compile for the sizes of most
calls only (``tiering/hot_sizes.py``), ``explain()``'s sizes line must say so and count the
calls of other sizes that ran ``fx``. No case differed from eager (results, parameters,
gradients, buffers, RNG state). It found a training forward returning ``x.size(0)`` never
promoted (fixed: ``test_forward_viewing_by_the_batch_size_and_returning_it``); and where
hotness is judged on 4 counted calls, a size that is a third of the calls can be "half" of
them (``test_batch_sizes_cycling_through_a_small_set``)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch

from promotion import Recurrent, StepTwins, Twins, adam_step, assert_promoted, classified

HOT_SIZES = "compiled for the sizes of most calls where "
EVERY_SIZE = "compiled for every size where "


def _fx_calls(graph):
    """How many calls of a graph compiled for some sizes ran ``fx`` (explain's sizes line)."""
    return int(graph.sizes.rsplit("; ", 1)[1].split(" ")[0])


# --------------------------------------------------------------------------- a short last batch


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def _loader(steps, full=8, short=3, every=4, features=8, classes=3):
    """A ``DataLoader``'s batches without ``drop_last``: ``full`` rows, every ``every``-th
    batch (the end of an epoch) ``short``."""
    g = torch.Generator().manual_seed(7)
    sizes = [short if i % every == every - 1 else full for i in range(steps)]
    return [(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))
            for n in sizes]


def test_mlp_forward_with_a_short_last_batch(promoted):
    """Batches of 8, every 4th a short one of 3 (forward optimized; loss, backward and Adam
    eager): the batch dimension becomes dynamic at the first short batch; the dynamic graph
    is compiled for batches of 8 (the sizes of most calls) and the short batches run its
    ``fx`` code."""
    twins = Twins(_MLP)
    batches = _loader(32)

    twins.run(len(batches), classified(batches))
    (graph,) = assert_promoted(twins.opt, sizes=HOT_SIZES)
    assert _fx_calls(graph) > 0, graph.sizes


def test_whole_training_step_with_a_short_last_batch(promoted):
    """The whole step (``zero_grad``, forward, loss, ``backward``, Adam, ``loss.item()``) as
    one optimized function over the same batches: losses, parameters, gradients and Adam's
    state follow eager's at every size."""
    twins = StepTwins(_MLP, lambda ps: torch.optim.Adam(ps, lr=0.01), adam_step(F.cross_entropy))
    batches = list(_loader(32))
    twins.run(batches)
    assert_promoted(twins.steps[1])


# --------------------------------------------------------------------------- batch norm, tiny batches


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.flatten(1))


def test_batch_norm_cnn_with_batches_of_one_and_two(promoted):
    """Conv2d + BatchNorm2d + pool + Linear in training over batches of 4, 4, 1, 4, 2, 4:
    running statistics and ``num_batches_tracked`` follow eager's at batches of 1 and 2
    too."""
    twins = Twins(_CNN)
    g = torch.Generator().manual_seed(3)
    sizes = [4, 4, 1, 4, 2, 4] * 5
    data = [(torch.randn(n, 2, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]

    twins.run(len(data), classified(data))
    assert_promoted(twins.opt, sizes=HOT_SIZES)
    assert twins.model.bn.num_batches_tracked.item() == len(sizes)


# --------------------------------------------------------------------------- sequence models


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("varying", ["length", "batch"])
def test_recurrent_classifier_over_varying_sizes(promoted, cell, varying):
    """An LSTM / GRU classified from ``out[:, -1]``: lengths 5, 7, 3, 6 (batch 4), or batches
    4, 6, 2, 3 (length 5). No size is most calls': the graph compiles for every size."""
    twins = Twins(lambda: Recurrent(cell))
    g = torch.Generator().manual_seed(5)
    cycle = [5, 7, 3, 6] if varying == "length" else [4, 6, 2, 3]
    shapes = [(4, n) if varying == "length" else (n, 5) for n in cycle * 6]
    data = [(torch.randn(b, t, 6, generator=g), torch.randint(0, 3, (b,), generator=g)) for b, t in shapes]

    twins.run(len(data), classified(data))
    assert_promoted(twins.opt, sizes=EVERY_SIZE)


class _CausalEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.head(self.layer(x, src_mask=mask, is_causal=True).mean(1))


def test_causal_transformer_layer_over_varying_lengths(promoted):
    """``TransformerEncoderLayer`` (dropout 0.1, ``batch_first``) with its causal mask made
    in the forward from ``x.size(1)``, lengths 6, 6, 4, 6, 9: dropout masks are eager's at
    every length (each step's seed the same on both sides)."""
    twins = Twins(_CausalEncoder)
    g = torch.Generator().manual_seed(9)
    lengths = [6, 6, 4, 6, 9] * 5
    data = [(torch.randn(3, t, 8, generator=g), torch.randint(0, 3, (3,), generator=g)) for t in lengths]

    twins.run(len(data), classified(data))
    assert_promoted(twins.opt, sizes=HOT_SIZES)


class _Bag(nn.Module):
    """Embedding, mean over the tokens a padding mask keeps, Linear."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(20, 8, padding_idx=0)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        keep = (tokens != 0).unsqueeze(-1).float()
        pooled = (self.embedding(tokens) * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.head(pooled)


def test_embedding_bag_classifier_over_padded_lengths(promoted):
    """Token batches padded to 5, 8, 3, 12 (0 is padding; the mean over the kept tokens):
    the embedding's gradient (its padding row none) is eager's. No length is most calls':
    the graph compiles for every length."""
    twins = Twins(_Bag)
    g = torch.Generator().manual_seed(11)
    lengths = [5, 8, 3, 12] * 6
    data = []
    for t in lengths:
        tokens = torch.randint(1, 20, (4, t), generator=g)
        for row in range(4):
            tokens[row, t - row:] = 0  # rows of length t, t-1, t-2, t-3
        data.append((tokens, torch.randint(0, 3, (4,), generator=g)))

    twins.run(len(data), classified(data))
    assert_promoted(twins.opt, sizes=EVERY_SIZE)


# --------------------------------------------------------------------------- sizes in Python


class _Flat(nn.Module):
    """A conv's output flattened with ``view(x.size(0), -1)``; with ``returns_size``, the
    batch returned beside it as a Python number."""

    def __init__(self, returns_size):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 3, 3), nn.Linear(3 * 4 * 4, 2)
        self.returns_size = returns_size

    def forward(self, x):
        out = self.fc(self.conv(x).relu().view(x.size(0), -1))
        return (out, x.size(0)) if self.returns_size else out


@pytest.mark.parametrize("returns_size", [False, True], ids=["view_by_the_batch", "and_the_batch"])
def test_forward_viewing_by_the_batch_size_and_returning_it(promoted, returns_size):
    """``fc(h.view(x.size(0), -1))`` over batches 4, 4, 4, 2, the batch (with
    ``returns_size``: ``x.size(0)``, each call's, a Python int) dividing the summed loss:
    compiled for batches of 4, the batch of 2 on ``fx``. With the number, the split's
    forward part returns it as a 0-d tensor; it was refused before the sizes of most calls
    were chosen (``backends._not_split`` asked ``split.refusal`` as for every size)."""
    twins = Twins(lambda: _Flat(returns_size))
    g = torch.Generator().manual_seed(13)
    sizes = [4, 4, 4, 2] * 7
    data = [(torch.randn(n, 2, 6, 6, generator=g), torch.randn(n, 2, generator=g)) for n in sizes]

    def step(net, module, adam, i):
        x, y = data[i]
        adam.zero_grad()
        out = net(x)
        out, batch = out if returns_size else (out, x.size(0))
        (F.mse_loss(out, y, reduction="sum") / batch).backward()
        adam.step()
        return out.detach(), batch, type(batch)
    twins.run(len(data), step)
    assert_promoted(twins.opt, sizes=HOT_SIZES)


class _Branches(nn.Module):
    """A different computation for sequences longer than 6."""

    def __init__(self):
        super().__init__()
        self.short, self.long = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        if x.size(1) > 6:
            return self.long(x).amax(1)
        return torch.tanh(self.short(x)).mean(1)


def test_forward_branching_on_a_size(promoted):
    """``if x.size(1) > 6`` over lengths 4, 8, 5, 10 (batch 3): two graphs, one per branch,
    each over two lengths and taking every other call; both promoted, each compiled for
    the length its count saw first (a tie at half of the 4 calls counted before it got
    hot). 48 steps: the second graph's trial takes no samples while the first one's
    candidate compiles (``Trial.call``: ``worker.pending()``), and after 32 both were
    still in their trials."""
    twins = Twins(_Branches)
    g = torch.Generator().manual_seed(17)
    lengths = [4, 8, 5, 10] * 12
    data = [(torch.randn(3, t, 4, generator=g), torch.randn(3, 3, generator=g)) for t in lengths]

    def step(net, module, adam, i):
        x, y = data[i]
        adam.zero_grad()
        out = net(x)
        F.mse_loss(out, y).backward()
        adam.step()
        return out.detach()
    twins.run(len(data), step)
    busiest = assert_promoted(twins.opt, sizes=HOT_SIZES)
    assert len(busiest) == 2, specularch.explain(twins.opt)


# --------------------------------------------------------------------------- a cycle of sizes


@pytest.mark.parametrize("cycle, hits, sizes, compiled_for", [
    ((8, 4, 8, 16), 3, HOT_SIZES, 8),
    ((4, 8, 16), 11, "compiled for the 3 commonest sizes where ", None),
    ((4, 8, 16), 3, HOT_SIZES, 4),
    (tuple(range(4, 16)), 11, EVERY_SIZE, None),
], ids=["one_size_half_the_calls", "no_majority", "no_majority_counted_over_four_calls",
        "a_new_size_every_call"])
def test_batch_sizes_cycling_through_a_small_set(promoted, cycle, hits, sizes, compiled_for):
    """Batches cycling through ``cycle`` for 36 steps, the graph hot after ``hits`` calls.
    Where one size is half the calls counted before the graph got hot (``SizeCount``: the
    calls up to the hit on which hotness is sampled, ``trial.SAMPLE``), the graph is
    compiled for it and the other sizes run ``fx`` in the same graph; with three sizes of a
    third each over 12 counted calls (hot after 11) it is compiled once for each of them
    (``SizeCount.common``), and with a new size every call (12 sizes) for every size. Hot
    after 3, only 4 calls are counted (4, 8, 16, 4): 4 is half of them, so the graph is
    compiled for batches of 4 and two thirds of the calls run ``fx``."""
    twins = Twins(_MLP)
    g = torch.Generator().manual_seed(19)
    data = [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
            for n in (list(cycle) * 12)[:36]]
    with specularch.config.patch(tier_min_hits=hits):
        twins.run(len(data), classified(data))
    (graph,) = assert_promoted(twins.opt, sizes=sizes)
    if compiled_for is not None:
        assert f"size()[0] == {compiled_for} and" in graph.sizes and _fx_calls(graph) > 0, graph.sizes
    elif sizes == EVERY_SIZE:
        (event,) = graph.tier.events
        assert "(it has dynamic sizes: 12 different sizes in 12 calls, the commonest in 1)" in \
            event.compiled_in, event
    else:  # one form per size: no call runs fx
        assert "(3 compiles, one per size)" in graph.sizes and _fx_calls(graph) == 0, graph.sizes


# --------------------------------------------------------------------------- evaluation


def test_eval_passes_under_no_grad_with_another_batch_size(promoted):
    """Training steps on batches of 8 (a short one of 3 every 4th step) and after each an
    ``eval()`` pass under ``no_grad`` on a validation batch of 5 (and of 2 every 3rd step):
    the training graph and the evaluation graph promoted, the evaluation outputs eager's and
    needing no grad."""
    twins = Twins(_CNN)
    g = torch.Generator().manual_seed(23)
    sizes = [8, 8, 8, 3] * 6
    data = [(torch.randn(n, 2, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]
    evaluation = [torch.randn(5, 2, 8, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g)]

    def step(net, module, adam, i):
        x, labels = data[i]
        module.train()
        adam.zero_grad()
        out = net(x)
        F.cross_entropy(out, labels).backward()
        adam.step()
        module.eval()
        with torch.no_grad():
            evaluated = net(evaluation[i % 3 == 2])
        return out.detach(), evaluated, evaluated.requires_grad
    twins.run(len(data), step)
    assert len(assert_promoted(twins.opt)) == 2, specularch.explain(twins.opt)
