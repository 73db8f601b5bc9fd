"""TreeRNN over binary parse trees (Stanford-sentiment style): a recursive Python function
over ``data.Tree`` objects computes ``tanh(W [h_left; h_right] + b)`` at each node and
classifies the root into 5 classes. A batch is a list of trees (sentences)."""
import torch
import torch.nn.functional as F
from torch import nn

from . import data

NAME, UNIT = "tree_rnn", "sentences/s"
PRESETS = {"tiny": {"vocab": 50, "hidden": 8, "batch": 2, "min_leaves": 5, "max_leaves": 8},
           "cpu": {"vocab": 5000, "hidden": 64, "batch": 8, "min_leaves": 5, "max_leaves": 30},
           "paper": {"vocab": 21701, "hidden": 300, "batch": 25, "min_leaves": 5, "max_leaves": 30}}


class TreeRNN(nn.Module):
    def __init__(self, vocab, hidden, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.compose = nn.Linear(2 * hidden, hidden)
        self.classify = nn.Linear(hidden, classes)

    def encode(self, tree):
        if tree.is_leaf:
            return self.embed(torch.tensor([tree.word], device=self.embed.weight.device))
        children = torch.cat([self.encode(tree.left), self.encode(tree.right)], dim=1)
        return torch.tanh(self.compose(children))

    def forward(self, trees):
        return self.classify(torch.cat([self.encode(t) for t in trees]))


def build(preset):
    p = PRESETS[preset]
    return TreeRNN(p["vocab"], p["hidden"])


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
