"""Fast-neural-style-like transfer: a TransformerNet of reflection-padded convolutions with
InstanceNorm2d(affine=True), residual blocks and nearest-neighbour upsampling; a frozen
feature network (`requires_grad_(False)`) gives content features and Gram-matrix style
targets; images normalised with `new_tensor(...).view(-1, 1, 1)`; Adam; weighted content +
style losses accumulated as Python floats."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super().__init__()
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        residual = x
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        return out + residual


class UpsampleConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        if self.upsample:
            x = F.interpolate(x, mode="nearest", scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x))


class TransformerNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv1 = ConvLayer(3, c, kernel_size=5, stride=1)
        self.in1 = nn.InstanceNorm2d(c, affine=True)
        self.conv2 = ConvLayer(c, 2 * c, kernel_size=3, stride=2)
        self.in2 = nn.InstanceNorm2d(2 * c, affine=True)
        self.res1 = ResidualBlock(2 * c)
        self.res2 = ResidualBlock(2 * c)
        self.deconv1 = UpsampleConvLayer(2 * c, c, kernel_size=3, stride=1, upsample=2)
        self.in3 = nn.InstanceNorm2d(c, affine=True)
        self.deconv2 = ConvLayer(c, 3, kernel_size=5, stride=1)
        self.relu = nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.res2(self.res1(y))
        y = self.relu(self.in3(self.deconv1(y)))
        return self.deconv2(y)


class Features(nn.Module):
    """A small frozen stand-in for VGG: returns the activations of two stages."""

    def __init__(self):
        super().__init__()
        self.slice1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.slice2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())

    def forward(self, x):
        h1 = self.slice1(x)
        h2 = self.slice2(h1)
        return [h1, h2]


def gram_matrix(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    features_t = features.transpose(1, 2)
    return features.bmm(features_t) / (ch * h * w)


def normalize_batch(batch):
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    return (batch - mean) / std


def main(steps=8, optimize=lambda obj: obj, batch_size=2, content_weight=1e5, style_weight=1e10):
    torch.manual_seed(42)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(batch_size * steps, 3, 16, 16, generator=g)
    style = torch.rand(1, 3, 16, 16, generator=g).repeat(batch_size, 1, 1, 1)
    transformer = optimize(TransformerNet())
    optimizer = torch.optim.Adam(transformer.parameters(), 1e-3)
    mse_loss = nn.MSELoss()
    vgg = Features().requires_grad_(False)
    features_style = vgg(normalize_batch(style))
    gram_style = [gram_matrix(y) for y in features_style]

    def train_step(x):
        n_batch = len(x)
        optimizer.zero_grad()
        y = transformer(x)
        y, x = normalize_batch(y), normalize_batch(x)
        features_y, features_x = vgg(y), vgg(x)
        content_loss = content_weight * mse_loss(features_y[1], features_x[1])
        style_loss = 0.
        for ft_y, gm_s in zip(features_y, gram_style):
            gm_y = gram_matrix(ft_y)
            style_loss += mse_loss(gm_y, gm_s[:n_batch, :, :])
        style_loss *= style_weight
        total_loss = content_loss + style_loss
        total_loss.backward()
        optimizer.step()
        return content_loss.item(), style_loss.item()

    train_step = optimize(train_step)
    transformer.train()
    agg_content_loss, agg_style_loss, history = 0., 0., []
    for batch_id in range(steps):
        x = images[batch_id * batch_size:(batch_id + 1) * batch_size]
        content, style_value = train_step(x)
        agg_content_loss += content
        agg_style_loss += style_value
        history.append((content, style_value))
        if (batch_id + 1) % 4 == 0:
            print(f"[{batch_id + 1}]\tcontent: {agg_content_loss / (batch_id + 1):.6f}\t"
                  f"style: {agg_style_loss / (batch_id + 1):.6f}")
    transformer.eval()
    with torch.no_grad():
        stylized = transformer(images[:1]).clamp(0, 255)
    return {"history": history, "stylized": stylized, "params": transformer.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
