"""Transformer language model: Embedding scaled by sqrt(d_model), a sinusoidal PositionalEncoding
buffer with dropout, `nn.TransformerEncoder`, a causal mask built on demand in forward and
cached on the module (`self.src_mask`), CrossEntropyLoss, gradient clipping, SGD with a StepLR
schedule, and a greedy generation loop under no_grad."""
import math
import sys

import torch
import torch.nn as nn


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=64):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


class TransformerModel(nn.Module):
    def __init__(self, ntoken, ninp, nhead, nhid, nlayers, dropout=0.1):
        super().__init__()
        self.model_type = "Transformer"
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        encoder_layers = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout)
        self.transformer_encoder = nn.TransformerEncoder(encoder_layers, nlayers,
                                                         enable_nested_tensor=False)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    def _generate_square_subsequent_mask(self, sz):
        return torch.log(torch.tril(torch.ones(sz, sz)))

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, src, has_mask=True):
        if has_mask:
            device = src.device
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                self.src_mask = self._generate_square_subsequent_mask(len(src)).to(device)
        else:
            self.src_mask = None
        src = self.encoder(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.transformer_encoder(src, self.src_mask)
        return torch.log_softmax(self.decoder(output), dim=-1)


def main(steps=10, optimize=lambda obj: obj, bptt=8, batch_size=4):
    torch.manual_seed(1111)
    ntokens = 30
    g = torch.Generator().manual_seed(0)
    length = bptt * steps + 1
    stream = (torch.arange(length * batch_size).view(batch_size, length).t() * 3
              + torch.randint(0, 2, (length, batch_size), generator=g)) % ntokens
    model = optimize(TransformerModel(ntokens, ninp=16, nhead=2, nhid=32, nlayers=2))
    criterion = nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.95)

    def train_step(data, targets):
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output.view(-1, ntokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        return loss.item()

    train_step = optimize(train_step)
    model.train()
    losses = []
    for batch, i in enumerate(range(0, stream.size(0) - 1, bptt)):
        seq_len = min(bptt, stream.size(0) - 1 - i)
        data, targets = stream[i:i + seq_len], stream[i + 1:i + 1 + seq_len].reshape(-1)
        losses.append(train_step(data, targets))
        if batch % 5 == 4:
            scheduler.step()
            print(f"| batch {batch:3d} | lr {scheduler.get_last_lr()[0]:02.2f} "
                  f"| loss {losses[-1]:5.2f} | ppl {math.exp(losses[-1]):8.2f}")
    model.eval()
    generated = stream[:3, :1]
    with torch.no_grad():
        for _ in range(4):  # the sequence grows by one token per step: a new length each call
            output = model(generated)
            word = output[-1].argmax(dim=-1, keepdim=True)
            generated = torch.cat([generated, word], 0)
    return {"losses": losses, "generated": generated, "params": model.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
