"""ResNet-50 (bottleneck blocks [3, 4, 6, 3]); smaller presets keep the block structure."""
import torch.nn.functional as F
from torch import nn

from . import data

NAME, UNIT = "resnet", "examples/s"
PRESETS = {"tiny": {"batch": 2, "blocks": [1, 1, 1, 1], "width": 4, "size": 32, "classes": 10},
           "cpu": {"batch": 8, "blocks": [1, 1, 1, 1], "width": 16, "size": 64, "classes": 100},
           "paper": {"batch": 64, "blocks": [3, 4, 6, 3], "width": 64, "size": 224, "classes": 1000}}


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    def __init__(self, blocks, width, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, inplanes = [], width
        for i, count in enumerate(blocks):
            planes = width * 2 ** i
            for j in range(count):
                layers.append(Bottleneck(inplanes, planes, stride=2 if j == 0 and i > 0 else 1))
                inplanes = planes * Bottleneck.expansion
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.layers:
            x = block(x)
        return self.fc(x.mean((2, 3)))


def build(preset):
    p = PRESETS[preset]
    return ResNet(p["blocks"], p["width"], p["classes"])


def make_batch(preset, generator, step=0, last=False):
    return data.image_batch(PRESETS[preset], generator, last=last)


loss = data.classification_loss
items = data.batch_size
