"""Adversarial differential sweep of ``torch.nn`` layers and functional ops whose input sizes
change on every call (docs/semantics.md "Relaxation: dynamic sizes and changing state").

Tiny modules built from standard layers (convolutions with stride / ``padding="same"`` /
dilation / groups / padding modes, transposed convolutions with ``output_padding`` and
``output_size``, pools with ``ceil_mode`` / ``count_include_pad``, adaptive pools, ``Upsample`` /
``F.interpolate`` with sizes computed from ``x.shape``, batch / layer / RMS / group / instance
norms, ``Embedding`` / ``EmbeddingBag`` with changing offsets, LSTM / GRU / RNN (bidirectional,
two layers, with and without a state, over ``pack_padded_sequence``), cells stepped over the
length, ``nn.MultiheadAttention`` and ``TransformerEncoderLayer`` with masks,
``scaled_dot_product_attention``, reshapes (``view(x.size(0), -1)``, ``reshape(b, t, -1)``,
``Flatten`` / ``Unflatten``, ``PixelShuffle``, ``unfold`` / ``fold``), ``F.pad`` with pads computed
from sizes, masks built from lengths, ``torch.cat`` of parts of varying length, and losses
(``cross_entropy`` with ``ignore_index`` / ``label_smoothing`` / probability targets,
``ctc_loss`` over varying lengths) are called with the batch, the length and/or the spatial size
changing on every call (sizes 1 and 2 included), in train mode with gradients, some in eval
mode under ``no_grad`` (fused fast paths) and some under ``templates="exact"``. Further groups:
shape errors at some sizes (the exception must be eager's), Python code reading the sizes
(numbers, kernel sizes, fill values, indices, chunk / split / squeeze), sizes changing together
with the mode, ``requires_grad``, the rank, the dtype, the layout and empty batches, torch's
warnings at changing sizes, and ``torchscript`` pinned or tiered (random numbers of RNN
dropout).

Every case is differential (``differential.check`` / ``check_module``): eager and optimized run
on identical inputs, and values, gradients (of inputs and parameters), parameters and buffers
after the call (BatchNorm's running statistics), the RNG state, stdout and exceptions must be
the same: within float rounding by default, bit for bit under ``templates="exact"``. Falling
back to eager is fine; a wrong answer, a crash or an ``internal_error`` record is a bug, marked
``xfail(strict=True)`` with what goes wrong (``X``). The number of captures is printed
(``[sweep]`` lines on stderr, ``-s`` to see them): a recompile per size is reported, not
failed."""
from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import specularch
from differential import A, T, assert_same, check, check_module
from specularch import tiering
from specularch.tiering import policy

CALLS = 10
RTOL, ATOL = 1e-5, 1e-6

# One size per call; calls 1-3 profile (run eagerly), call 4 captures, later calls reuse it.
BATCH = [2, 3, 1, 5, 8, 2, 7, 1, 4, 3, 6, 2]
LENGTH = [5, 3, 7, 2, 8, 1, 6, 4, 9, 3, 5, 2]
HEIGHT = [8, 6, 7, 10, 5, 9, 6, 11, 4, 8, 7, 12]
WIDTH = [8, 9, 5, 6, 5, 12, 6, 7, 8, 10, 11, 4]
DEPTH = [4, 3, 5, 2, 6, 4, 3, 5, 2, 4, 6, 3]


def b(i):
    return BATCH[i % len(BATCH)]


def t(i):
    return LENGTH[i % len(LENGTH)]


def hw(i):
    return HEIGHT[i % len(HEIGHT)], WIDTH[i % len(WIDTH)]


def lengths(i, total=None):
    """One length per row (the first row the longest, so padding keeps ``total``), >= 1."""
    total = total or t(i)
    g = torch.Generator().manual_seed(100 + i)
    out = torch.randint(1, total + 1, (b(i),), generator=g)
    out[0] = total
    return out


def _show(name, report):
    kinds = sorted({f.kind for f in report.fallbacks})
    print(f"[sweep] {name}: graphs={len(report.graphs)} captures={report.stats.captures} "
          f"fallback_calls={report.stats.fallback_calls} kinds={kinds}", file=sys.stderr)


def _tolerance(exact):
    return dict(rtol=0.0, atol=0.0) if exact else dict(rtol=RTOL, atol=ATOL)


def run_module(name, make, make_args, *, train=True, grad=True, exact=False, calls=CALLS):
    def make_module():
        m = make()
        m.train(train)
        return m
    patch = specularch.config.patch(templates="exact") if exact else specularch.config.patch()
    with patch:
        report = check_module(make_module, make_args, calls=calls, grad=grad, **_tolerance(exact))
    _show(name, report)
    return report


def run_fn(name, fn, make_args, *, grad=True, exact=False, calls=CALLS):
    patch = specularch.config.patch(templates="exact") if exact else specularch.config.patch()
    with patch:
        report = check(fn, make_args, calls=calls, grad=grad, **_tolerance(exact))
    _show(name, report)
    return report


def x_args(shape_of, grad=True):
    """``make_args`` for one float input whose shape is ``shape_of(i)``."""
    def make(i):
        return A(T(*shape_of(i), requires_grad=grad))
    return make


# =================================================================== modules (size-varying)

class ConvStrided1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, stride=2, padding=1)
        self.same = nn.Conv1d(4, 4, 4, padding="same", dilation=2)
        self.grouped = nn.Conv1d(4, 6, 3, padding=2, groups=2, dilation=2)

    def forward(self, x):
        return self.grouped(self.same(self.conv(x)).relu())


class Conv2dMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.b = nn.Conv2d(4, 4, (4, 3), padding="same", dilation=(2, 1), groups=2)
        self.c = nn.Conv2d(4, 3, 1, stride=(1, 2), bias=False)

    def forward(self, x):
        return self.c(F.gelu(self.b(self.a(x))))


class ConvPaddingModes(nn.Module):
    def __init__(self):
        super().__init__()
        self.reflect = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
        self.circular = nn.Conv2d(3, 3, 3, padding=2, padding_mode="circular", dilation=2)
        self.replicate = nn.Conv1d(3, 2, 3, padding=1, padding_mode="replicate")

    def forward(self, x):
        h = self.circular(self.reflect(x))
        return self.replicate(h.mean(2))


class Conv3dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv3d(2, 3, 3, stride=2, padding=1)
        self.b = nn.Conv3d(3, 2, (1, 3, 3), padding="same")

    def forward(self, x):
        return self.b(self.a(x)).mean(dim=(2, 3, 4))


class ConvTranspose(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 4, 3, stride=2, padding=1, output_padding=1)
        self.up1d = nn.ConvTranspose1d(4, 4, 4, stride=3, padding=1, output_padding=2, groups=2,
                                       dilation=1)

    def forward(self, x):
        h = self.up(x)
        return h, self.up1d(h.flatten(2))


class ConvTransposeToSize(nn.Module):
    """``output_size`` computed from the input's size (``(h * 2 + 1, w * 2)``)."""
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)

    def forward(self, x):
        h, w = x.shape[-2:]
        return self.up(x, output_size=(h * 2, w * 2 - 1))


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.max = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.avg = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.avg_in = nn.AvgPool2d(2, stride=2, padding=1, ceil_mode=True, count_include_pad=True)

    def forward(self, x):
        return self.max(x), self.avg(x), self.avg_in(x)


