"""Common ``torch.nn`` modules called with input sizes that vary from call to call: a dynamic
dimension, sizes of intermediates folded to numbers (``symbolic/static_sizes.py``) and size
tuples compared item by item (``operators._sizes_sequences``) must keep eager's results,
gradients and buffers at every size (sizes of one and two included), in a few graphs, not
one per size, and without running eagerly. Differential against an identical twin run
eagerly; ``auto`` and ``fx`` run the same fx code here (no graph gets hot in tests).

The tests at the end are minimal repros of what the sweep found, each fixed since: wrong
results (a size folded that holds only for sizes of 2 and more, the rank after a squeeze, a
Python bool computed from tensor data) and needless graphs or fallbacks (splits, min/max of
sizes, size tuples, a shrinking count of parts, type annotations)."""
from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specularch
from specularch.api import _state_of

pytestmark = pytest.mark.usefixtures("no_profiling")

BACKENDS = ("auto", "fx")
MAX_CAPTURES = 3  # the first call's static graph, then one with dynamic sizes (+1 to spare)
# "auto" folds sizes of intermediates that are fixed for dynamic sizes of at least 2
# (symbolic/static_sizes.py): a call with a dynamic size of 1 where folding read it gets a
# graph of its own, one per such dimension here (the calls have a batch of 1 and a length of 1)
SMALL_SIZE_GRAPHS = 2


# --- the differential run --------------------------------------------------------------------

@dataclass
class Case:
    """``make()`` builds a module (or returns a function); ``calls()`` gives one argument
    tuple per call, with sizes that vary. ``train=False``: eval mode under ``no_grad``."""
    make: Callable
    calls: Callable[[], list[tuple]]
    max_captures: int = MAX_CAPTURES
    train: bool = True


def _flat(out) -> list[torch.Tensor]:
    """The tensors of a (nested) tuple/list output, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _leaf(a):
    """A copy of a floating tensor that requires grad (its gradient is compared too)."""
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return a.detach().clone().requires_grad_(True)
    return a


def _grads(module, args) -> list:
    params = list(module.parameters()) if isinstance(module, nn.Module) else []
    return [t.grad for t in params + list(args) if isinstance(t, torch.Tensor) and t.requires_grad]


def _loss(out) -> torch.Tensor | None:
    losses = [t.float().square().mean() for t in _flat(out) if t.requires_grad]
    return sum(losses) if losses else None


def _same(got, want, what: str) -> None:
    """Bitwise equal (both run the same fx code); numbers compared as numbers."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:
            assert g is None and w is None, (what, i)
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"{what}[{i}]: {m}")


def _call(fn, args, seed: int):
    torch.manual_seed(seed)  # dropout draws the same numbers on both sides
    return fn(*args)


def run_case(case: Case, backend: str) -> None:
    """Optimize one of two identical modules, call both on every argument tuple; compare
    outputs, the gradients of parameters and inputs, and the buffers (BatchNorm's running
    statistics); then the number of captures and that no call ran eagerly."""
    torch.manual_seed(0)
    model, twin = case.make(), case.make()
    if isinstance(model, nn.Module):
        twin.load_state_dict(model.state_dict())
        model.train(case.train)
        twin.train(case.train)
    opt = specularch.optimize(model, backend=backend)
    for step, args in enumerate(case.calls()):
        what = f"call {step} {[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]}"
        mine, theirs = (tuple(map(_leaf, args)) if case.train else args for _ in range(2))
        with contextlib.nullcontext() if case.train else torch.no_grad():
            got, want = _call(opt, mine, step), _call(twin, theirs, step)
        _same(_flat(got), _flat(want), f"{what} output")
        if isinstance(model, nn.Module):
            model.zero_grad(set_to_none=True)
            twin.zero_grad(set_to_none=True)
        loss = _loss(got)
        if loss is not None:
            loss.backward()
            _loss(want).backward()
            _same(_grads(model, mine), _grads(twin, theirs), f"{what} grads")
        if isinstance(model, nn.Module):
            _same(list(model.buffers()), list(twin.buffers()), f"{what} buffers")
    state = _state_of(opt)
    assert state.stats.fallback_calls == 0, specularch.explain(opt)
    limit = case.max_captures + (SMALL_SIZE_GRAPHS if backend == "auto" else 0)
    assert state.stats.captures <= limit, (state.stats, specularch.explain(opt))


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _shapes(*shapes):
    """One call per shape: a random float tensor of that shape."""
    return lambda: [(_randn(*s),) for s in shapes]


