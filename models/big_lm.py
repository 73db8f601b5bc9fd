"""1B-words-style LM: a large vocabulary embedding and a full softmax (the paper's sampled
softmax over 793k words is not reproduced; the `paper` preset uses a 100k full softmax)
on top of an nn.LSTM."""
import torch.nn.functional as F
from torch import nn

from . import data

NAME, UNIT = "big_lm", "words/s"
PRESETS = {"tiny": {"vocab": 1000, "embed": 16, "hidden": 16, "batch": 4, "min_len": 4, "max_len": 6},
           "cpu": {"vocab": 50000, "embed": 64, "hidden": 128, "batch": 16, "min_len": 20, "max_len": 20},
           "paper": {"vocab": 100000, "embed": 512, "hidden": 2048, "batch": 128, "min_len": 20, "max_len": 20}}


class BigLM(nn.Module):
    def __init__(self, vocab, embed, hidden):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = nn.LSTM(embed, hidden)
        self.project = nn.Linear(hidden, embed)
        self.softmax = nn.Linear(embed, vocab)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.softmax(self.project(out))


def build(preset):
    p = PRESETS[preset]
    return BigLM(p["vocab"], p["embed"], p["hidden"])


def make_batch(preset, generator, step=0, last=False):
    return data.token_batch(generator, PRESETS[preset], last=last)


def loss(model, batch):
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


def items(batch):
    return batch[0].numel()