class Pools1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.max = nn.MaxPool1d(2, stride=2, ceil_mode=True, return_indices=True)
        self.unpool = nn.MaxUnpool1d(2, stride=2)
        self.avg = nn.AvgPool1d(3, stride=2, padding=1, ceil_mode=True)

    def forward(self, x):
        y, idx = self.max(x)
        un = self.unpool(y, idx, output_size=x.size())
        return un + x, self.avg(x)


class Adaptive(nn.Module):
    def __init__(self):
        super().__init__()
        self.avg = nn.AdaptiveAvgPool2d((3, 5))  # larger than some inputs
        self.one = nn.AdaptiveAvgPool2d(1)
        self.max1d = nn.AdaptiveMaxPool1d(4, return_indices=True)

    def forward(self, x):
        a = self.avg(x)
        o = self.one(x).flatten(1)
        m, idx = self.max1d(x.flatten(2))
        return a, o, m, idx


class AdaptiveNone(nn.Module):
    """An adaptive pool keeping one dimension as is (``(None, 2)``)."""
    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveMaxPool2d((None, 2))

    def forward(self, x):
        return self.pool(x) * 2


class LPPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.LPPool2d(2, 2, stride=1)
        self.frac = nn.AdaptiveAvgPool1d(3)

    def forward(self, x):
        h = self.pool(x.abs() + 0.1)
        return self.frac(h.flatten(2))


