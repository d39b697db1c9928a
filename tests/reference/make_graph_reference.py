#!/usr/bin/env python3
"""Writes tests/data/graph_reference.json: a PyTorch module with a residual block, a projection shortcut, an
nn.Unflatten, a concatenation along dim 1 and an nn.Flatten, its state_dict (names, in order, and values), an input,
its output, and every parameter's gradient of sum(output * r). tests/test_graph.cpp builds the same graph in dpar,
names its nodes as the module's paths, loads the state_dict by name and compares.

Usage (needs torch and numpy; not needed to build or run the tests):
    python tests/reference/make_graph_reference.py > tests/data/graph_reference.json
"""
import json
import sys

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 6)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.layer1 = nn.Sequential(Block())
        self.main = nn.Linear(6, 8)
        self.down = nn.Linear(6, 8, bias=False)
        self.unflatten = nn.Unflatten(1, (2, 2, 2))
        self.act = nn.Tanh()
        self.flatten = nn.Flatten()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.layer1(self.stem(x))
        u = self.unflatten(self.main(h) + self.down(h))
        return self.head(self.flatten(torch.cat([u, self.act(u)], dim=1)))


def values(t):
    return [float(v) for v in t.detach().reshape(-1).tolist()]


def main():
    torch.manual_seed(5)
    net = Net()
    x = torch.randn(3, 4)
    out = net(x)
    r = torch.randn(out.shape)
    (out * r).sum().backward()
    params = dict(net.named_parameters())
    json.dump({
        "x_shape": list(x.shape), "x": values(x), "out": values(out), "r": values(r),
        "names": list(net.state_dict().keys()),
        "params": {k: {"shape": list(v.shape), "value": values(v), "grad": values(params[k].grad)}
                   for k, v in net.state_dict().items()},
        "torch_version": torch.__version__,
    }, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
