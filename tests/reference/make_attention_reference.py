#!/usr/bin/env python3
"""Writes tests/data/attention_reference.json: what PyTorch's F.scaled_dot_product_attention computes, for
tests/test_attention.cpp to compare dpar's attention op against.

Usage (needs torch; not needed to build or run the tests):
    python tests/reference/make_attention_reference.py > tests/data/attention_reference.json

Each case is q, k, v of shape (B, positions, C) split into `heads` heads as a GPT splits them
(x.view(B, T, heads, D).transpose(1, 2)), the attention without dropout (causal or not, the default scale or a given
one), its output merged back to (B, L, C), and the gradients of q, k and v for the loss sum(out * dout). Every value
is a float32 written as the exact double.
"""
import json

import torch
import torch.nn.functional as F


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def case(name, B, L, S, heads, D, causal, scale, gen):
    C = heads * D
    q = torch.randn(B, L, C, generator=gen).requires_grad_(True)
    k = torch.randn(B, S, C, generator=gen).requires_grad_(True)
    v = torch.randn(B, S, C, generator=gen).requires_grad_(True)
    dout = torch.randn(B, L, C, generator=gen)

    def split(x):
        return x.view(B, x.shape[1], heads, D).transpose(1, 2)

    y = F.scaled_dot_product_attention(split(q), split(k), split(v), dropout_p=0.0, is_causal=causal, scale=scale)
    out = y.transpose(1, 2).reshape(B, L, C)
    (out * dout).sum().backward()
    return {"name": name, "B": B, "L": L, "S": S, "heads": heads, "D": D, "causal": causal,
            "scale": 0.0 if scale is None else scale, "q": as_list(q), "k": as_list(k), "v": as_list(v),
            "dout": as_list(dout), "out": as_list(out), "dq": as_list(q.grad), "dk": as_list(k.grad),
            "dv": as_list(v.grad)}


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(20261129)
    cases = [
        case("causal_2heads", 2, 5, 5, 2, 4, True, None, gen),
        case("full_1head", 1, 6, 6, 1, 8, False, None, gen),
        case("cross_4heads_scale", 2, 3, 7, 4, 2, False, 0.3, gen),
        case("causal_4heads_d8", 1, 9, 9, 4, 8, True, None, gen),
    ]
    print(json.dumps({"torch": torch.__version__, "cases": cases}))


if __name__ == "__main__":
    main()
