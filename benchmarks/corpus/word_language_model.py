"""Word-level language model: Embedding -> 2-layer LSTM -> Linear decoder with tied weights,
truncated BPTT over a batchified corpus (the last chunk is shorter), the hidden state detached
between batches, gradient clipping, a hand-written SGD update `p.data.add_(p.grad, alpha=-lr)`
and the learning rate divided by 4 when validation loss stops improving."""
import math
import sys

import torch
import torch.nn as nn


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2, tie_weights=True):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight
        self.nhid, self.nlayers = nhid, nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def main(steps=10, optimize=lambda obj: obj, bptt=6, epochs=2):
    torch.manual_seed(1111)
    ntokens, batch_size = 40, 4
    g = torch.Generator().manual_seed(0)
    # a corpus with structure: each token mostly follows its predecessor + 1
    corpus = (torch.arange(batch_size * bptt * steps // epochs + 3) * 7
              + torch.randint(0, 3, (batch_size * bptt * steps // epochs + 3,), generator=g)) % ntokens
    train_data = batchify(corpus, batch_size)
    val_data = batchify(corpus.flip(0), batch_size)
    model = optimize(RNNModel(ntokens, 16, 16, 2))
    criterion = nn.NLLLoss()
    lr, clip = 5.0, 0.25

    def train_step(data, targets, hidden, lr):
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        return loss.item(), hidden

    train_step = optimize(train_step)

    def evaluate(data_source):
        model.eval()
        total_loss = 0.
        hidden = model.init_hidden(batch_size)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, bptt):
                data, targets = get_batch(data_source, i, bptt)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    losses, best_val_loss, val_losses = [], None, []
    for epoch in range(1, epochs + 1):
        model.train()
        hidden = model.init_hidden(batch_size)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
            data, targets = get_batch(train_data, i, bptt)
            hidden = repackage_hidden(hidden)
            loss, hidden = train_step(data, targets, hidden, lr)
            losses.append(loss)
        val_loss = evaluate(val_data)
        val_losses.append(val_loss)
        print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f} | "
              f"valid ppl {math.exp(val_loss):8.2f}")
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            lr /= 4.0  # anneal the learning rate when validation stops improving
    return {"losses": losses, "val_losses": val_losses, "lr": lr, "params": model.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
