"""Polynomial regression: features `x, x^2, ..., x^d` built with `torch.cat` over a list
comprehension, a target function made from a random weight vector and `b.item()`, one Linear
layer, smooth-L1 loss, a hand-written update `param.data.add_(-lr * param.grad)`, a
`print` every few steps and an early stop on a Python threshold."""
import sys

import torch
import torch.nn.functional as F

POLY_DEGREE = 4


def make_features(x):
    """Builds features i.e. a matrix with columns [x, x^2, x^3, x^4]."""
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def poly_desc(W, b):
    result = "y = "
    for i, w in enumerate(W):
        result += "{:+.2f} x^{} ".format(w, i + 1)
    result += "{:+.2f}".format(b[0])
    return result


def main(steps=20, optimize=lambda obj: obj, batch_size=16, log_every=5, lr=0.1):
    torch.manual_seed(0)
    W_target = torch.randn(POLY_DEGREE, 1) * 5
    b_target = torch.randn(1) * 5

    def f(x):
        """Approximated function."""
        return x.mm(W_target) + b_target.item()

    def get_batch(batch_size=batch_size):
        """Builds a batch i.e. (x, f(x)) pair."""
        random = torch.randn(batch_size)
        x = make_features(random)
        return x, f(x)

    fc = optimize(torch.nn.Linear(W_target.size(0), 1))

    def train_step(step, batch_x, batch_y):
        fc.zero_grad()
        output = F.smooth_l1_loss(fc(batch_x), batch_y)
        loss = output.item()
        output.backward()
        for param in fc.parameters():
            param.data.add_(-lr * param.grad)
        if step % log_every == 0:
            print(f"step {step}: loss {loss:.6f}")
        return loss

    train_step = optimize(train_step)
    losses = []
    for batch_idx in range(1, steps + 1):
        batch_x, batch_y = get_batch()
        loss = train_step(batch_idx, batch_x, batch_y)
        losses.append(loss)
        if loss < 1e-3:
            break
    print("Loss: {:.6f} after {} batches".format(loss, batch_idx))
    print("==> Learned function:\t" + poly_desc(fc.weight.view(-1), fc.bias))
    print("==> Actual function:\t" + poly_desc(W_target.view(-1), b_target))
    return {"losses": losses, "params": fc.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