def _pairs(*shapes):
    """One call per pair of shapes: two random float tensors."""
    return lambda: [(_randn(*a), _randn(*b)) for a, b in shapes]


def _tokens():
    pairs = [(3, 5), (3, 8), (2, 4), (1, 2), (4, 1), (5, 11)]
    return [(torch.randint(0, 20, (b, t), generator=torch.Generator().manual_seed(b * 31 + t)),)
            for b, t in pairs]


# batch and length (or H, W) change together at the second call: one relaxation, one graph
SEQ = [(3, 5, 8), (4, 7, 8), (2, 2, 8), (1, 6, 8), (5, 1, 8), (3, 9, 8)]
IMG = [(3, 2, 5, 6), (4, 2, 7, 5), (2, 2, 4, 4), (1, 2, 6, 9), (3, 2, 2, 3), (5, 2, 8, 8)]
RNN = [(3, 5), (6, 7), (2, 4), (1, 6), (4, 1), (7, 3)]  # (batch, length)


# --- modules ---------------------------------------------------------------------------------

class ConvHead1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(4))
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        return self.head(torch.flatten(self.body(x), 1))


class ConvFlat(nn.Module):
    """``x.view(x.size(0), -1)`` after a conv: the rows' width is fixed, the batch varies."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        h = self.conv(x).relu()
        return self.fc(h.view(h.size(0), -1))


def _padding_mask(batch, length):
    """The last key of each row padded, the first never (no row all masked)."""
    mask = torch.arange(length).expand(batch, length) >= length - 1
    mask[:, 0] = False
    return mask


class Attention(nn.Module):
    """``nn.MultiheadAttention`` from a query to keys of another length, with a key padding
    mask or not."""
    def __init__(self, batch_first, masked):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.batch_first, self.masked = batch_first, masked

    def forward(self, q, kv):
        mask = None
        if self.masked:
            mask = _padding_mask(*(kv.shape[:2] if self.batch_first else kv.shape[1::-1]))
        return self.attn(q, kv, kv, key_padding_mask=mask)


def _attention_calls(batch_first):
    """(query, keys) with batch, query length and key length varying."""
    sizes = [(3, 5, 6), (4, 7, 3), (2, 2, 9), (5, 4, 4), (1, 6, 2), (3, 9, 7)]
    def shape(batch, length):
        return (batch, length, 8) if batch_first else (length, batch, 8)
    return _pairs(*[(shape(b, t), shape(b, s)) for b, t, s in sizes])


class CausalEncoder(nn.Module):
    """``nn.TransformerEncoder`` with the causal mask made from the input's length."""
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.enc(x, mask=mask, is_causal=True)


class PaddedEncoderLayer(nn.Module):
    """An encoder layer with a key padding mask from the input's sizes (in eval under
    ``no_grad``: torch's fused fast path)."""
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x, src_key_padding_mask=_padding_mask(x.size(0), x.size(1)))


class Decoder(nn.Module):
    """A decoder layer with the causal mask made from the target's length."""
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, tgt, memory):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        return self.layer(tgt, memory, tgt_mask=mask)


