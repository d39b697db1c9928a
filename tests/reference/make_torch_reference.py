#!/usr/bin/env python3
"""Writes tests/data/torch_reference.json: values computed by PyTorch that tests/test_kernels.cpp compares the
CPU kernels against (SGD, Adam and AdamW over a few steps, GELU forward/backward, cross-entropy).

Usage (needs torch and numpy; not needed to build or run the tests):
    python tests/reference/make_torch_reference.py > tests/data/torch_reference.json

Every input and hyper-parameter is a float32 value (the kernels take float), written as the exact double of that
float so C++ reads back the same bits. The optimizers run PyTorch's single-tensor path (foreach=False), on CPU,
in float32.
"""
import json
import sys

import numpy as np
import torch


def f32(x):
    """A Python float holding exactly the float32 nearest to x (what the C++ side passes as `float`)."""
    return float(np.float32(x))


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def run_optimizer(make_opt, param0, grads):
    p = torch.nn.Parameter(torch.tensor(param0, dtype=torch.float32))
    opt = make_opt([p])
    out = []
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
        out.append(as_list(p))
    return out


def main():
    gen = torch.Generator().manual_seed(1234)
    n, steps = 8, 5
    param0 = as_list(torch.randn(n, generator=gen))
    grads = [as_list(torch.randn(n, generator=gen) * 0.5) for _ in range(steps)]

    sgd_cases = [
        dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
        dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.1, nesterov=False),
        dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
    ]
    sgd = []
    for h in sgd_cases:
        h = {k: (f32(v) if isinstance(v, float) else v) for k, v in h.items()}
        traj = run_optimizer(lambda ps, h=h: torch.optim.SGD(ps, foreach=False, **h), param0, grads)
        sgd.append(dict(hyper=h, params=traj))

    adam_cases = [
        ("adam", dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)),
        ("adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
        ("adamw", dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)),
        ("adamw", dict(lr=0.003, betas=(0.4, 0.9), eps=1e-7, weight_decay=0.5)),
    ]
    adam = []
    for kind, h in adam_cases:
        h = dict(lr=f32(h["lr"]), betas=(f32(h["betas"][0]), f32(h["betas"][1])), eps=f32(h["eps"]),
                 weight_decay=f32(h["weight_decay"]))
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        traj = run_optimizer(lambda ps, h=h, cls=cls: cls(ps, foreach=False, fused=False, **h), param0, grads)
        adam.append(dict(decoupled=(kind == "adamw"), lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1],
                         eps=h["eps"], weight_decay=h["weight_decay"], params=traj))

    x = torch.tensor([-6.0, -3.0, -1.5, -0.7, -0.1, 0.0, 0.05, 0.3, 0.9, 1.7, 2.5, 5.0], requires_grad=True)
    dy = torch.linspace(-1.0, 1.5, x.numel())
    y = torch.nn.functional.gelu(x, approximate="none")
    y.backward(dy)
    gelu = dict(x=as_list(x), dout=as_list(dy), out=as_list(y), dinp=as_list(x.grad))

    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-2.5, 0.5, 0.25, 7.0], [0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    labels = torch.tensor([2, 0, 3])
    loss_sum = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    loss_sum.backward()
    ce = dict(logits=as_list(logits), labels=labels.tolist(), B=3, C=4, loss_sum=loss_sum.item(),
              loss_mean=torch.nn.functional.cross_entropy(logits, labels).item(), dlogits_sum=as_list(logits.grad))

    doc = dict(generator=f"tests/reference/make_torch_reference.py with torch {torch.__version__}",
               optim_param0=param0, optim_grads=grads, sgd=sgd, adam=adam, gelu=gelu, cross_entropy=ce)
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
