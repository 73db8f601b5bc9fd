"""What every benchmark regime shares: the unmodified training step each mode runs, and
moving a workload's batch to the device."""
from __future__ import annotations

import torch


def make_step(workload, model, device):
    """The plain SGD training step: zero_grad, forward and loss, backward, step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train_step(batch):
        opt.zero_grad()
        loss = workload.loss(model, batch)
        loss.backward()
        opt.step()
        return loss.item()
    return train_step


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def sync(device):
    """Wait for the device, so a timer read after it covers the step's kernels."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
