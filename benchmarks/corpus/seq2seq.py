"""Sequence-to-sequence translation with GRUs, one token at a time: an encoder loop over the
input sentence, a decoder fed its own predictions (`topk(1)`, `.detach()`) or the target
(teacher forcing chosen by `random.random()`), an early `break` on the end-of-sentence token
found with `.item()`, NLLLoss accumulated over steps, two SGD optimizers; sentences of
varying length from a toy "reverse the sequence" language."""
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim

SOS_token, EOS_token = 0, 1


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        output, hidden = self.gru(embedded, hidden)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size)


class DecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size):
        super().__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)

    def forward(self, input, hidden):
        output = F.relu(self.embedding(input).view(1, 1, -1))
        output, hidden = self.gru(output, hidden)
        return F.log_softmax(self.out(output[0]), dim=1), hidden


def make_pair(rng, n_words):
    words = [rng.randrange(2, n_words) for _ in range(rng.randint(2, 4))]
    source = torch.tensor(words + [EOS_token]).view(-1, 1)
    target = torch.tensor(words[::-1] + [EOS_token]).view(-1, 1)
    return source, target


def main(steps=10, optimize=lambda obj: obj, teacher_forcing_ratio=0.5, max_length=8):
    torch.manual_seed(3)
    random.seed(3)
    n_words, hidden_size = 12, 16
    pair_rng = random.Random(5)
    pairs = [make_pair(pair_rng, n_words) for _ in range(steps)]
    encoder = optimize(EncoderRNN(n_words, hidden_size))
    decoder = optimize(DecoderRNN(hidden_size, n_words))
    encoder_optimizer = optim.SGD(encoder.parameters(), lr=0.05)
    decoder_optimizer = optim.SGD(decoder.parameters(), lr=0.05)
    criterion = nn.NLLLoss()

    def train_step(input_tensor, target_tensor):
        encoder_hidden = encoder.initHidden()
        encoder_optimizer.zero_grad()
        decoder_optimizer.zero_grad()
        input_length, target_length = input_tensor.size(0), target_tensor.size(0)
        loss = 0
        for ei in range(input_length):
            encoder_output, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
        decoder_input = torch.tensor([[SOS_token]])
        decoder_hidden = encoder_hidden
        use_teacher_forcing = True if random.random() < teacher_forcing_ratio else False
        if use_teacher_forcing:
            for di in range(target_length):
                decoder_output, decoder_hidden = decoder(decoder_input, decoder_hidden)
                loss += criterion(decoder_output, target_tensor[di])
                decoder_input = target_tensor[di]  # teacher forcing
        else:
            for di in range(target_length):
                decoder_output, decoder_hidden = decoder(decoder_input, decoder_hidden)
                topv, topi = decoder_output.topk(1)
                decoder_input = topi.squeeze().detach()  # its own prediction as the next input
                loss += criterion(decoder_output, target_tensor[di])
                if decoder_input.item() == EOS_token:
                    break
        loss.backward()
        encoder_optimizer.step()
        decoder_optimizer.step()
        return loss.item() / target_length

    train_step = optimize(train_step)
    losses = []
    for it in range(1, steps + 1):
        losses.append(train_step(*pairs[it - 1]))
        if it % 5 == 0:
            print(f"iter {it} ({it / steps * 100:.0f}%) loss {sum(losses[-5:]) / 5:.4f}")
    return {"losses": losses, "encoder": encoder.state_dict(), "decoder": decoder.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
