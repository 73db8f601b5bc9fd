"""Time-sequence prediction: two stacked LSTMCells unrolled by a Python loop over
`input.split(1, dim=1)`, an optional `future` loop feeding predictions back, double precision,
the LBFGS optimizer driving a `closure` that prints the loss, and a no_grad prediction of
future steps."""
import sys

import torch
import torch.nn as nn
import torch.optim as optim


class Sequence(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        c_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def main(steps=3, optimize=lambda obj: obj, length=12):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    T = 20
    x = torch.arange(length, dtype=torch.double) + torch.randint(-4 * T, 4 * T, (8, 1),
                                                                 generator=g).double()
    data = torch.sin(x / T)
    input, target = data[3:, :-1], data[3:, 1:]
    test_input, test_target = data[:3, :-1], data[:3, 1:]
    seq = Sequence().double()
    seq = optimize(seq)
    criterion = nn.MSELoss()
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)
    closure_losses = []

    def closure():
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        print("loss:", loss.item())
        closure_losses.append(loss.item())
        loss.backward()
        return loss

    closure = optimize(closure)
    test_losses = []
    for i in range(steps):
        print("STEP: ", i)
        optimizer.step(closure)
        with torch.no_grad():
            future = 4
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print("test loss:", loss.item())
            test_losses.append(loss.item())
    return {"closure_losses": closure_losses, "test_losses": test_losses, "pred": pred,
            "params": seq.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
