"""Graph attention network: multi-head attention layers registered with `add_module` in a
loop, attention logits `LeakyReLU(Wh_i . a1 + Wh_j . a2)` masked to the adjacency with
`torch.where` (hidden heads) and `masked_fill` (output head), softmax + dropout over
neighbours, ELU, heads joined by `torch.cat` over a list comprehension, Adam, and early
stopping bookkeeping in Python."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, dropout, alpha, concat=True, use_where=True):
        super().__init__()
        self.dropout, self.alpha, self.concat = dropout, alpha, concat
        self.out_features, self.use_where = out_features, use_where
        self.W = nn.Parameter(torch.empty(size=(in_features, out_features)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.empty(size=(2 * out_features, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(self.alpha)

    def forward(self, h, adj):
        Wh = torch.mm(h, self.W)
        Wh1 = torch.matmul(Wh, self.a[:self.out_features, :])
        Wh2 = torch.matmul(Wh, self.a[self.out_features:, :])
        e = self.leakyrelu(Wh1 + Wh2.T)
        if self.use_where:
            zero_vec = -9e15 * torch.ones_like(e)
            attention = torch.where(adj > 0, e, zero_vec)
        else:
            attention = e.masked_fill(adj == 0, float("-inf"))
        attention = F.softmax(attention, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime


class GAT(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout, alpha, nheads):
        super().__init__()
        self.dropout = dropout
        self.attentions = [GraphAttentionLayer(nfeat, nhid, dropout=dropout, alpha=alpha)
                           for _ in range(nheads)]
        for i, attention in enumerate(self.attentions):
            self.add_module("attention_{}".format(i), attention)
        self.out_att = GraphAttentionLayer(nhid * nheads, nclass, dropout=dropout, alpha=alpha,
                                           concat=False, use_where=False)

    def forward(self, x, adj):
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.cat([att(x, adj) for att in self.attentions], dim=1)
        x = F.dropout(x, self.dropout, training=self.training)
        x = F.elu(self.out_att(x, adj))
        return F.log_softmax(x, dim=1)


def main(steps=12, optimize=lambda obj: obj, patience=5):
    torch.manual_seed(72)
    g = torch.Generator().manual_seed(0)
    n, nfeat, nclass = 30, 10, 3
    labels = torch.randint(0, nclass, (n,), generator=g)
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    adj = (torch.rand(n, n, generator=g) < torch.where(same, 0.3, 0.03)).float()
    adj = ((adj + adj.t() + torch.eye(n)) > 0).float()
    features = torch.randn(n, nfeat, generator=g) + F.one_hot(labels, nfeat).float()
    idx_train, idx_val = torch.arange(0, 15), torch.arange(15, 30)
    model = optimize(GAT(nfeat, nhid=8, nclass=nclass, dropout=0.6, alpha=0.2, nheads=2))
    optimizer = optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

    def train_step():
        model.train()
        optimizer.zero_grad()
        output = model(features, adj)
        loss_train = F.nll_loss(output[idx_train], labels[idx_train])
        loss_train.backward()
        optimizer.step()
        return loss_train.item()

    train_step = optimize(train_step)
    losses, val_losses, bad_counter, best = [], [], 0, float("inf")
    for epoch in range(steps):
        losses.append(train_step())
        model.eval()
        with torch.no_grad():
            output = model(features, adj)
        loss_val = F.nll_loss(output[idx_val], labels[idx_val]).item()
        val_losses.append(loss_val)
        if loss_val < best:
            best, bad_counter = loss_val, 0
        else:
            bad_counter += 1
        if bad_counter == patience:
            break
        if epoch % 4 == 0:
            print(f"Epoch: {epoch + 1:04d} loss_train: {losses[-1]:.4f} loss_val: {loss_val:.4f}")
    return {"losses": losses, "val_losses": val_losses, "params": model.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
