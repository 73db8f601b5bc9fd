"""Refused by `python -m specularch.ddp_convert`: the optimizer is created conditionally."""
import torch
from torch import nn

model = nn.Linear(3, 1)
if torch.rand(()) > 0.5:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
else:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
