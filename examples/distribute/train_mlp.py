"""A plain single-process training script (input for `python -m specularch.ddp_convert`)."""
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
BATCH = int(os.environ.get("BATCH", "8"))
SHUFFLE = os.environ.get("SHUFFLE", "1") == "1"
LR = 0.05

g = torch.Generator().manual_seed(1)
features = torch.randn(64, 5, generator=g)
targets = features @ torch.randn(5, 1, generator=g) + 0.1
dataset = TensorDataset(features, targets)
loader = DataLoader(dataset, batch_size=BATCH, shuffle=SHUFFLE)

model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=LR)

for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    print(f"epoch {epoch} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "checkpoint.pt")
