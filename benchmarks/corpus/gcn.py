"""Graph convolutional network (Kipf & Welling style) on a dense, symmetrically normalized
adjacency matrix: `adj @ (x @ W)` layers with Parameters created by hand and initialised in
`reset_parameters`, dropout, log_softmax + nll_loss on a train mask, Adam with weight decay,
and accuracy via `max(1)[1].type_as(labels).eq(labels)`."""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim


class GraphConvolution(nn.Module):
    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        stdv = 1. / math.sqrt(self.weight.size(1))
        self.weight.data.uniform_(-stdv, stdv)
        if self.bias is not None:
            self.bias.data.uniform_(-stdv, stdv)

    def forward(self, input, adj):
        support = torch.mm(input, self.weight)
        output = torch.mm(adj, support)
        if self.bias is not None:
            return output + self.bias
        return output


class GCN(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout):
        super().__init__()
        self.gc1 = GraphConvolution(nfeat, nhid)
        self.gc2 = GraphConvolution(nhid, nclass)
        self.dropout = dropout

    def forward(self, x, adj):
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        x = self.gc2(x, adj)
        return F.log_softmax(x, dim=1)


def normalized_adjacency(adj):
    adj = adj + torch.eye(adj.size(0))
    d_inv_sqrt = adj.sum(1).pow(-0.5)
    d_inv_sqrt[torch.isinf(d_inv_sqrt)] = 0.
    return d_inv_sqrt.unsqueeze(1) * adj * d_inv_sqrt.unsqueeze(0)


def make_graph(n, nfeat, nclass, generator):
    labels = torch.randint(0, nclass, (n,), generator=generator)
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    p = torch.where(same, torch.tensor(0.3), torch.tensor(0.02))
    adj = (torch.rand(n, n, generator=generator) < p).float().triu(1)
    adj = adj + adj.t()
    features = torch.randn(n, nfeat, generator=generator) + F.one_hot(labels, nfeat).float()
    return features, normalized_adjacency(adj), labels


def accuracy(output, labels):
    preds = output.max(1)[1].type_as(labels)
    correct = preds.eq(labels).double()
    return correct.sum() / len(labels)


def main(steps=15, optimize=lambda obj: obj):
    torch.manual_seed(42)
    g = torch.Generator().manual_seed(0)
    features, adj, labels = make_graph(40, 12, 4, g)
    idx_train, idx_val = torch.arange(0, 20), torch.arange(20, 40)
    model = optimize(GCN(nfeat=12, nhid=16, nclass=4, dropout=0.5))
    optimizer = optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    def train_step(features, adj):
        model.train()
        optimizer.zero_grad()
        output = model(features, adj)
        loss_train = F.nll_loss(output[idx_train], labels[idx_train])
        acc_train = accuracy(output[idx_train], labels[idx_train])
        loss_train.backward()
        optimizer.step()
        return loss_train.item(), acc_train.item()

    train_step = optimize(train_step)
    history = []
    for epoch in range(steps):
        loss_train, acc_train = train_step(features, adj)
        model.eval()
        output = model(features, adj)
        loss_val = F.nll_loss(output[idx_val], labels[idx_val])
        acc_val = accuracy(output[idx_val], labels[idx_val])
        history.append((loss_train, acc_train, loss_val.item(), acc_val.item()))
        if epoch % 5 == 0:
            print(f"Epoch: {epoch + 1:04d} loss_train: {loss_train:.4f} acc_train: {acc_train:.4f} "
                  f"loss_val: {loss_val.item():.4f} acc_val: {acc_val.item():.4f}")
    return {"history": history, "params": model.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