class Upsamples(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.up_bilinear = nn.Upsample(scale_factor=(1.5, 2.5), mode="bilinear", align_corners=True)

    def forward(self, x):
        h, w = x.shape[2], x.shape[3]
        if self.how == "nearest":
            return self.up(x)
        if self.how == "bilinear":
            return self.up_bilinear(x)
        if self.how == "size":
            return F.interpolate(x, size=(h * 2, w * 2), mode="bilinear", align_corners=False)
        if self.how == "bicubic_recompute":
            return F.interpolate(x, scale_factor=1.7, mode="bicubic", recompute_scale_factor=True)
        if self.how == "nearest_exact_down":
            return F.interpolate(x, scale_factor=0.5, mode="nearest-exact")
        if self.how == "area":
            return F.interpolate(x, size=(max(h // 2, 1), w + 3), mode="area")
        if self.how == "shape_slice":
            return F.interpolate(x[:, :, ::2, ::2], size=x.shape[-2:], mode="nearest") - x
        raise AssertionError(self.how)


class Interp1d3d(nn.Module):
    def forward(self, x):
        line = F.interpolate(x.flatten(2), scale_factor=0.75, mode="linear")
        vol = F.interpolate(x.unsqueeze(2), size=(2, x.size(2) + 1, x.size(3)), mode="trilinear")
        return line, vol


class BN1dFlat(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3, momentum=momentum)

    def forward(self, x):
        return self.bn(self.fc(x))


class BN1dSeq(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3, affine=False)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class BN2d(nn.Module):
    def __init__(self, momentum=0.1, track=True):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3, momentum=momentum, track_running_stats=track)

    def forward(self, x):
        return self.bn(self.conv(x)).mean(dim=(2, 3))


class LayerNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.ln2 = nn.LayerNorm([3, 4], elementwise_affine=False)
        self.rms = nn.RMSNorm(4)

    def forward(self, x):  # (B, T, 3, 4)
        return self.ln(x), self.ln2(x), self.rms(x)


class LayerNormFromShape(nn.Module):
    """``F.layer_norm`` over ``x.shape[-2:]``: the normalized shape is a dynamic size."""
    def forward(self, x):
        return F.layer_norm(x, x.shape[-2:]) * 2


class GroupInstance(nn.Module):
    def __init__(self, track):
        super().__init__()
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True, track_running_stats=track)
        self.in1d = nn.InstanceNorm1d(4)

    def forward(self, x):  # (B, 4, H, W)
        return self.inorm(self.gn(x)), self.in1d(x.flatten(2))


class Embeds(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 5, padding_idx=0)
        self.fc = nn.Linear(5, 3)

    def forward(self, tokens):
        h = self.emb(tokens)  # (B, T, 5)
        return self.fc(h).reshape(tokens.size(0), tokens.size(1), -1)


class EmbedMaxNorm(nn.Module):
    """``max_norm`` renormalises rows of the weight in place (under no_grad) on every call."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)

    def forward(self, tokens):
        return self.emb(tokens).sum(1)


class Bag(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(15, 4, mode=mode)

    def forward(self, flat, offsets, weights=None):
        return self.bag(flat, offsets, per_sample_weights=weights)


class Bag2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(15, 4, mode="max", padding_idx=2)

    def forward(self, tokens):
        return self.bag(tokens)


def bag_args(i, weighted=False):
    g = torch.Generator().manual_seed(i)
    n = t(i) * 2
    flat = torch.randint(0, 15, (n,), generator=g)
    cuts = torch.randint(0, n + 1, (b(i) - 1,), generator=g).sort().values
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])  # some bags empty
    if weighted:
        return A(flat, offsets, torch.rand(n, generator=g).requires_grad_(True))
    return A(flat, offsets)


def token_args(vocab=12):
    def make(i):
        g = torch.Generator().manual_seed(i)
        return A(torch.randint(0, vocab, (b(i), t(i)), generator=g))
    return make


class Recurrent(nn.Module):
    def __init__(self, kind, *, state=False, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 5, **kw)
        self.state = state

    def forward(self, x):
        if not self.state:
            out, h = self.rnn(x)
            return out, h
        rnn = self.rnn
        batch = x.size(0) if rnn.batch_first else x.size(1)
        h0 = torch.full((rnn.num_layers * (2 if rnn.bidirectional else 1), batch, rnn.hidden_size), 0.1)
        if isinstance(rnn, nn.LSTM):
            return rnn(x, (h0, h0 * -2))
        return rnn(x, h0)


def rnn_args(batch_first):
    def make(i):
        shape = (b(i), t(i), 4) if batch_first else (t(i), b(i), 4)
        return A(T(*shape, requires_grad=True))
    return make


class Packed(nn.Module):
    def __init__(self, kind, enforce_sorted, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 5, batch_first=True, **kw)
        self.enforce_sorted = enforce_sorted

    def forward(self, x, lens):
        packed = pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=self.enforce_sorted)
        out, h = self.rnn(packed)
        padded, out_lens = pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        return padded, out_lens, h


def packed_args(sort):
    def make(i):
        lens = lengths(i)
        if sort:
            lens = lens.sort(descending=True).values
        return A(T(b(i), t(i), 4, requires_grad=True), lens)
    return make


class CellLoop(nn.Module):
    """An ``LSTMCell`` stepped over the time dimension (trip count = the length)."""
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 5)

    def forward(self, x):  # (T, B, 4)
        h = c = x.new_zeros(x.size(1), 5)
        outs = []
        for step in x:
            h, c = self.cell(step, (h, c))
            outs.append(h)
        return torch.stack(outs)


def _padding_mask(lens, total):
    return torch.arange(total)[None, :] >= lens[:, None]


class MHA(nn.Module):
    def __init__(self, *, batch_first=True, need_weights=True, average=True, attn_mask=False,
                 padding=True, kdim=None, dropout=0.0):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim,
                                          dropout=dropout)
        self.need_weights, self.average = need_weights, average
        self.use_attn_mask, self.padding = attn_mask, padding

    def forward(self, q, kv, lens):
        tq = q.size(1) if self.attn.batch_first else q.size(0)
        tk = kv.size(1) if self.attn.batch_first else kv.size(0)
        mask = _padding_mask(lens, tk) if self.padding else None
        attn_mask = None
        if self.use_attn_mask:  # (bool, as the padding mask: a float one warns, see WARNS)
            attn_mask = torch.ones(tq, tk, dtype=torch.bool).triu(1 + tk - tq)
            attn_mask[:, 0] = False  # no row fully masked
        return self.attn(q, kv, kv, key_padding_mask=mask, attn_mask=attn_mask,
                         need_weights=self.need_weights, average_attn_weights=self.average)


def mha_args(batch_first=True, kdim=8):
    def make(i):
        tq, tk = t(i), t(i + 3)
        q = (b(i), tq, 8) if batch_first else (tq, b(i), 8)
        k = (b(i), tk, kdim) if batch_first else (tk, b(i), kdim)
        return A(T(*q, requires_grad=True), T(*k, requires_grad=True), lengths(i, tk))
    return make


class Encoder(nn.Module):
    def __init__(self, norm_first, dropout=0.0, padding=True, causal=False):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True,
                                                norm_first=norm_first)
        self.padding, self.causal = padding, causal

    def forward(self, x, lens):
        mask = _padding_mask(lens, x.size(1)) if self.padding else None
        src_mask = None
        if self.causal:
            src_mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.layer(x, src_mask=src_mask, src_key_padding_mask=mask, is_causal=self.causal)


def encoder_args(i, grad=True):
    return A(T(b(i), t(i), 8, requires_grad=grad), lengths(i))


class SDPA(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(8, 24)

    def forward(self, x, lens):
        bsz, tl, _ = x.shape
        q, k, v = self.proj(x).view(bsz, tl, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.how == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.how == "causal_short_query":
            return F.scaled_dot_product_attention(q[:, :, -1:], k, v, is_causal=True)
        if self.how == "mask":
            keep = ~_padding_mask(lens, tl)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        if self.how == "dropout":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0)
        if self.how == "scale_gqa":
            return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], scale=0.3, enable_gqa=True)
        raise AssertionError(self.how)


class Reshapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten(1)
        self.unflatten = nn.Unflatten(1, (2, 6))
        self.fc = nn.Linear(12, 12)

    def forward(self, x):  # (B, 3, 4)
        h = self.fc(self.flatten(x))
        u = self.unflatten(h)
        v = x.view(x.size(0), -1)
        r = x.reshape(x.size(0), x.size(1), -1)
        return u, v * 2, r.transpose(0, 1).reshape(3, -1)


class ReshapeTime(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):  # (B, T, 2, 3)
        bsz, tl = x.shape[:2]
        h = self.fc(x.reshape(bsz, tl, -1))
        flat = h.reshape(-1, h.size(-1))
        return flat.view(bsz, tl, 2, 2).flatten(0, 1), h.unflatten(1, (tl, 1)).squeeze(2)


class Shuffles(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.PixelShuffle(2)
        self.down = nn.PixelUnshuffle(2)
        self.conv = nn.Conv2d(8, 8, 1)

    def forward(self, x):  # (B, 8, H, W)
        up = self.up(self.conv(x))
        return up, self.down(up) - x


class Unshuffle(nn.Module):
    """PixelUnshuffle of odd sizes raises in eager."""
    def __init__(self):
        super().__init__()
        self.down = nn.PixelUnshuffle(2)

    def forward(self, x):
        return self.down(x * 2)


class UnfoldFold(nn.Module):
    def forward(self, x):
        h, w = x.shape[-2:]
        cols = F.unfold(x, kernel_size=3, stride=2, padding=1, dilation=1)
        back = F.fold(cols, output_size=(h, w), kernel_size=3, stride=2, padding=1)
        ones = torch.ones_like(x)
        norm = F.fold(F.unfold(ones, 3, stride=2, padding=1), (h, w), 3, stride=2, padding=1)
        return cols.transpose(1, 2), back / norm


class Pads(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, x):  # (B, C, H, W)
        h, w = x.shape[-2:]
        ph, pw = (-h) % 4, (-w) % 4
        pads = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)
        if self.mode == "constant":
            return F.pad(x, pads, value=-1.5)
        if self.mode == "crop":
            return F.pad(x, (-1, -(w // 3), 0, -(h // 4)))
        if self.mode == "reflect_big":
            return F.pad(x, (w // 2, 1, 2, h // 2), mode="reflect")  # raises at h < 3
        return F.pad(x, pads, mode=self.mode)


class Pad1d(nn.Module):
    def forward(self, x):  # (B, C, T)
        tl = x.size(-1)
        return F.pad(x, (0, 8 - tl % 8), mode="replicate"), F.pad(x, (tl // 2, 0), mode="circular")


class Reductions(nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3)), x.amax(dim=(-1, -2)), x.std(dim=(1, 3), keepdim=True), \
            x.logsumexp(dim=(2, 3)), x.var(2, correction=0)


class CatParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.start = nn.Parameter(torch.randn(1, 1, 4))

    def forward(self, x, lens):  # (B, T, 4)
        bsz, tl, _ = x.shape
        half = tl // 2
        parts = [self.start.expand(bsz, 1, 4), x[:, :half], x[:, half:] * 2, x[:, -1:]]
        y = torch.cat(parts, dim=1)
        z = torch.cat([x, x.flip(1)[:, : tl - 1]], 1)
        return y, z, torch.cat([x[:1], x], 0)


class LengthMask(nn.Module):
    """Masks from lengths: a masked mean, a masked max and a masked softmax."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, lens):
        h = self.fc(x)
        mask = torch.arange(x.size(1))[None] < lens[:, None]
        mean = (h * mask[..., None]).sum(1) / lens[:, None].to(h.dtype)
        big = h.masked_fill(~mask[..., None], float("-inf")).amax(1)
        scores = h.sum(-1).masked_fill(~mask, -1e9).softmax(-1)
        return mean, big, scores, mask.sum(1)


def mask_args(i):
    return A(T(b(i), t(i), 4, requires_grad=True), lengths(i))


def mask_args_8(i):
    return A(T(b(i), t(i), 8, requires_grad=True), lengths(i))


class CE(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(6, 5)

    def forward(self, x, target):
        logits = self.fc(x)  # (B, T, 5)
        flat = logits.reshape(-1, 5)
        if self.how == "ignore":
            return F.cross_entropy(flat, target.reshape(-1), ignore_index=-100)
        if self.how == "ignore_sum":
            return F.cross_entropy(flat, target.reshape(-1), ignore_index=2, reduction="sum")
        if self.how == "smoothing":
            return F.cross_entropy(flat, target.reshape(-1), label_smoothing=0.1,
                                   weight=torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]))
        if self.how == "probs":
            probs = F.softmax(target.float().unsqueeze(-1) * torch.arange(5.0) / 4, -1)
            return F.cross_entropy(flat, probs.reshape(-1, 5), label_smoothing=0.2)
        if self.how == "kdim":  # (B, C, T) logits, (B, T) targets
            return F.cross_entropy(logits.transpose(1, 2), target.clamp(min=0), reduction="none")
        if self.how == "module":
            return nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.05)(flat, target.reshape(-1))
        raise AssertionError(self.how)


