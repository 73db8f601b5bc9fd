"""Synthetic data with realistic shapes (seeded ``torch.Generator``), and the real
handwritten-digits dataset that ships inside scikit-learn (no network access)."""
from __future__ import annotations

import torch


def images(generator, batch, channels, size):
    return torch.rand(batch, channels, size, size, generator=generator)


def labels(generator, batch, classes):
    return torch.randint(0, classes, (batch,), generator=generator)


def last_batch_size(batch: int, minimum: int = 1) -> int:
    """The size of an epoch's short last batch (what is left over): about three quarters of
    a full one, at least ``minimum`` (2 for models with BatchNorm in training mode)."""
    return max(minimum, batch * 3 // 4)


def image_batch(preset: dict, generator, channels: int = 3, last: bool = False):
    """(images, labels) for an image-classification preset with batch/size/classes;
    ``last``: the epoch's short last batch."""
    batch = last_batch_size(preset["batch"], 2) if last else preset["batch"]
    return (images(generator, batch, channels, preset["size"]),
            labels(generator, batch, preset["classes"]))


def classification_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def batch_size(batch):
    return batch[0].shape[0]


def token_batches(generator, vocab, batch, min_len, max_len, total_tokens):
    """An epoch of (tokens[T, B], next-tokens[T, B]) batches: lengths vary between
    ``min_len`` and ``max_len``, and the last batch is smaller than the others."""
    stream = torch.randint(0, vocab, (total_tokens,), generator=generator)
    per_column = total_tokens // batch
    columns = stream[: per_column * batch].view(batch, per_column).t()
    start, end = 0, per_column - 1
    while True:
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        if start + length >= end:
            break
        yield columns[start:start + length], columns[start + 1:start + 1 + length]
        start += length
    last = min(end - start, max(1, min_len - 1))  # the short final batch of the epoch
    yield columns[start:start + last], columns[start + 1:start + 1 + last]


def token_batch(generator, preset: dict, last: bool = False):
    """One (tokens[T, B], next-tokens[T, B]) batch with a random length in [min_len, max_len];
    ``last``: the epoch's short last batch (``min_len - 1`` steps, as ``token_batches``)."""
    if last:
        length = max(1, preset["min_len"] - 1)
    else:
        length = int(torch.randint(preset["min_len"], preset["max_len"] + 1, (1,),
                                   generator=generator))
    tokens = torch.randint(0, preset["vocab"], (length + 1, preset["batch"]), generator=generator)
    return tokens[:-1], tokens[1:]


class Tree:
    """A binary parse tree: a leaf holds a word id; a node holds two children."""

    def __init__(self, word=None, left=None, right=None, label=0):
        self.word, self.left, self.right, self.label = word, left, right, label

    @property
    def is_leaf(self):
        return self.word is not None

    def leaves(self):
        return 1 if self.is_leaf else self.left.leaves() + self.right.leaves()


def random_tree(generator, vocab, min_leaves=5, max_leaves=30, classes=5):
    n = int(torch.randint(min_leaves, max_leaves + 1, (1,), generator=generator))

    def build(count):
        if count == 1:
            return Tree(word=int(torch.randint(0, vocab, (1,), generator=generator)))
        split = int(torch.randint(1, count, (1,), generator=generator))
        return Tree(left=build(split), right=build(count - split))

    tree = build(n)
    tree.label = int(torch.randint(0, classes, (1,), generator=generator))
    return tree


def digits(size=28):
    """scikit-learn's 8x8 handwritten digits (1797 images), scaled to [0, 1] and zero-padded
    and bilinearly resized to ``size``x``size`` for LeNet. Raises ImportError without
    scikit-learn (``pip install '.[bench]'``)."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = torch.nn.functional.interpolate(x, size=(size - 8, size - 8), mode="bilinear",
                                        align_corners=False)
    x = torch.nn.functional.pad(x, (4, 4, 4, 4))
    return x.clamp(0, 1), torch.tensor(data.target, dtype=torch.int64)
