"""Siamese network: one CNN + BatchNorm tower applied twice through `forward_once`, a
contrastive loss module on `F.pairwise_distance` with `torch.clamp(margin - d, min=0)`, pairs
drawn with `random` (same class or not), SGD with momentum, and a no_grad evaluation that
thresholds distances."""
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(2),
        )
        self.fc = nn.Sequential(nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Linear(32, 8))

    def forward_once(self, x):
        output = self.cnn(x)
        output = output.view(output.size()[0], -1)
        return self.fc(output)

    def forward(self, input1, input2):
        output1 = self.forward_once(input1)
        output2 = self.forward_once(input2)
        return output1, output2


class ContrastiveLoss(nn.Module):
    def __init__(self, margin=2.0):
        super().__init__()
        self.margin = margin

    def forward(self, output1, output2, label):
        distance = F.pairwise_distance(output1, output2, keepdim=True)
        return torch.mean((1 - label) * torch.pow(distance, 2)
                          + label * torch.pow(torch.clamp(self.margin - distance, min=0.0), 2))


def make_pairs(images, labels, n, rng):
    by_class = {}
    for i, c in enumerate(labels.tolist()):
        by_class.setdefault(c, []).append(i)
    first, second, different = [], [], []
    for _ in range(n):
        i = rng.randrange(len(labels))
        same = rng.random() < 0.5
        if same:
            j = rng.choice(by_class[labels[i].item()])
        else:
            j = rng.choice([k for k in range(len(labels)) if labels[k] != labels[i]])
        first.append(i)
        second.append(j)
        different.append(0.0 if same else 1.0)
    return images[first], images[second], torch.tensor(different).unsqueeze(1)


def main(steps=12, optimize=lambda obj: obj, batch_size=8):
    torch.manual_seed(7)
    rng = random.Random(7)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (64,), generator=g)
    templates = torch.randn(4, 1, 8, 8, generator=g)
    images = templates[labels] + 0.5 * torch.randn(64, 1, 8, 8, generator=g)
    net = optimize(SiameseNetwork())
    criterion = ContrastiveLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def train_step(img0, img1, label):
        optimizer.zero_grad()
        output1, output2 = net(img0, img1)
        loss_contrastive = criterion(output1, output2, label)
        loss_contrastive.backward()
        optimizer.step()
        return loss_contrastive.item()

    train_step = optimize(train_step)
    net.train()
    losses = []
    for i in range(steps):
        losses.append(train_step(*make_pairs(images, labels, batch_size, rng)))
        if i % 4 == 0:
            print(f"Iteration {i}\n Current loss {losses[-1]:.4f}")
    net.eval()
    with torch.no_grad():
        img0, img1, label = make_pairs(images, labels, 32, rng)
        out0, out1 = net(img0, img1)
        predicted = (F.pairwise_distance(out0, out1, keepdim=True) > 1.0).float()
        accuracy = (predicted == label).float().mean().item()
    return {"losses": losses, "accuracy": accuracy, "params": net.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