def ce_args(i):
    g = torch.Generator().manual_seed(i)
    target = torch.randint(0, 5, (b(i), t(i)), generator=g)
    target[:, -1] = -100  # the last token of each row ignored (for "ignore")
    target[0, 0] = 1
    return A(T(b(i), t(i), 6, requires_grad=True), target)


def ce_args_plain(i):
    g = torch.Generator().manual_seed(i)
    return A(T(b(i), t(i), 6, requires_grad=True), torch.randint(0, 5, (b(i), t(i)), generator=g))


class CTC(nn.Module):
    def __init__(self, concat, zero_infinity=False, reduction="mean"):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.concat = concat
        self.loss = nn.CTCLoss(blank=0, zero_infinity=zero_infinity, reduction=reduction)

    def forward(self, x, targets, in_lens, tgt_lens):  # x: (T, B, 4)
        logp = self.fc(x).log_softmax(-1)
        if self.concat:
            flat = torch.cat([targets[k, : tgt_lens[k]] for k in range(targets.size(0))])
            return self.loss(logp, flat, in_lens, tgt_lens)
        return self.loss(logp, targets, in_lens, tgt_lens)


def ctc_args(i, impossible=False):
    g = torch.Generator().manual_seed(i)
    tl, bsz = t(i) + 4, b(i)
    in_lens = torch.randint(max(tl - 3, 1), tl + 1, (bsz,), generator=g)
    in_lens[0] = tl
    s = max(tl // 2, 1)
    tgt_lens = torch.randint(1, s + 1, (bsz,), generator=g)
    if impossible and i % 2:
        tgt_lens[-1] = s + 3  # longer than any input: infinite loss
        s = s + 3
    targets = torch.randint(1, 6, (bsz, s), generator=g)
    return A(T(tl, bsz, 4, requires_grad=True), targets, in_lens, tgt_lens)


class FlatHead(nn.Module):
    """A conv then ``view(x.size(0), -1)`` into a Linear sized for 8x8 inputs: every other
    size raises in eager (the error message must be eager's)."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 8 * 8, 2)

    def forward(self, x):
        h = self.conv(x)
        return self.fc(h.view(h.size(0), -1))


class TooSmall(nn.Module):
    """A conv with a kernel of 5 and a max pool: inputs smaller than the kernel raise."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 5)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(self.conv(x))


class ViewSplit(nn.Module):
    """``view(b, t // 2, -1)``: odd lengths raise in eager."""
    def forward(self, x):
        bsz, tl, c = x.shape
        return x.view(bsz, tl // 2, -1) * 2


class GRUCellMasked(nn.Module):
    """A GRUCell stepped over ``range(x.size(1))``, each row's state frozen past its length."""
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4, 5)

    def forward(self, x, lens):
        h = x.new_zeros(x.size(0), 5)
        outs = []
        for step in range(x.size(1)):
            new = self.cell(x[:, step], h)
            keep = (step < lens).float().unsqueeze(1)
            h = keep * new + (1 - keep) * h
            outs.append(h)
        return torch.stack(outs, 1), h


class AttentionDecoder(nn.Module):
    """A seq2seq decoder step loop: attention over a memory of one length, a GRUCell over
    target tokens of another (teacher forced), log-probabilities appended."""
    def __init__(self):
        super().__init__()
        self.emb, self.query = nn.Embedding(6, 4), nn.Linear(5, 4)
        self.cell, self.out = nn.GRUCell(8, 5), nn.Linear(5, 6)

    def forward(self, memory, target):
        h = memory.new_zeros(memory.size(0), 5)
        outs = []
        for step in range(target.size(1)):
            weights = torch.softmax((memory @ self.query(h).unsqueeze(-1)).squeeze(-1), -1)
            context = (weights.unsqueeze(-1) * memory).sum(1)
            h = self.cell(torch.cat([self.emb(target[:, step]), context], -1), h)
            outs.append(F.log_softmax(self.out(h), -1))
        return torch.stack(outs, 1)


def decoder_args(i):
    g = torch.Generator().manual_seed(i)
    return A(T(b(i), t(i + 3), 4, requires_grad=True), torch.randint(0, 6, (b(i), t(i)), generator=g))


class BNThenShapeError(nn.Module):
    """BatchNorm updates its running statistics, then a Linear sized for a length of 2
    raises at other lengths: eager's partial update (and the counter) must be kept."""
    def __init__(self):
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(4), nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        h = self.bn(x.transpose(1, 2)).transpose(1, 2)
        self.calls += 1
        return self.fc(h.reshape(h.size(0), -1))


# --------------------------------------------------------------------- module cases

def img(c):
    return lambda i: (b(i), c, *hw(i))


def seq_bct(c):
    return lambda i: (b(i), c, t(i) + 3)


def vol(i):
    h, w = hw(i)
    return (b(i), 2, DEPTH[i % len(DEPTH)], h, w)


def _mk(cls, *a, **kw):
    return lambda: cls(*a, **kw)


# name -> (make_module, make_args): each run in train mode with gradients ("train_grad"); the
# names in EVAL also in eval mode under no_grad (BatchNorm's running statistics, dropout off,
# the fused fast paths of MultiheadAttention and TransformerEncoderLayer), those in EXACT also
# under templates="exact", compared bit for bit.
MODULES = {
    "conv1d_stride_same_dilation_groups": (ConvStrided1d, x_args(seq_bct(3))),
    "conv2d_stride_same_dilation_groups": (Conv2dMix, x_args(img(2))),
    "conv_padding_modes": (ConvPaddingModes, x_args(img(2))),
    "conv3d_stride_same": (Conv3dNet, x_args(vol)),
    "conv_transpose_output_padding": (ConvTranspose, x_args(img(2))),
    "conv_transpose_output_size": (ConvTransposeToSize, x_args(img(3))),
    "pools_ceil_count_include_pad": (Pools, x_args(img(2))),
    "maxpool1d_indices_unpool_avgpool1d": (Pools1d, x_args(seq_bct(3))),
    "adaptive_pools": (Adaptive, x_args(img(2))),
    "adaptive_max_none": (AdaptiveNone, x_args(img(2))),
    "lp_pool_adaptive1d": (LPPool, x_args(img(2))),
    "upsample_bilinear_align": (_mk(Upsamples, "bilinear"), x_args(img(2))),
    "interpolate_size_from_shape": (_mk(Upsamples, "size"), x_args(img(2))),
    "interpolate_bicubic_recompute": (_mk(Upsamples, "bicubic_recompute"), x_args(img(2))),
    "interpolate_nearest_exact_down": (_mk(Upsamples, "nearest_exact_down"), x_args(img(2))),
    "interpolate_area_max_size": (_mk(Upsamples, "area"), x_args(img(2))),
    "interpolate_to_shape_slice": (_mk(Upsamples, "shape_slice"), x_args(img(2))),
    "interpolate_linear_trilinear": (Interp1d3d, x_args(img(2))),
    "batchnorm1d_flat": (BN1dFlat, x_args(lambda i: (b(i) + 1, 4))),
    "batchnorm1d_cumulative_momentum": (_mk(BN1dFlat, momentum=None), x_args(lambda i: (b(i) + 1, 4))),
    "batchnorm1d_seq_no_affine": (BN1dSeq, x_args(lambda i: (b(i), t(i), 3))),
    "batchnorm2d": (BN2d, x_args(img(2))),
    "batchnorm2d_no_running_stats": (_mk(BN2d, track=False), x_args(img(2))),
    "layer_rms_norms": (LayerNorms, x_args(lambda i: (b(i), t(i), 3, 4))),
    "layer_norm_from_shape": (LayerNormFromShape, x_args(img(2))),
    "group_instance_norm": (_mk(GroupInstance, False), x_args(img(4))),
    "group_instance_norm_tracked": (_mk(GroupInstance, True), x_args(img(4))),
    "embedding_padding_idx": (Embeds, token_args()),
    "embedding_max_norm": (EmbedMaxNorm, token_args(10)),
    "embedding_bag_sum_offsets": (_mk(Bag, "sum"), bag_args),
    "embedding_bag_mean_offsets": (_mk(Bag, "mean"), bag_args),
    "embedding_bag_weighted": (_mk(Bag, "sum"), lambda i: bag_args(i, weighted=True)),
    "embedding_bag_2d_max_padding": (Bag2d, token_args(15)),
    "lstm_bidir_2layers_batch_first": (_mk(Recurrent, "LSTM", batch_first=True, bidirectional=True,
                                           num_layers=2), rnn_args(True)),
    "lstm_state_seq_first": (_mk(Recurrent, "LSTM", state=True, num_layers=2), rnn_args(False)),
    "gru_bidir_state": (_mk(Recurrent, "GRU", state=True, bidirectional=True, batch_first=True),
                        rnn_args(True)),
    "rnn_relu_2layers": (_mk(Recurrent, "RNN", nonlinearity="relu", num_layers=2), rnn_args(False)),
    "lstm_dropout_between_layers": (_mk(Recurrent, "LSTM", num_layers=2, dropout=0.4,
                                        batch_first=True), rnn_args(True)),
    "lstm_packed_unsorted": (_mk(Packed, "LSTM", False), packed_args(False)),
    "gru_packed_sorted_bidir": (_mk(Packed, "GRU", True, bidirectional=True), packed_args(True)),
    "rnn_packed_2layers": (_mk(Packed, "RNN", False, num_layers=2), packed_args(False)),
    "lstm_cell_loop": (CellLoop, rnn_args(False)),
    "gru_cell_masked_loop": (GRUCellMasked, mask_args),
    "attention_decoder_loop": (AttentionDecoder, decoder_args),
    "mha_padding_weights": (MHA, mha_args()),
    "mha_no_weights": (_mk(MHA, need_weights=False), mha_args()),
    "mha_attn_mask_per_head": (_mk(MHA, attn_mask=True, average=False), mha_args()),
    "mha_seq_first_kdim": (_mk(MHA, batch_first=False, kdim=6), mha_args(False, 6)),
    "mha_dropout": (_mk(MHA, dropout=0.3, padding=False), mha_args()),
    "encoder_layer_norm_first": (_mk(Encoder, True), encoder_args),
    "encoder_layer_post_norm": (_mk(Encoder, False), encoder_args),
    "encoder_layer_causal_dropout": (_mk(Encoder, False, dropout=0.2, padding=False, causal=True),
                                     encoder_args),
    "sdpa_causal": (_mk(SDPA, "causal"), mask_args_8),
    "sdpa_causal_short_query": (_mk(SDPA, "causal_short_query"), mask_args_8),
    "sdpa_bool_mask": (_mk(SDPA, "mask"), mask_args_8),
    "sdpa_dropout": (_mk(SDPA, "dropout"), mask_args_8),
    "sdpa_scale_gqa": (_mk(SDPA, "scale_gqa"), mask_args_8),
    "flatten_unflatten_view_reshape": (Reshapes, x_args(lambda i: (b(i), 3, 4))),
    "reshape_time": (ReshapeTime, x_args(lambda i: (b(i), t(i), 2, 3))),
    "pixel_shuffle_unshuffle": (Shuffles, x_args(img(8))),
    "unfold_fold": (UnfoldFold, x_args(img(2))),
    "pad_reflect_to_multiple": (_mk(Pads, "reflect"), x_args(img(2))),
    "pad_replicate_to_multiple": (_mk(Pads, "replicate"), x_args(img(2))),
    "pad_constant_to_multiple": (_mk(Pads, "constant"), x_args(img(2))),
    "pad_negative_crop": (_mk(Pads, "crop"), x_args(img(2))),
    "pad_1d_replicate_circular": (Pad1d, x_args(seq_bct(2))),
    "reductions_over_dims": (Reductions, x_args(img(3))),
    "cat_varying_parts": (CatParts, mask_args),
    "masks_from_lengths": (LengthMask, mask_args),
    "cross_entropy_ignore_index": (_mk(CE, "ignore"), ce_args),
    "cross_entropy_ignore_sum": (_mk(CE, "ignore_sum"), ce_args_plain),
    "cross_entropy_smoothing_weight": (_mk(CE, "smoothing"), ce_args_plain),
    "cross_entropy_probability_targets": (_mk(CE, "probs"), ce_args_plain),
    "cross_entropy_k_dim_none": (_mk(CE, "kdim"), ce_args_plain),
    "ctc_padded_targets": (_mk(CTC, False), ctc_args),
    "ctc_concatenated_targets_sum": (_mk(CTC, True, reduction="sum"), ctc_args),
    "ctc_zero_infinity": (_mk(CTC, False, zero_infinity=True), lambda i: ctc_args(i, True)),
}
EVAL = {"batchnorm1d_flat", "batchnorm1d_cumulative_momentum", "batchnorm2d",
        "group_instance_norm_tracked", "embedding_max_norm", "rnn_relu_2layers",
        "gru_packed_sorted_bidir", "mha_padding_weights", "mha_attn_mask_per_head",
        "mha_dropout", "encoder_layer_norm_first", "encoder_layer_post_norm",
        "encoder_layer_causal_dropout", "sdpa_dropout"}
EXACT = {"conv2d_stride_same_dilation_groups", "pools_ceil_count_include_pad",
         "interpolate_size_from_shape", "layer_rms_norms", "gru_bidir_state", "mha_padding_weights",
         "lstm_cell_loop", "gru_cell_masked_loop", "masks_from_lengths",
         "cross_entropy_probability_targets", "ctc_padded_targets"}

# Shape errors at some sizes (eager raises at those, returns at the others): the exception
# must be eager's, type and message. Run in train mode with gradients and in eval mode.
ERRORS = {
    "batchnorm1d_batch_of_one_train": (BN1dFlat, x_args(lambda i: (b(i), 4))),
    "batchnorm2d_one_value_per_channel": (BN2d, x_args(lambda i: (b(i), 2, 1, 1) if i % 3 else (1, 2, 1, 1))),
    "instance_norm_one_element": (_mk(GroupInstance, False), x_args(lambda i: (b(i), 4, 1, 1 + i % 2))),
    "view_into_linear_wrong_size": (FlatHead, x_args(lambda i: (b(i), 2, 8, 8 if i % 3 else 7))),
    "conv_input_smaller_than_kernel": (TooSmall, x_args(lambda i: (b(i), 2, 3 + i % 5, 6))),
    "view_odd_length": (ViewSplit, x_args(lambda i: (b(i), t(i), 3))),
    "pixel_unshuffle_odd": (Unshuffle, x_args(img(2))),
    "reflect_pad_too_large": (_mk(Pads, "reflect_big"), x_args(lambda i: (b(i), 2, 1 + i % 4, 6))),
    "ctc_impossible_inf": (_mk(CTC, False), lambda i: ctc_args(i, True)),
    "layer_norm_wrong_shape": (LayerNorms, x_args(lambda i: (b(i), t(i), 3, 4 if i % 4 else 5))),
    "embedding_out_of_range": (Embeds, token_args(12 + 1)),
    "batchnorm_stats_then_shape_error": (BNThenShapeError, x_args(lambda i: (b(i) + 1, 2 if i % 3 else t(i) + 2, 4))),
}
ERRORS_EVAL = {"batchnorm1d_batch_of_one_train", "batchnorm2d_one_value_per_channel",
               "instance_norm_one_element"}

_LEAF_WARNS = ("a torch Python helper recorded as one graph node warns 3 times on the capturing call "
               "(the returns_metadata trial run, symbolic/library/torch_objects.py:122, the capture's "
               "own run, symbolic/tracer.py:394, then the graph) and, from then on, from the graph's "
               "`<eval_with_key>` code instead of the user's / torch's line: ")
X = {  # "name-variant" / "name" -> xfail reason (what goes wrong)
    "mha_mismatched_masks": _LEAF_WARNS + "F._canonical_mask's 'mismatched key_padding_mask and "
                            "attn_mask' warning, eager's at torch/nn/modules/activation.py:1336",
    "mse_broadcast_target": _LEAF_WARNS + "F.mse_loss's target-size warning",
    "softmax_implicit_dim": _LEAF_WARNS + "F.softmax's implicit-dim warning",
    "nll_loss_legacy_argument": _LEAF_WARNS + "_Reduction.legacy_get_string's size_average warning "
                                "(at eager's location, but 3 times)",
    "upsample_deprecated": _LEAF_WARNS + "F.upsample's deprecation warning",
    "affine_grid_default_align": _LEAF_WARNS + "F.affine_grid's / F.grid_sample's align_corners warnings",
}


def _params(cases, extra=()):
    out = []
    for name in cases:
        for v in ("train_grad", *(v for v, names in extra if name in names)):
            key = f"{name}-{v}"
            marks = [pytest.mark.xfail(strict=True, reason=X[key])] if key in X else []
            out.append(pytest.param(name, v, id=key, marks=marks))
    return out


def _detached(make_args):
    def make(i):
        args, kwargs = make_args(i)
        return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kwargs
    return make


def _run_variant(cases, name, variant):
    make, make_args = cases[name]
    if variant == "eval":
        with torch.no_grad():
            return run_module(name, make, _detached(make_args), train=False, grad=False)
    return run_module(name, make, make_args, exact=variant == "exact")


@pytest.mark.parametrize("name, variant", _params(MODULES, [("eval", EVAL), ("exact", EXACT)]))
def test_module_over_changing_sizes(name, variant):
    _run_variant(MODULES, name, variant)


@pytest.mark.parametrize("name, variant", _params(ERRORS, [("eval", ERRORS_EVAL)]))
def test_shape_errors_at_some_sizes_are_eagers(name, variant):
    _run_variant(ERRORS, name, variant)


# =================================================================== sizes read by Python
# Functions whose Python code reads the changing sizes: as numbers (arithmetic, floats, kernel
# sizes, fill values, indices, slice bounds), as tuples (returned, compared), through
# squeeze / chunk / split / topk. A recompile per size is reported ([sweep] line), not failed.

def global_pool_kernel_from_shape(x):
    return F.avg_pool2d(x, x.size()[2:]).view(x.size(0), -1), F.max_pool2d(x, (x.size(2), x.size(3)))


def adaptive_to_half(x):
    return F.adaptive_avg_pool2d(x, (x.size(2) // 2, x.size(3) // 2 + 1))


def interpolate_float_sizes(x):
    h, w = x.shape[-2:]
    a = F.interpolate(x, scale_factor=12 / h, mode="bilinear")
    return a, F.interpolate(x, size=(math.ceil(h * 1.5), int(w * 0.7) + 1), mode="nearest")


def sizes_returned(x):
    return x * 2, x.shape, x.size(0) * 3, len(x), x.numel(), x.dim(), x.shape[1:], tuple(x.shape[::-1])


def sizes_as_python_numbers(x):
    t = x.size(1)
    return (x * (t / 2), x.sum() * (t // -2), (-t) % 3, t ** 2, divmod(t, 3), math.log2(t), abs(-t),
            bool(x.size(0)) and t, str(t), x * t ** -0.5)


def sizes_as_tensors(x):
    return (x + torch.tensor(x.shape).sum(), torch.tensor(x.size(1)), torch.as_tensor(x.shape[:2]),
            x.new_full((x.size(0),), x.size(1)), x.size(1) * torch.ones(3), x.sum(1) / x.size(1))


def sizes_in_a_list_tensor(x):
    return x.sum(1) * torch.tensor([x.size(1)] * x.size(0))[:, None]


def chunk_along_changing_dim(x):
    a, b_ = x.chunk(2, dim=1)  # one part only where the length is 1: eager's ValueError
    return a.sum(1) - b_.sum(1)


def split_in_halves(x):
    tl = x.size(1)
    a, b_ = x.split([tl // 2, tl - tl // 2], dim=1)
    return a.mean(1), b_.mean(1)


def sqrt_of_length(x):
    return x / math.sqrt(x.size(1))


def squeeze_size_one(x):  # (B, T, 1): the batch or the length of 1 squeezed away too
    return x.squeeze() * 2, x.squeeze(-1).shape


def topk_half_and_roll(x):
    v, idx = x.topk(max(x.size(1) // 2, 1), dim=1)
    return v, idx, torch.roll(x, shifts=x.size(1) // 2, dims=1), x.narrow(1, x.size(1) // 3, x.size(1) - x.size(1) // 3)


def index_with_sizes(x, lens):
    tl = x.size(1)
    return (x[:, tl - 1], x[:, tl // 2], x[:, -(tl // 2 + 1):], x[torch.arange(x.size(0)), lens - 1],
            x.gather(1, (lens - 1).view(-1, 1, 1).expand(-1, 1, x.size(2))).squeeze(1))


def causal_and_eye_masks(x):
    tl = x.size(1)
    s = x @ x.transpose(1, 2)
    keep = torch.tril(torch.ones(tl, tl, dtype=torch.bool))
    return s.masked_fill(~keep, float("-inf")).softmax(-1), torch.eye(tl) + s, torch.diag_embed(x[..., 0])


def positions_from_length(x):
    tl, d = x.size(1), x.size(2)
    pos = torch.arange(tl).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
    pe = torch.zeros(tl, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return x + pe, torch.linspace(0, 1, tl), x + torch.arange(tl).float()[None, :, None] / max(tl - 1, 1)


def branch_on_length(x):
    if x.size(1) > 4:
        return x[:, :4] * 2
    return F.pad(x, (0, 0, 0, 4 - x.size(1)))


def loop_over_length(x):
    outs = []
    for k in range(x.size(1)):
        outs.append(x[:, k] * k)
    return torch.stack(outs, 1)


def ctc_lengths_from_sizes(x, lens):
    logp = x.transpose(0, 1).log_softmax(-1)  # (T, B, 4)
    targets = torch.ones(x.size(0), 1, dtype=torch.long)
    return F.ctc_loss(logp, targets, torch.full((x.size(0),), x.size(1), dtype=torch.long),
                      torch.ones(x.size(0), dtype=torch.long))


def shapes_printed(x):
    print(f"batch {x.size(0)} shape {tuple(x.shape)}")
    return x * 1


ONE = [0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0]  # the calls where the second input's length is 1


def broadcast_length_one_or_full(x, y):
    """``y``'s length is 1 at some calls (broadcast), ``x``'s at others."""
    a, b_ = torch.broadcast_tensors(x, y)
    return ((x + y).sum(1), y.expand_as(x) * 2, torch.where(x > 0, x, y), a * b_,
            torch.cat([x, y.expand(-1, x.size(1), -1)], -1), F.mse_loss(x, y.expand_as(x)))


def broadcast_args(i):
    return A(T(b(i), t(i), 3, requires_grad=True), T(b(i), 1 if ONE[i % len(ONE)] else t(i), 3, requires_grad=True))


def seq_x(c):
    return lambda i: A(T(b(i), t(i), c, requires_grad=True))


PYSIZES = {
    "global_pool_kernel_from_shape": (global_pool_kernel_from_shape, x_args(img(2))),
    "adaptive_to_half": (adaptive_to_half, x_args(img(2))),
    "interpolate_float_sizes": (interpolate_float_sizes, x_args(img(2))),
    "sizes_returned": (sizes_returned, seq_x(4)),
    "sizes_as_python_numbers": (sizes_as_python_numbers, seq_x(4)),
    "sizes_as_tensors": (sizes_as_tensors, seq_x(4)),
    "sizes_in_a_list_tensor": (sizes_in_a_list_tensor, seq_x(4)),
    "chunk_along_changing_dim": (chunk_along_changing_dim, seq_x(4)),
    "split_in_halves": (split_in_halves, seq_x(4)),
    "sqrt_of_length": (sqrt_of_length, seq_x(4)),
    "squeeze_size_one": (squeeze_size_one, seq_x(1)),
    "topk_half_roll_narrow": (topk_half_and_roll, seq_x(3)),
    "index_with_sizes": (index_with_sizes, mask_args),
    "causal_and_eye_masks": (causal_and_eye_masks, seq_x(3)),
    "positions_from_length": (positions_from_length, seq_x(6)),
    "branch_on_length": (branch_on_length, seq_x(3)),
    "loop_over_length": (loop_over_length, seq_x(3)),
    "ctc_lengths_from_sizes": (ctc_lengths_from_sizes, mask_args),
    "shapes_printed": (shapes_printed, seq_x(3)),
    "broadcast_length_one_or_full": (broadcast_length_one_or_full, broadcast_args),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=X[n])])
                                  if n in X else n for n in PYSIZES])
def test_sizes_read_by_python(name):
    fn, make_args = PYSIZES[name]
    run_fn(name, fn, make_args)


# =================================================================== what else changes between calls
# The sizes change together with the mode (train / eval between calls), requires_grad, the
# rank (unbatched inputs), the dtype, the layout (channels_last, transposed, views at an
# offset) and empty batches.

class ConvBNDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.drop = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Dropout2d(0.3)

    def forward(self, x):
        return self.drop(self.bn(self.conv(x))).mean((2, 3))


class ConvPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.pool = nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(2, ceil_mode=True)

    def forward(self, x):
        return self.pool(self.conv(x))


class Wrapped(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x, x, x) if isinstance(self.inner, nn.MultiheadAttention) else self.inner(x)


class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 3), nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.fc(x).transpose(1, 2))


class VarArgs(nn.Module):
    """``forward(self, *args)``: the sizes of the tensors in ``args`` change."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, *args):
        return self.conv(args[0]).softmax(1)


class RotaryCache(nn.Module):
    """Rotary position tables cached on the module, recomputed when a longer sequence comes."""
    def __init__(self, d=4):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)),
                             persistent=False)
        self.seq_cached, self.cos_cached, self.sin_cached = 0, None, None

    def forward(self, x):
        tl = x.size(1)
        if tl > self.seq_cached:
            self.seq_cached = tl
            freqs = torch.outer(torch.arange(tl, dtype=torch.float32), self.inv_freq)
            emb = torch.cat([freqs, freqs], -1)
            self.cos_cached, self.sin_cached = emb.cos(), emb.sin()
        x1, x2 = x.chunk(2, -1)
        return x * self.cos_cached[:tl] + torch.cat([-x2, x1], -1) * self.sin_cached[:tl]


class MaskCache(nn.Module):
    """Causal masks kept in a dict keyed by the length."""
    def __init__(self):
        super().__init__()
        self.masks, self.fc = {}, nn.Linear(4, 4)

    def forward(self, x):
        tl = x.size(1)
        if tl not in self.masks:
            self.masks[tl] = torch.triu(torch.full((tl, tl), float("-inf")), 1)
        return ((self.fc(x) @ x.transpose(1, 2)) + self.masks[tl]).softmax(-1) @ x


class KVCache(nn.Module):
    """Keys kept on the module and grown by each call's length, reset every 4th call."""
    def __init__(self):
        super().__init__()
        self.keys, self.fc = None, nn.Linear(4, 4)

    def forward(self, x, reset):
        new = self.fc(x).detach()
        self.keys = new if reset or self.keys is None else torch.cat([self.keys, new], 1)
        return (self.fc(x) @ self.keys.transpose(1, 2)).softmax(-1) @ self.keys


def _img_grad(i, grad=True, **kw):
    return T(b(i), 2, *hw(i), requires_grad=grad, **kw)


CHANGES = {
    "train_eval_toggled": (ConvBNDrop, lambda i: A(_img_grad(i)), lambda m, i: m.train(i % 3 != 1)),
    "requires_grad_toggled": (ConvBNDrop, lambda i: A(_img_grad(i, grad=i % 2 == 0)), None),
    "conv_batched_and_unbatched": (ConvPool, lambda i: A(T(*((b(i),) if i % 3 else ()), 2, *hw(i),
                                                           requires_grad=True)), None),
    "lstm_batched_and_unbatched": (lambda: Wrapped(nn.LSTM(4, 5)),
                                   lambda i: A(T(t(i), *((b(i),) if i % 3 else ()), 4, requires_grad=True)), None),
    "mha_batched_and_unbatched": (lambda: Wrapped(nn.MultiheadAttention(4, 2)),
                                  lambda i: A(T(t(i), *((b(i),) if i % 3 else ()), 4, requires_grad=True)), None),
    "float64_at_some_calls": (ConvPool, lambda i: A(_img_grad(i, dtype=torch.float64 if i in (5, 8) else torch.float32)), None),
    "empty_batch_batchnorm_train": (LinearBN, lambda i: A(T(0 if i in (4, 7) else b(i), t(i), 4, requires_grad=True)), None),
    "empty_batch_conv": (ConvPool, lambda i: A(T(0 if i in (4, 7, 9) else b(i), 2, *hw(i), requires_grad=True)), None),
    "empty_batch_and_length_gru": (lambda: Wrapped(nn.GRU(4, 5, batch_first=True)),
                                   lambda i: A(T(0 if i in (4, 7) else b(i), 0 if i in (5, 9) else t(i), 4,
                                                 requires_grad=True)), None),
    "transposed_or_contiguous_input": (ConvPool, lambda i: A(T(b(i), hw(i)[1], hw(i)[0], 2).permute(0, 3, 2, 1)
                                                             .requires_grad_(True) if i % 2 else _img_grad(i)), None),
    "forward_varargs": (VarArgs, lambda i: A(_img_grad(i)), None),
    "rotary_tables_cached_on_module": (RotaryCache, seq_x(4), None),
    "masks_cached_by_length": (MaskCache, seq_x(4), None),
    "keys_grown_on_module": (KVCache, lambda i: A(T(2, 1 + i % 3, 4, requires_grad=True), i % 4 == 0), None),
    "channels_last_input": (ConvPool, lambda i: A(_img_grad(i, grad=False).contiguous(
        memory_format=torch.channels_last).requires_grad_(True)), None),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=X[n])])
                                  if n in X else n for n in CHANGES])
def test_sizes_change_with_other_properties(name):
    make, make_args, between = CHANGES[name]
    report = check_module(make, make_args, calls=CALLS, grad=True, between=between, **_tolerance(False))
    _show(name, report)


# =================================================================== warnings at changing sizes
# Warnings that torch's layers and functions give (some with the sizes in the message), with
# every warning shown ("always"): each call must warn what eager warns, where eager warns
# (message, category, file and line; the line decides "once per location" under the default
# filter).

MHA_WARN = None


def mha_mismatched_masks(x, lens):
    """A bool key padding mask with a float attention mask (torch warns: mismatched types)."""
    tl = x.size(1)
    causal = torch.zeros(tl, tl).masked_fill(torch.ones(tl, tl, dtype=torch.bool).triu(1), float("-inf"))
    return MHA_WARN(x, x, x, key_padding_mask=_padding_mask(lens, tl), attn_mask=causal)[0]


def mse_broadcast_target(x, lens):
    """A (B, T) input against a (B, 1) target: the warning names both sizes."""
    return F.mse_loss(x.sum(-1), x[:, :1, 0])


def softmax_implicit_dim(x, lens):
    return F.softmax(x)


def nll_loss_legacy_argument(x, lens):
    return F.nll_loss(x.log_softmax(-1).flatten(0, 1), torch.zeros(x.size(0) * x.size(1), dtype=torch.long),
                      size_average=True)


def upsample_deprecated(x, lens):
    return F.upsample(x.transpose(1, 2), scale_factor=2)


def affine_grid_default_align(x, lens):
    theta = torch.eye(2, 3).expand(x.size(0), 2, 3)
    grid = F.affine_grid(theta, (x.size(0), 1, x.size(1), x.size(2)))
    return F.grid_sample(x.unsqueeze(1), grid)


def user_warning_with_sizes(x, lens):
    """The program's own warning, at odd lengths, with the sizes in the text."""
    if x.size(1) % 2:
        warnings.warn(f"odd length {x.size(1)} in a batch of {x.size(0)}")
    return x * 2


WARNS = {
    "mha_mismatched_masks": mha_mismatched_masks,
    "mse_broadcast_target": mse_broadcast_target,
    "softmax_implicit_dim": softmax_implicit_dim,
    "nll_loss_legacy_argument": nll_loss_legacy_argument,
    "upsample_deprecated": upsample_deprecated,
    "affine_grid_default_align": affine_grid_default_align,
    "user_warning_with_sizes": user_warning_with_sizes,
}


def _warned(fn, args):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [(str(w.message), w.category.__name__, w.filename, w.lineno) for w in seen]


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=X[n])])
                                  if n in X else n for n in WARNS])
