#!/usr/bin/env python3
"""Writes tests/data/batchnorm_reference.json: what PyTorch's BatchNorm1d and BatchNorm2d compute, for
tests/test_batchnorm.cpp to compare dpar's BatchNorm layers against.

Usage (needs torch and numpy; not needed to build or run the tests):
    python tests/reference/make_batchnorm_reference.py > tests/data/batchnorm_reference.json

Each case is one layer, given weight and bias (affine), in training mode for `steps` forward passes over the
inputs xs[0..steps) (each moving the running statistics), the loss sum(out * dout) on the first, so that the
gradients are those of dout; then eval mode on x_eval. Every value is a float32 written as the exact double.
"""
import json

import numpy as np
import torch


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def case(name, module, shape, affine, gen, steps=3):
    c = shape[1]
    if affine:
        with torch.no_grad():
            module.weight.copy_(torch.rand(c, generator=gen) + 0.5)
            module.bias.copy_(torch.randn(c, generator=gen))
    xs = [torch.randn(*shape, generator=gen) * 2.0 + 0.5 for _ in range(steps)]
    dout = torch.randn(*shape, generator=gen)
    x_eval = torch.randn(*shape, generator=gen)
    out = {"name": name, "shape": list(shape), "affine": affine, "eps": float(np.float32(module.eps)),
           "momentum": float(np.float32(module.momentum)), "xs": [as_list(x) for x in xs], "dout": as_list(dout),
           "x_eval": as_list(x_eval)}
    if affine:
        out["weight"] = as_list(module.weight)
        out["bias"] = as_list(module.bias)
    module.train()
    outputs = []
    for i, x in enumerate(xs):
        x = x.clone().requires_grad_(True)
        y = module(x)
        outputs.append(as_list(y))
        if i == 0:
            (y * dout).sum().backward()
            out["dx"] = as_list(x.grad)
            if affine:
                out["dweight"] = as_list(module.weight.grad)
                out["dbias"] = as_list(module.bias.grad)
    out["outputs"] = outputs
    out["running_mean"] = as_list(module.running_mean)
    out["running_var"] = as_list(module.running_var)
    out["num_batches_tracked"] = int(module.num_batches_tracked.item())
    module.eval()
    with torch.no_grad():
        out["eval_output"] = as_list(module(x_eval))
    return out


def main():
    gen = torch.Generator().manual_seed(2024)
    cases = [
        case("bn1d_2d_affine", torch.nn.BatchNorm1d(3), (6, 3), True, gen),
        case("bn1d_3d_plain", torch.nn.BatchNorm1d(3, affine=False), (4, 3, 5), False, gen),
        case("bn2d_affine", torch.nn.BatchNorm2d(2, eps=1e-3, momentum=0.2), (3, 2, 3, 4), True, gen),
    ]
    print(json.dumps({"torch": torch.__version__, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