class UpToSkip(nn.Module):
    """A U-Net step: down, then up to the skip's exact size (``ConvTranspose2d``'s
    ``output_size``, whose check runs ``torch.jit.annotate(list[int], [])``)."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1)

    def forward(self, x):
        return self.up(self.down(x), output_size=x.size()) + x


class QKVSplit(nn.Module):
    """GPT-style attention: the projection split into q, k, v along its fixed last dim."""
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = [h.view(b, t, 2, c // 2).transpose(1, 2) for h in self.qkv(x).split(c, dim=2)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Recurrent(nn.Module):
    """An RNN's outputs and final state; with ``state``, an initial state of the batch's size."""
    def __init__(self, rnn, state=False):
        super().__init__()
        self.rnn, self.state = rnn, state

    def forward(self, x):
        if not self.state:
            return self.rnn(x)
        batch = x.size(0) if self.rnn.batch_first else x.size(1)
        h0 = torch.ones(self.rnn.num_layers, batch, self.rnn.hidden_size) * 0.1
        return self.rnn(x, (h0, h0 * 2))


def _rnn_calls(batch_first):
    return _shapes(*[(b, t, 4) if batch_first else (t, b, 4) for b, t in RNN])


class Embed(nn.Module):
    """Token embeddings, with learnt positions (``arange`` of the length) or not, then a mean
    over the length."""
    def __init__(self, positions):
        super().__init__()
        self.tok, self.pos, self.fc = nn.Embedding(20, 6), nn.Embedding(16, 6), nn.Linear(6, 3)
        self.positions = positions

    def forward(self, tokens):
        h = self.tok(tokens)
        if self.positions:
            h = h + self.pos(torch.arange(tokens.size(1)))
        return self.fc(h.mean(1))


class Upsampled(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.down = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.how = how

    def forward(self, x):
        h = self.conv(x)
        if self.how == "module":
            return self.up(h)
        if self.how == "bilinear":
            return F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        if self.how == "size":
            return F.interpolate(h, size=(h.size(2) * 2, h.size(3) + 1))
        # U-Net: the downsampled map back to the skip connection's size
        return F.interpolate(self.down(x), size=x.shape[2:]) + h


class NormShuffle(nn.Module):
    """Conv (``padding="same"``), GroupNorm, PixelShuffle, AvgPool2d with ``ceil_mode``."""
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, padding="same"), nn.GroupNorm(2, 4),
                                  nn.PixelShuffle(2), nn.AvgPool2d(2, ceil_mode=True))

    def forward(self, x):
        return self.body(x)


class Unfolded(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.unfold = nn.Unfold(kernel_size=2, stride=1)

    def forward(self, x):
        return self.unfold(self.conv(x)).transpose(1, 2)


class Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x).transpose(1, 2)  # (B, 4, T)
        return F.pad(h, (1, 2)) + F.pad(h, (2, 1), mode="replicate")


class WithToken(nn.Module):
    """A learnt token prepended to every sequence (the batch varies), and a fixed row cat
    along the batch."""
    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.cat([self.token.expand(x.size(0), -1, -1), self.fc(x)], dim=1)
        return torch.cat([h, self.token.expand(1, h.size(1), 4)], dim=0)


class CrossEntropy(nn.Module):
    """A loss over every token, targets made from the sizes, one class ignored."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        logits = self.fc(x)
        target = torch.arange(x.size(0) * x.size(1)) % 5
        return F.cross_entropy(logits.view(-1, logits.size(-1)), target, ignore_index=3)


def compare_shapes(x, y):
    """Python decides on a slice of two size tuples and on the whole tuples."""
    out = x.sum(0) * 2
    if x.shape[1:] == y.shape[1:]:
        out = out + y.sum(0)
    if x.size() != y.size():
        out = out * 3
    return out


def _seq(*pairs, width=4):
    return _shapes(*[(b, t, width) for b, t in pairs])


CASES = {
    "conv1d_pool_linear": Case(ConvHead1d, _shapes((4, 3, 10), (6, 3, 13), (2, 3, 8), (1, 3, 9),
                                                   (5, 3, 4), (3, 3, 16))),
    "conv2d_batchnorm_maxpool": Case(lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1),
                                                           nn.BatchNorm2d(4), nn.ReLU(),
                                                           nn.MaxPool2d(2)),
                                     _shapes((4, 2, 8, 8), (6, 2, 10, 6), (2, 2, 6, 12),
                                             (3, 2, 7, 9), (1, 2, 12, 12), (2, 2, 8, 5))),
    "conv_view_flat": Case(ConvFlat, _shapes(*[(b, 2, 6, 6) for b in (4, 6, 2, 1, 9, 3)])),
    "mha_batch_first": Case(lambda: Attention(True, False), _attention_calls(True)),
    "mha_seq_first": Case(lambda: Attention(False, False), _attention_calls(False)),
    "mha_batch_first_padding_mask": Case(lambda: Attention(True, True), _attention_calls(True)),
    "mha_seq_first_padding_mask": Case(lambda: Attention(False, True), _attention_calls(False)),
    "transformer_encoder_layer": Case(lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                                                         batch_first=True),
                                      _shapes(*SEQ)),
    "transformer_encoder_layer_dropout": Case(lambda: nn.TransformerEncoderLayer(
        8, 2, 16, dropout=0.25, batch_first=True), _shapes(*SEQ)),
    "transformer_encoder_layer_eval_padding_mask": Case(PaddedEncoderLayer, _shapes(*SEQ),
                                                        train=False),
    "transformer_encoder_causal": Case(CausalEncoder, _shapes(*SEQ)),
    "transformer_decoder_layer": Case(Decoder, _attention_calls(True)),
    "gru_bidirectional_2_layers": Case(lambda: Recurrent(nn.GRU(4, 5, num_layers=2, bidirectional=True,
                                                                batch_first=True)), _rnn_calls(True)),
    "lstm_proj_size": Case(lambda: Recurrent(nn.LSTM(4, 6, proj_size=3)), _rnn_calls(False)),
    "lstm_given_state": Case(lambda: Recurrent(nn.LSTM(4, 5, num_layers=2, batch_first=True), state=True),
                             _rnn_calls(True)),
    # the batch stays at the second call: the length is relaxed first, the batch at the third
    "embedding_mean": Case(lambda: Embed(False), _tokens),
    "embedding_positions": Case(lambda: Embed(True), _tokens),
    "layer_norm": Case(lambda: nn.LayerNorm(8), _shapes(*SEQ)),
    "group_norm_pixel_shuffle_avg_pool": Case(NormShuffle, _shapes(*IMG)),
    "upsample_module": Case(lambda: Upsampled("module"), _shapes(*IMG)),
    "interpolate_bilinear": Case(lambda: Upsampled("bilinear"), _shapes(*IMG)),
    "interpolate_size_from_sizes": Case(lambda: Upsampled("size"), _shapes(*IMG)),
    "interpolate_to_skip_size": Case(lambda: Upsampled("skip"), _shapes(*IMG)),
    "unfold": Case(Unfolded, _shapes(*IMG)),
    "pad": Case(Padded, _seq(*RNN)),
    "cat_with_fixed": Case(WithToken, _seq(*RNN)),
    "cross_entropy": Case(CrossEntropy, _shapes(*SEQ)),
    # One graph per outcome of the two branches (3 outcomes) after the static first graph;
    # `x.size() != y.size()` of two inputs is one guard (its outcome), not one per item
    "compare_shapes": Case(lambda: compare_shapes,
                           _pairs(((3, 4), (5, 4)), ((6, 5), (2, 5)), ((3, 5), (3, 5)),
                                  ((4, 7), (4, 7)), ((2, 3), (2, 6)), ((1, 2), (5, 3)),
                                  ((6, 2), (6, 2)), ((2, 5), (7, 5))), max_captures=4),
    "attention_qkv_split": Case(QKVSplit, _shapes(*SEQ)),
    "conv_transpose_to_skip_size": Case(UpToSkip, _shapes(*IMG)),
}

