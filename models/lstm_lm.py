"""PTB-style LSTM language model: LSTMCells run by a Python loop over time steps; the
hidden state is kept on ``self`` between batches (truncated BPTT: detached), and reset when
the batch size changes or on ``reset_state()``."""
import torch
import torch.nn.functional as F
from torch import nn

from . import data

NAME, UNIT = "lstm_lm", "words/s"
PRESETS = {"tiny": {"vocab": 50, "hidden": 16, "layers": 1, "batch": 4, "min_len": 3, "max_len": 6},
           "cpu": {"vocab": 2000, "hidden": 128, "layers": 2, "batch": 20, "min_len": 20, "max_len": 35},
           "paper": {"vocab": 10000, "hidden": 650, "layers": 2, "batch": 20, "min_len": 35, "max_len": 35},
           # python -m specularch.bench's never-seen regime: a new random BPTT length per batch
           # (Zaremba et al.'s small LM, no dropout; the cpu preset's vocabulary, so the step
           # is not all decoder matmul)
           "never_seen": {"vocab": 2000, "hidden": 200, "layers": 2, "batch": 20, "min_len": 15,
                          "max_len": 25, "dropout": 0.0}}


class LSTMLM(nn.Module):
    def __init__(self, vocab, hidden, layers, dropout=0.2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cells = nn.ModuleList([nn.LSTMCell(hidden, hidden) for _ in range(layers)])
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(hidden, vocab)
        self.state = None

    def reset_state(self):
        self.state = None

    def forward(self, tokens):
        batch = tokens.shape[1]
        if self.state is None or self.state[0][0].shape[0] != batch:
            zeros = torch.zeros(batch, self.decoder.in_features, device=tokens.device)
            self.state = [(zeros, zeros) for _ in self.cells]
        state = [(h.detach(), c.detach()) for h, c in self.state]
        outputs = []
        for t in range(tokens.shape[0]):
            x = self.drop(self.embed(tokens[t]))
            for i, cell in enumerate(self.cells):
                h, c = cell(x, state[i])
                state[i] = (h, c)
                x = self.drop(h)
            outputs.append(self.decoder(x))
        self.state = state
        return torch.stack(outputs)


def build(preset):
    p = PRESETS[preset]
    return LSTMLM(p["vocab"], p["hidden"], p["layers"], p.get("dropout", 0.2))


def epoch(preset, generator, batches=8):
    p = PRESETS[preset]
    total = p["batch"] * (p["max_len"] * batches + 3)
    return data.token_batches(generator, p["vocab"], p["batch"], p["min_len"], p["max_len"], total)


def make_batch(preset, generator, step=0, last=False):
    return data.token_batch(generator, PRESETS[preset], last=last)


def loss(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def items(batch):
    return batch[0].numel()
