#!/usr/bin/env python3
"""Writes tests/data/conv_reference.json: convolutions and poolings computed by PyTorch (CPU, float32) that
tests/test_conv.cpp compares dpar's layers against: inputs, weights, bias, the gradient of the output, and PyTorch's
output and gradients (input, weight, bias), for small shapes.

Usage (needs torch; not needed to build or run the tests):
    /work/torchenv/bin/python tests/reference/make_conv_reference.py > tests/data/conv_reference.json

Values are float32, written as the exact double of each float so that C++ reads back the same bits. Max pooling
inputs are drawn from a few integers so that windows hold ties: PyTorch routes each window's gradient to its first
maximum in row-major order, and so must dpar.
"""
import json
import sys

import torch


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


CONV_CASES = [
    # name, N, C_in, C_out, H, W, kernel, stride, padding, dilation, groups, bias
    ("basic", 2, 3, 4, 6, 5, (3, 3), (1, 1), (1, 1), (1, 1), 1, True),
    ("stride2_pad1", 2, 2, 3, 7, 8, (3, 3), (2, 2), (1, 1), (1, 1), 1, True),
    ("dilation2", 1, 2, 2, 9, 9, (3, 3), (1, 1), (2, 2), (2, 2), 1, True),
    ("groups2", 2, 4, 6, 5, 6, (3, 3), (1, 1), (0, 0), (1, 1), 2, True),
    ("depthwise", 2, 3, 3, 6, 6, (3, 3), (1, 1), (1, 1), (1, 1), 3, True),
    ("one_by_one", 3, 5, 4, 4, 3, (1, 1), (1, 1), (0, 0), (1, 1), 1, True),
    ("no_bias", 2, 3, 2, 5, 5, (2, 2), (1, 1), (0, 0), (1, 1), 1, False),
    ("odd", 2, 2, 4, 7, 9, (3, 2), (2, 1), (1, 0), (1, 2), 2, True),
]

POOL_CASES = [
    # name, kind, N, C, H, W, kernel, stride, padding
    ("max_2x2", "max", 2, 3, 6, 6, (2, 2), (2, 2), (0, 0)),
    ("max_3x3_s2_p1", "max", 2, 2, 7, 6, (3, 3), (2, 2), (1, 1)),
    ("max_overlap_ties", "max", 1, 2, 5, 5, (3, 2), (1, 1), (0, 1)),
    ("avg_2x2", "avg", 2, 3, 6, 5, (2, 2), (2, 2), (0, 0)),
    ("avg_3x3_s2_p1", "avg", 2, 2, 7, 6, (3, 3), (2, 2), (1, 1)),
    ("adaptive_avg_1x1", "adaptive_avg", 2, 3, 5, 4, None, None, None),
]


def main():
    gen = torch.Generator().manual_seed(2024)
    conv = []
    for name, n, cin, cout, h, w, k, s, p, d, g, bias in CONV_CASES:
        layer = torch.nn.Conv2d(cin, cout, k, stride=s, padding=p, dilation=d, groups=g, bias=bias)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.5)
            if bias:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen) * 0.5)
        x = torch.randn(n, cin, h, w, generator=gen).requires_grad_(True)
        y = layer(x)
        dy = torch.randn(y.shape, generator=gen)
        y.backward(dy)
        conv.append(dict(name=name, n=n, c_in=cin, c_out=cout, h=h, w=w, kernel=list(k), stride=list(s),
                         padding=list(p), dilation=list(d), groups=g, bias=bias, x=as_list(x),
                         weight=as_list(layer.weight), b=as_list(layer.bias) if bias else [], out_shape=list(y.shape),
                         y=as_list(y), dy=as_list(dy), dx=as_list(x.grad), dweight=as_list(layer.weight.grad),
                         dbias=as_list(layer.bias.grad) if bias else []))
    pool = []
    for name, kind, n, c, h, w, k, s, p in POOL_CASES:
        if kind == "max":
            x = torch.randint(-2, 3, (n, c, h, w), generator=gen).to(torch.float32)  # ties in most windows
            layer = torch.nn.MaxPool2d(k, stride=s, padding=p)
        elif kind == "avg":
            x = torch.randn(n, c, h, w, generator=gen)
            layer = torch.nn.AvgPool2d(k, stride=s, padding=p)  # count_include_pad=True, ceil_mode=False
        else:
            x = torch.randn(n, c, h, w, generator=gen)
            layer = torch.nn.AdaptiveAvgPool2d((1, 1))
        x.requires_grad_(True)
        y = layer(x)
        dy = torch.randn(y.shape, generator=gen)
        y.backward(dy)
        pool.append(dict(name=name, kind=kind, n=n, c=c, h=h, w=w, kernel=list(k) if k else [0, 0],
                         stride=list(s) if s else [0, 0], padding=list(p) if p else [0, 0], x=as_list(x),
                         out_shape=list(y.shape), y=as_list(y), dy=as_list(dy), dx=as_list(x.grad)))
    json.dump(dict(generator=f"torch {torch.__version__}, CPU, float32", conv=conv, pool=pool), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
