"""Binary TreeLSTM (Tai et al. 2015, N-ary form with N=2), recursive over ``data.Tree``."""
import torch
import torch.nn.functional as F
from torch import nn

from . import tree_rnn

NAME, UNIT = "tree_lstm", "sentences/s"
PRESETS = tree_rnn.PRESETS


class TreeLSTM(nn.Module):
    def __init__(self, vocab, hidden, classes=5, embed=None):
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(vocab, embed or hidden)
        self.leaf = nn.Linear(embed or hidden, 3 * hidden)  # i, o, u for leaves
        self.node = nn.Linear(2 * hidden, 5 * hidden)       # i, o, u, f_left, f_right
        self.classify = nn.Linear(hidden, classes)

    def encode(self, tree):
        if tree.is_leaf:
            word = torch.tensor([tree.word], device=self.embed.weight.device)
            i, o, u = self.leaf(self.embed(word)).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u)
            return torch.sigmoid(o) * torch.tanh(c), c
        h_l, c_l = self.encode(tree.left)
        h_r, c_r = self.encode(tree.right)
        i, o, u, f_l, f_r = self.node(torch.cat([h_l, h_r], dim=1)).chunk(5, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f_l) * c_l + torch.sigmoid(f_r) * c_r
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, trees):
        return self.classify(torch.cat([self.encode(t)[0] for t in trees]))


def build(preset):
    p = PRESETS[preset]
    return TreeLSTM(p["vocab"], p["hidden"], embed=p.get("embed"))


make_batch = tree_rnn.make_batch


def loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def items(batch):
    return len(batch[0])
