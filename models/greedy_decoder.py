"""A GRU encoder-decoder trained free-running (the PyTorch seq2seq tutorial's decoder fed
its own predictions): the encoder runs over a source sentence of random length; the decoder
feeds back its own greedy prediction and stops at the end-of-sentence token
(``if token.item() == EOS: break``), at most ``max_len`` steps, the loss summed over the
steps it ran. Every step's structure is new twice over: the source length, and where the
decoder stops, which only the step itself finds out. Batch 1 (a token read with ``.item()``)."""
import torch
import torch.nn.functional as F
from torch import nn

NAME, UNIT = "greedy_decoder", "words/s"  # (source words)
SOS, EOS = 0, 1
PRESETS = {"tiny": {"vocab": 6, "hidden": 8, "min_len": 2, "max_len": 5, "decode": 6},
           "cpu": {"vocab": 16, "hidden": 64, "min_len": 3, "max_len": 10, "decode": 12},
           # the tutorial's hidden size; its sentences are at most 10 words
           "paper": {"vocab": 64, "hidden": 256, "min_len": 3, "max_len": 10, "decode": 12},
           # python -m specularch.bench's never-seen regime: a new source length and a new
           # stopping point per step (a small vocabulary: the decoder stops anywhere)
           "never_seen": {"vocab": 16, "hidden": 128, "min_len": 3, "max_len": 12, "decode": 16}}


class GreedyDecoder(nn.Module):
    def __init__(self, vocab, hidden, decode):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.GRUCell(hidden, hidden)
        self.decoder = nn.GRUCell(hidden, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.decode = decode

    def forward(self, source, target=None):
        """The loss against ``target`` (summed over the steps decoded), or without one the
        decoder's last hidden state."""
        h = torch.zeros(1, self.out.in_features, device=source.device)
        for t in range(source.shape[0]):
            h = self.encoder(self.embed(source[t]), h)
        token = torch.full((1,), SOS, dtype=torch.long, device=source.device)
        loss = torch.zeros((), device=source.device)
        for t in range(self.decode):
            h = self.decoder(self.embed(token), h)
            logits = self.out(h)
            if target is not None:
                loss = loss + F.cross_entropy(logits, target[t])
            token = logits.argmax(1).detach()
            if token.item() == EOS:
                break
        return h if target is None else loss


def build(preset):
    p = PRESETS[preset]
    return GreedyDecoder(p["vocab"], p["hidden"], p["decode"])


def make_batch(preset, generator, step=0, last=False):
    """A source of random length and its target: the source reversed, then EOS, padded with
    EOS to the decoder's budget (``target[t]`` for every step it may run); ``last``: the
    epoch's short last sentence."""
    p = PRESETS[preset]
    length = max(1, p["min_len"] - 1) if last else \
        int(torch.randint(p["min_len"], p["max_len"] + 1, (1,), generator=generator))
    words = torch.randint(2, p["vocab"], (length,), generator=generator)
    target = torch.full((p["decode"],), EOS, dtype=torch.long)
    target[:min(length, p["decode"])] = words.flip(0)[:p["decode"]]
    return words.view(-1, 1), target.view(-1, 1)


def loss(model, batch):
    return model(batch[0], batch[1])


def items(batch):
    return batch[0].shape[0]
