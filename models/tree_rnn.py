"""TreeRNN over binary parse trees (Stanford-sentiment style): a recursive Python function
over ``data.Tree`` objects computes ``tanh(W [h_left; h_right] + b)`` at each node and
classifies the root into 5 classes. A batch is a list of trees (sentences). With an
embedding wider than the hidden state (the ``never_seen`` preset: Tai et al.'s 300 and 150),
a leaf's state is ``tanh(W_leaf e + b)``; otherwise it is the embedding itself."""
import torch
import torch.nn.functional as F
from torch import nn

from . import data

NAME, UNIT = "tree_rnn", "sentences/s"
PRESETS = {"tiny": {"vocab": 50, "hidden": 8, "batch": 2, "min_leaves": 5, "max_leaves": 8},
           "cpu": {"vocab": 5000, "hidden": 64, "batch": 8, "min_leaves": 5, "max_leaves": 30},
           "paper": {"vocab": 21701, "hidden": 300, "batch": 25, "min_leaves": 5, "max_leaves": 30},
           # python -m specularch.bench's never-seen regime: one new tree per step
           "never_seen": {"vocab": 5000, "embed": 300, "hidden": 150, "batch": 1,
                          "min_leaves": 5, "max_leaves": 30}}


class TreeRNN(nn.Module):
    def __init__(self, vocab, hidden, classes=5, embed=None):
        super().__init__()
        embed = embed or hidden
        self.embed = nn.Embedding(vocab, embed)
        self.leaf = (nn.Identity() if embed == hidden else
                     nn.Sequential(nn.Linear(embed, hidden), nn.Tanh()))
        self.compose = nn.Linear(2 * hidden, hidden)
        self.classify = nn.Linear(hidden, classes)

    def encode(self, tree):
        if tree.is_leaf:
            return self.leaf(self.embed(torch.tensor([tree.word], device=self.embed.weight.device)))
        children = torch.cat([self.encode(tree.left), self.encode(tree.right)], dim=1)
        return torch.tanh(self.compose(children))

    def forward(self, trees):
        return self.classify(torch.cat([self.encode(t) for t in trees]))


def build(preset):
    p = PRESETS[preset]
    return TreeRNN(p["vocab"], p["hidden"], embed=p.get("embed"))


def make_batch(preset, generator, step=0, last=False):
    p = PRESETS[preset]
    count = data.last_batch_size(p["batch"]) if last else p["batch"]
    trees = [data.random_tree(generator, p["vocab"], p["min_leaves"], p["max_leaves"])
             for _ in range(count)]
    return trees, torch.tensor([t.label for t in trees])


def loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def items(batch):
    return len(batch[0])