def test_warnings_at_changing_sizes(name):
    global MHA_WARN
    torch.manual_seed(0)
    MHA_WARN = nn.MultiheadAttention(4, 2, batch_first=True)
    fn = WARNS[name]
    opt = specularch.optimize(fn)
    for i in range(9):
        args = mask_args(i)[0]
        eager_out, eager_warned = _warned(fn, args)
        opt_out, opt_warned = _warned(opt, args)
        assert_same(eager_out, opt_out, f"call #{i + 1} result", **_tolerance(False))
        assert opt_warned == eager_warned, (
            f"call #{i + 1}: eager warned {eager_warned}\n  optimized warned {opt_warned}")
    report = specularch.explain(opt)
    assert not [f for f in report.fallbacks if f.kind == "internal_error"], report
    _show(name, report)


# =================================================================== compiling backends
# The same layers with a compiling backend pinned (each graph compiled for every size), and
# tiered (backend "auto": a hot graph compiled in the background and tried on live calls).
# A compiled graph must draw eager's random numbers (docs/tiering.md "Guarantees").

class RNNDropout(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 5, num_layers=2, dropout=0.4, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


PINNED = {
    "masks_from_lengths-torchscript": (LengthMask, mask_args),
    "cross_entropy_ignore_index-torchscript": (_mk(CE, "ignore"), ce_args),
    # (the length fixed: the compiled LSTM / GRU serves one length, here every call from the 4th)
    "gru_dropout_between_layers-torchscript": (_mk(RNNDropout, "GRU"), lambda i: A(T(b(i) + 1, 5, 4, requires_grad=True))),
    "lstm_dropout_between_layers-torchscript": (_mk(RNNDropout, "LSTM"), lambda i: A(T(b(i) + 1, 5, 4, requires_grad=True))),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=X[n])])
                                  if n in X else n for n in PINNED])
