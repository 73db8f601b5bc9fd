"""MNIST-style CNN classifier: Conv2d, Dropout, max_pool2d, log_softmax, nll_loss, Adadelta with
a StepLR schedule stepped once per epoch, `.item()` logging and a no_grad test pass.
Synthetic 1x16x16 "digits" (a class-dependent blob plus noise) stand in for MNIST."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def make_digits(n, generator):
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = torch.randn(n, 1, 16, 16, generator=generator) * 0.3
    for i, label in enumerate(labels.tolist()):  # a bright square whose place encodes the class
        r, c = divmod(label, 4)
        images[i, 0, 3 * r + 2:3 * r + 6, 3 * c + 2:3 * c + 6] += 1.0
    return images, labels


def main(steps=12, optimize=lambda obj: obj, log_interval=4, epochs=2):
    torch.manual_seed(1)
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    train_set = TensorDataset(*make_digits(16 * steps, g))
    test_set = TensorDataset(*make_digits(64, g))
    train_loader = DataLoader(train_set, batch_size=16, shuffle=True,
                              generator=torch.Generator().manual_seed(2))
    test_loader = DataLoader(test_set, batch_size=32)

    model = optimize(Net().to(device))
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)

    def train_step(data, target):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        return loss

    train_step = optimize(train_step)
    losses, accuracy = [], []
    for epoch in range(1, epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            loss = train_step(data, target)
            losses.append(loss.item())
            if batch_idx % log_interval == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]"
                      f"\tLoss: {loss.item():.6f}")
        model.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()
        test_loss /= len(test_loader.dataset)
        accuracy.append(correct / len(test_loader.dataset))
        print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)}")
        scheduler.step()
    return {"losses": losses, "accuracy": accuracy, "params": model.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
