"""LeNet-5 style CNN for MNIST-shaped input (batch 50 at paper size)."""
import torch.nn.functional as F
from torch import nn

from . import data

NAME, UNIT = "lenet", "examples/s"
PRESETS = {"tiny": {"batch": 4, "c1": 2, "c2": 4, "hidden": 16},
           "cpu": {"batch": 50, "c1": 6, "c2": 16, "hidden": 120},
           "paper": {"batch": 50, "c1": 20, "c2": 50, "hidden": 500}}


class LeNet(nn.Module):
    def __init__(self, c1, c2, hidden, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 5)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.fc1 = nn.Linear(c2 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def build(preset):
    p = PRESETS[preset]
    return LeNet(p["c1"], p["c2"], p["hidden"])


def make_batch(preset, generator, step=0, last=False):
    b = PRESETS[preset]["batch"]
    b = data.last_batch_size(b) if last else b
    return data.images(generator, b, 1, 28), data.labels(generator, b, 10)


loss = data.classification_loss
items = data.batch_size