def test_pinned_compiling_backend_over_changing_sizes(name):
    make, make_args = PINNED[name]
    report = check_module(make, make_args, calls=CALLS, grad=True, backend=name.rsplit("-", 1)[1],
                          rtol=1e-4, atol=1e-5)
    _show(name, report)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=[pytest.mark.xfail(strict=True, reason=X[f"tiered-{k}"])])
                                  if f"tiered-{k}" in X else k for k in ("GRU", "Dropout")])
def test_tiered_rnn_dropout_draws_eagers_numbers(kind, monkeypatch):
    """Hot after 3 calls, TorchScript the one candidate and always kept if it passes its
    checks: every call's output and the generator's state after it must stay eager's."""
    monkeypatch.setattr(policy, "CANDIDATES", ("torchscript",))
    monkeypatch.setattr(policy, "faster", lambda candidate, current: True)

    def make():
        if kind == "Dropout":  # the control: nn.Dropout, which tiering knows draws numbers
            return nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.4), nn.Linear(5, 5))
        return RNNDropout(kind)
    torch.manual_seed(0)
    eager, model = make(), make()
    model.load_state_dict(eager.state_dict())
    specularch.optimize(model)
    with specularch.config.patch(tier_min_hits=3, tier_min_seconds=1e-6, tier_trial_calls=2):
        try:
            for i in range(24):
                if i == 12:
                    tiering.wait(timeout=120)
                x = T(3, 5, 4, seed=i)
                torch.manual_seed(i)
                want, want_rng = eager(x), torch.get_rng_state()
                torch.manual_seed(i)
                got, got_rng = model(x), torch.get_rng_state()
                assert_same(want, got, f"call #{i + 1}", rtol=1e-4, atol=1e-5)
                assert torch.equal(want_rng, got_rng), f"call #{i + 1}: the generator's state differs"
        finally:
            tiering.wait(timeout=120)
    _show(f"tiered-{kind}", specularch.explain(model))