@pytest.mark.parametrize("name, backend", [
    pytest.param(name, backend, id=f"{name}-{backend}") for name in CASES for backend in BACKENDS])
def test_module_over_varying_sizes(name, backend):
    run_case(CASES[name], backend)


# --- minimal repros of what the sweep found --------------------------------------------------

def _differential(fn, backend, shapes):
    """``fn`` optimized, called on a random tensor of each shape, compared with eager."""
    opt = specularch.optimize(fn, backend=backend)
    for shape in shapes:
        x = _randn(*shape)
        torch.testing.assert_close(opt(x), fn(x), rtol=0, atol=0, msg=lambda m: f"{shape}: {m}")
    return opt


def _chunk_input(x):
    a, b = x.chunk(2, -1)
    return a * b


def _split_intermediate(x):
    a, b = (x * 2).split(4, dim=-1)
    return a * b


def _unpack(x):
    q, k, v = (x * 2).view(x.size(0), x.size(1), 3, 4).permute(2, 0, 1, 3)
    return q + k * v


@pytest.mark.parametrize("fn, width", [(_chunk_input, 8), (_split_intermediate, 8), (_unpack, 12)])
def test_a_split_along_a_fixed_dim_keeps_one_graph(fn, width):
    """The number of parts depends on the split dim's size only (fixed here); the batch and
    length vary. Every size of the split tensor used to be fixed (guarded, or asserted in the
    graph for an intermediate, which then failed at the next size: 'dynamic sizes made static
    again'): a graph per shape. Now only the split dimension's."""
    opt = _differential(fn, "auto", [(b, t, width) for b, t in RNN])
    assert _state_of(opt).stats.captures <= 2 + SMALL_SIZE_GRAPHS, specularch.explain(opt)
    assert not specularch.explain(opt).fallbacks and not any(
        "static again" in r for r in specularch.explain(opt).relaxations)


