#!/usr/bin/env python3
"""Writes tests/data/layernorm_embedding_reference.json: what PyTorch's LayerNorm and Embedding compute, for
tests/test_norm_embedding.cpp to compare dpar's layers against.

Usage (needs torch and numpy; not needed to build or run the tests):
    python tests/reference/make_layernorm_embedding_reference.py > tests/data/layernorm_embedding_reference.json

Each LayerNorm case is one layer given weight and bias (affine), input x and the loss sum(out * dout): its output
and the gradients of x, weight and bias. Each Embedding case is one layer given its weight, indices (with repeats)
and the loss sum(out * dout): its output and the weight's gradient (one case with a padding_idx, given as PyTorch
resolves it). Every value is a float32 written as the exact
double.
"""
import json

import torch


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def layernorm_case(name, shape, affine, eps, gen):
    d = shape[-1]
    module = torch.nn.LayerNorm(d, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            module.weight.copy_(torch.rand(d, generator=gen) + 0.5)
            module.bias.copy_(torch.randn(d, generator=gen))
    x = (torch.randn(*shape, generator=gen) * 3.0 + 2.0).requires_grad_(True)
    dout = torch.randn(*shape, generator=gen)
    y = module(x)
    (y * dout).sum().backward()
    out = {"name": name, "shape": list(shape), "affine": affine, "eps": eps, "x": as_list(x), "dout": as_list(dout),
           "output": as_list(y), "dx": as_list(x.grad)}
    if affine:
        out.update(weight=as_list(module.weight), bias=as_list(module.bias), dweight=as_list(module.weight.grad),
                   dbias=as_list(module.bias.grad))
    return out


def embedding_case(name, num, dim, idx_shape, gen, padding_idx=None):
    module = torch.nn.Embedding(num, dim, padding_idx=padding_idx)
    with torch.no_grad():
        module.weight.copy_(torch.randn(num, dim, generator=gen))
    idx = torch.randint(0, num, idx_shape, generator=gen)
    idx.view(-1)[1] = idx.view(-1)[0]  # a repeated index: its rows' gradients add up
    if padding_idx is not None:
        idx.view(-1)[2] = padding_idx % num  # read, but its row gets no gradient
    y = module(idx)
    dout = torch.randn(*y.shape, generator=gen)
    (y * dout).sum().backward()
    return {"name": name, "padding_idx": -1 if padding_idx is None else padding_idx % num, "num_embeddings": num,
            "embedding_dim": dim, "index_shape": list(idx_shape),
            "weight": as_list(module.weight), "indices": [int(v) for v in idx.reshape(-1).tolist()],
            "dout": as_list(dout), "output": as_list(y), "dweight": as_list(module.weight.grad)}


def main():
    gen = torch.Generator().manual_seed(2026)
    torch.manual_seed(2026)
    print(json.dumps({
        "torch_version": torch.__version__,
        "layernorm": [layernorm_case("2d_affine", (5, 8), True, 1e-5, gen),
                      layernorm_case("3d_affine", (3, 4, 6), True, 1e-5, gen),
                      layernorm_case("3d_plain", (2, 3, 5), False, 1e-3, gen)],
        "embedding": [embedding_case("bt", 10, 4, (3, 5), gen), embedding_case("b", 6, 3, (7,), gen),
                      embedding_case("bt_padded", 8, 3, (4, 3), gen, padding_idx=-3)],
    }))


if __name__ == "__main__":
    main()
