"""Inception-v3 (Szegedy et al. 2016): the stem, 3x Inception-A (35x35), reduction B,
4x Inception-C with factorised 1x7/7x1 convolutions (17x17), reduction D, 2x Inception-E
with expanded 1x3/3x1 branches (8x8), global pooling and a classifier. Channel counts are the
paper's at ``width=1.0`` (299x299 input); smaller presets scale every channel count by
``width`` and use a smaller input (the blocks and their order stay the same)."""
import torch
import torch.nn.functional as F
from torch import nn

from . import data

NAME, UNIT = "inception", "examples/s"
PRESETS = {"tiny": {"batch": 2, "width": 0.0625, "size": 75, "classes": 10},
           "cpu": {"batch": 4, "width": 0.25, "size": 107, "classes": 100},
           "paper": {"batch": 32, "width": 1.0, "size": 299, "classes": 1000}}


class Conv(nn.Module):
    def __init__(self, cin, cout, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    def __init__(self, cin, pool_features, c):
        super().__init__()
        self.b1 = Conv(cin, c(64), 1)
        self.b5_1, self.b5_2 = Conv(cin, c(48), 1), Conv(c(48), c(64), 5, padding=2)
        self.b3_1 = Conv(cin, c(64), 1)
        self.b3_2 = Conv(c(64), c(96), 3, padding=1)
        self.b3_3 = Conv(c(96), c(96), 3, padding=1)
        self.pool = Conv(cin, pool_features, 1)
        self.out_channels = c(64) + c(64) + c(96) + pool_features

    def forward(self, x):
        b5 = self.b5_2(self.b5_1(x))
        b3 = self.b3_3(self.b3_2(self.b3_1(x)))
        pool = self.pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), b5, b3, pool], 1)


class InceptionB(nn.Module):
    """Grid reduction 35x35 -> 17x17."""

    def __init__(self, cin, c):
        super().__init__()
        self.b3 = Conv(cin, c(384), 3, stride=2)
        self.d1, self.d2 = Conv(cin, c(64), 1), Conv(c(64), c(96), 3, padding=1)
        self.d3 = Conv(c(96), c(96), 3, stride=2)
        self.out_channels = c(384) + c(96) + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.d3(self.d2(self.d1(x))), F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    """Factorised 7x7 convolutions (1x7 then 7x1) at 17x17."""

    def __init__(self, cin, c7, c):
        super().__init__()
        self.b1 = Conv(cin, c(192), 1)
        self.b7 = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (1, 7), padding=(0, 3)),
                                Conv(c7, c(192), (7, 1), padding=(3, 0)))
        self.dbl = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (7, 1), padding=(3, 0)),
                                 Conv(c7, c7, (1, 7), padding=(0, 3)),
                                 Conv(c7, c7, (7, 1), padding=(3, 0)),
                                 Conv(c7, c(192), (1, 7), padding=(0, 3)))
        self.pool = Conv(cin, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x):
        pool = self.pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b7(x), self.dbl(x), pool], 1)


class InceptionD(nn.Module):
    """Grid reduction 17x17 -> 8x8."""

    def __init__(self, cin, c):
        super().__init__()
        self.b3 = nn.Sequential(Conv(cin, c(192), 1), Conv(c(192), c(320), 3, stride=2))
        self.b7 = nn.Sequential(Conv(cin, c(192), 1), Conv(c(192), c(192), (1, 7), padding=(0, 3)),
                                Conv(c(192), c(192), (7, 1), padding=(3, 0)),
                                Conv(c(192), c(192), 3, stride=2))
        self.out_channels = c(320) + c(192) + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """Expanded filter banks (1x3 and 3x1 side by side) at 8x8."""

    def __init__(self, cin, c):
        super().__init__()
        self.b1 = Conv(cin, c(320), 1)
        self.b3_1 = Conv(cin, c(384), 1)
        self.b3_a = Conv(c(384), c(384), (1, 3), padding=(0, 1))
        self.b3_b = Conv(c(384), c(384), (3, 1), padding=(1, 0))
        self.d1, self.d2 = Conv(cin, c(448), 1), Conv(c(448), c(384), 3, padding=1)
        self.d3_a = Conv(c(384), c(384), (1, 3), padding=(0, 1))
        self.d3_b = Conv(c(384), c(384), (3, 1), padding=(1, 0))
        self.pool = Conv(cin, c(192), 1)
        self.out_channels = c(320) + 2 * c(384) + 2 * c(384) + c(192)

    def forward(self, x):
        b3 = self.b3_1(x)
        d = self.d2(self.d1(x))
        pool = self.pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b3_a(b3), self.b3_b(b3), self.d3_a(d), self.d3_b(d),
                          pool], 1)


class InceptionV3(nn.Module):
    def __init__(self, width=1.0, classes=1000):
        super().__init__()

        def c(n):
            return max(4, int(n * width))
        self.stem = nn.Sequential(Conv(3, c(32), 3, stride=2), Conv(c(32), c(32), 3),
                                  Conv(c(32), c(64), 3, padding=1), nn.MaxPool2d(3, 2),
                                  Conv(c(64), c(80), 1), Conv(c(80), c(192), 3), nn.MaxPool2d(3, 2))
        blocks, cin = [], c(192)
        for pool in (c(32), c(64), c(64)):
            blocks.append(InceptionA(cin, pool, c))
            cin = blocks[-1].out_channels
        blocks.append(InceptionB(cin, c))
        cin = blocks[-1].out_channels
        for c7 in (c(128), c(160), c(160), c(192)):
            blocks.append(InceptionC(cin, c7, c))
            cin = blocks[-1].out_channels
        blocks.append(InceptionD(cin, c))
        cin = blocks[-1].out_channels
        for _ in range(2):
            blocks.append(InceptionE(cin, c))
            cin = blocks[-1].out_channels
        self.blocks = nn.ModuleList(blocks)
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(self.dropout(x.mean((2, 3))))


def build(preset):
    p = PRESETS[preset]
    return InceptionV3(p["width"], p["classes"])


def make_batch(preset, generator, step=0, last=False):
    return data.image_batch(PRESETS[preset], generator, last=last)


loss = data.classification_loss
items = data.batch_size