def _squeezed_width(x):
    y = (x * 2).squeeze(0)  # (T, 3, 4) -> itself, or (3, 4) when T is 1
    return y.sum(0) * y.size(1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_size_fixed_only_for_sizes_above_one_is_not_folded(backend):
    """The fake run's symbols are at least 2, where squeeze(0) keeps the dimension: the
    folded graph is guarded to sizes of 2 and more, and T == 1 gets a graph of its own."""
    _differential(_squeezed_width, backend, [(3, 3, 4), (5, 3, 4), (2, 3, 4), (1, 3, 4)])


def _squeezed_rank(x):
    y = x.squeeze(1)
    return y * 2, y.dim()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_rank_after_squeezing_a_dynamic_dim_follows_its_size(backend):
    """Whether the squeezed size is 1 is guarded (or checked in the graph): a size of 1 is
    captured again, so `y.dim()` is eager's."""
    _differential(_squeezed_rank, backend, [(2, 3), (2, 5), (2, 1)])


def _unbound(x):
    return torch.stack([t * i for i, t in enumerate((x * 2).unbind(1))], 1)


def test_a_count_of_parts_that_shrinks_is_a_failed_assumption():
    """The number of parts steers Python (a list comprehension over them): a graph per
    length is expected; a fallback as if the graph were wrong is not. The graph indexed
    the captured count of parts before its size check ran and raised IndexError
    (``backend_error``, every call of that size); a graph that raises while it assumed a
    size now fails that assumption."""
    opt = _differential(_unbound, "fx", [(2, 3), (2, 5), (2, 4), (2, 4)])
    kinds = [f.kind for f in specularch.explain(opt).fallbacks]
    assert kinds == ["assumption_failed"], specularch.explain(opt)


def _unequal_sizes(x, y):
    return x * 2 if x.size() != y.size() else x * 3


def test_a_size_tuple_unequal_at_any_item_is_one_outcome():
    """Sizes of inputs compared whole are one guard (``(L['x'].shape[0], ...) == (...)``):
    "unequal at item 0" and "equal at 0, unequal at 1" were two guard sets, two graphs."""
    opt = specularch.optimize(_unequal_sizes)
    for a, b in [((4, 3), (4, 5)), ((6, 2), (6, 7)), ((2, 3), (5, 4)), ((3, 3), (1, 2))]:
        x, y = _randn(*a), _randn(*b)
        torch.testing.assert_close(opt(x, y), _unequal_sizes(x, y), rtol=0, atol=0)
    assert _state_of(opt).stats.captures == 2, specularch.explain(opt)  # static, then dynamic


def _equal_branch(x, y):
    return x + 1 if torch.equal(x, y) else x - 1


def _left_aligned_branch(mask):
    aligned = torch._nested_tensor_from_mask_left_aligned(torch.zeros(*mask.shape, 4), mask)
    return mask * 2 if aligned else mask * 3


@pytest.mark.parametrize("fn, calls", [
    (_equal_branch, [(torch.ones(3), torch.ones(3)), (torch.ones(3), torch.zeros(3))]),
    (_left_aligned_branch, [(torch.tensor([[True, True, False], [True, False, False]]),),
                            (torch.tensor([[False, True, True], [True, False, False]]),)])],
    ids=["torch_equal", "nested_left_aligned"])
def test_a_python_bool_from_tensor_data_is_not_kept_as_a_constant(fn, calls):
    """A kernel's Python result from tensor values (torch.equal, allclose, the nested-tensor
    mask check of nn.TransformerEncoder in eval) cannot be guarded: the call runs eagerly."""
    opt = specularch.optimize(fn, backend="fx")
    for args in calls:
        torch.testing.assert_close(opt(*args), fn(*args), rtol=0, atol=0)


def _max_of_size(x):
    return torch.zeros(max(x.size(1) - 1, 1)) + x.sum()


def _min_of_size(x):
    return x[:, :min(x.size(1), 4)] * 2


# the static first graph, then one per outcome: max(t - 1, 1) is t - 1 for every t here;
# min(t, 4) is 4, and t at t == 2
@pytest.mark.parametrize("fn, captures", [(_max_of_size, 2), (_min_of_size, 3)])
def test_min_and_max_of_sizes_keep_a_graph_per_outcome(fn, captures):
    """Decided by the comparison (guarded), not by each item's value: a graph per size
    before (library/builtins._minmax specialised every item)."""
    opt = _differential(fn, "auto", [(3, t) for t in (5, 7, 2, 9, 6, 8)])
    assert _state_of(opt).stats.captures == captures, specularch.explain(opt)


def _annotated(x):
    sizes = torch.jit.annotate(list[int], [])
    pairs = torch.jit.annotate(typing.List[typing.Tuple[int, int]], [])
    for d in range(x.dim()):
        sizes.append(x.size(d))
        pairs.append((d, x.size(d)))
    return x.sum() * len(sizes) + len(pairs)


def test_type_annotations_are_made_as_python_makes_them():
    """``list[int]``, ``typing.List[...]`` and ``torch.jit.annotate`` (the U-Net's
    ``output_size`` check ran eagerly: 'subscript of a type')."""
    opt = _differential(_annotated, "auto", [(2, 3), (4, 5)])
    assert not specularch.explain(opt).fallbacks
