#!/usr/bin/env python3
"""Writes tests/data/decay_groups_reference.json: PyTorch training Linear + BatchNorm1d + Linear with two parameter
groups, weight decay for the Linear weights and none for the bias and the BatchNorm's weight and bias, for
tests/test_decay_groups.cpp to compare dpar_engine_set_weight_decay_exclusion's steps against.

Usage (needs torch and numpy; not needed to build or run the tests):
    python tests/reference/make_decay_groups_reference.py > tests/data/decay_groups_reference.json

The first Linear has no bias, as before a BatchNorm: the normalisation cancels such a bias, whose gradient is then
rounding noise that Adam would scale up to full steps, in PyTorch and dpar alike but not the same noise.

Each case trains the same initial parameters for `steps` steps of the mean cross-entropy over the batches xs/ys
(one per step), with SGD (momentum, weight decay) or AdamW, single-tensor path (foreach=False), in float32. Every
value is a float32 written as the exact double.
"""
import json

import numpy as np
import torch


def f32(x):
    return float(np.float32(x))


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))


def groups(model, weight_decay):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("1.")]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("1."))]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(init, make_opt, xs, ys):
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), init):
            p.copy_(v)
    model.train()
    opt = make_opt(model)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {n: as_list(p) for n, p in model.named_parameters()}


def main():
    torch.manual_seed(7)
    gen = torch.Generator().manual_seed(7)
    init_model = make_model()
    with torch.no_grad():  # a BatchNorm affine transform other than the identity
        init_model[1].weight.copy_(torch.rand(6, generator=gen) + 0.5)
        init_model[1].bias.copy_(torch.randn(6, generator=gen) * 0.5)
    init = [p.detach().clone() for p in init_model.parameters()]
    steps, rows = 4, 9
    xs = [torch.randn(rows, 4, generator=gen) * 1.5 for _ in range(steps)]
    ys = [torch.randint(0, 3, (rows,), generator=gen) for _ in range(steps)]
    sgd = dict(lr=f32(0.1), momentum=f32(0.9), weight_decay=f32(0.05))
    adamw = dict(lr=f32(0.01), betas=(0.9, 0.999), eps=1e-8, weight_decay=f32(0.2))
    cases = [
        {"optimizer": "sgd", "hyper": sgd,
         "params": train(init, lambda m: torch.optim.SGD(groups(m, sgd["weight_decay"]), lr=sgd["lr"],
                                                          momentum=sgd["momentum"], foreach=False), xs, ys)},
        {"optimizer": "adamw", "hyper": {"lr": adamw["lr"], "beta1": f32(0.9), "beta2": f32(0.999),
                                         "eps": f32(1e-8), "weight_decay": adamw["weight_decay"]},
         "params": train(init, lambda m: torch.optim.AdamW(groups(m, adamw["weight_decay"]), lr=adamw["lr"],
                                                            betas=adamw["betas"], eps=adamw["eps"], foreach=False),
                         xs, ys)},
    ]
    print(json.dumps({"torch": torch.__version__, "names": [n for n, _ in init_model.named_parameters()],
                      "init": [as_list(p) for p in init], "xs": [as_list(x) for x in xs],
                      "ys": [[int(v) for v in y.tolist()] for y in ys], "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
