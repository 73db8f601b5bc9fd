"""DCGAN: a ConvTranspose2d generator and a Conv2d discriminator with BatchNorm, custom weight
init through `Module.apply`, an `input.is_cuda and self.ngpu > 1` check in forward, BCELoss
with labels made by `torch.full` and reset by `fill_`, `fake.detach()` for the discriminator
step, two Adam optimizers, and `.item()` statistics per iteration."""
import sys

import torch
import torch.nn as nn
import torch.optim as optim

nz, ngf, ndf, nc = 8, 8, 8, 1


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def main(steps=12, optimize=lambda obj: obj, batch_size=8):
    torch.manual_seed(999)
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(-1, 1, 16)
    real_images = (ramp.view(1, 1, 16, 1) * ramp.view(1, 1, 1, 16)
                   + 0.1 * torch.randn(batch_size * steps, 1, 16, 16, generator=g)).clamp(-1, 1)
    netG = Generator(ngpu=1).to(device)
    netG.apply(weights_init)
    netD = Discriminator(ngpu=1).to(device)
    netD.apply(weights_init)
    netG, netD = optimize(netG), optimize(netD)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(batch_size, nz, 1, 1, device=device)
    real_label, fake_label = 1., 0.
    optimizerD = optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def train_step(real_cpu):
        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        b_size = real_cpu.size(0)
        label = torch.full((b_size,), real_label, dtype=real_cpu.dtype, device=device)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()
        noise = torch.randn(b_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()
        optimizerG.step()
        return errD.item(), errG.item(), D_x, D_G_z1, D_G_z2

    train_step = optimize(train_step)
    history = []
    for i in range(steps):
        real_cpu = real_images[i * batch_size:(i + 1) * batch_size].to(device)
        errD, errG, D_x, D_G_z1, D_G_z2 = train_step(real_cpu)
        history.append((errD, errG, D_x, D_G_z1, D_G_z2))
        if i % 4 == 0:
            print(f"[{i}/{steps}] Loss_D: {errD:.4f} Loss_G: {errG:.4f} D(x): {D_x:.4f} "
                  f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}")
    with torch.no_grad():
        fake = netG(fixed_noise).detach().cpu()
    return {"history": history, "fake": fake, "G": netG.state_dict(), "D": netD.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
