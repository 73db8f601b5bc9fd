"""Variational auto-encoder: encoder to (mu, logvar), the reparameterization trick with
`torch.randn_like`, a sigmoid decoder, BCE + KL-divergence loss summed over the batch, Adam,
a no_grad test pass and sampling from the prior."""
import sys

import torch
import torch.nn.functional as F
from torch import nn, optim

IMAGE = 64  # 8x8 "images"


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IMAGE, 32)
        self.fc21 = nn.Linear(32, 4)
        self.fc22 = nn.Linear(32, 4)
        self.fc3 = nn.Linear(4, 32)
        self.fc4 = nn.Linear(32, IMAGE)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, IMAGE))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, IMAGE), reduction="sum")
    # KL(N(mu, sigma) || N(0, 1)), summed over the batch
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def main(steps=12, optimize=lambda obj: obj, batch_size=16):
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(0)
    prototypes = torch.rand(4, 1, 8, 8, generator=g)
    data = (prototypes[torch.randint(0, 4, (batch_size * steps,), generator=g)]
            + 0.1 * torch.rand(batch_size * steps, 1, 8, 8, generator=g)).clamp(0, 1)
    model = optimize(VAE())
    optimizer = optim.Adam(model.parameters(), lr=1e-3)

    def train_step(batch):
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(batch)
        loss = loss_function(recon_batch, batch, mu, logvar)
        loss.backward()
        optimizer.step()
        return loss.item()

    train_step = optimize(train_step)
    model.train()
    losses = []
    for i in range(steps):
        batch = data[i * batch_size:(i + 1) * batch_size]
        losses.append(train_step(batch) / len(batch))
    model.eval()
    with torch.no_grad():
        recon, mu, logvar = model(data[:batch_size])
        test_loss = loss_function(recon, data[:batch_size], mu, logvar).item() / batch_size
        sample = model.decode(torch.randn(8, 4)).view(8, 1, 8, 8)
    print(f"====> Test set loss: {test_loss:.4f}")
    return {"losses": losses, "test_loss": test_loss, "sample": sample,
            "params": model.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
