#!/usr/bin/env python3
"""Writes tests/data/gpt_reference.json: what nanoGPT's GPT in PyTorch computes for one batch, for
tests/test_transformer.cpp to compare dpar's GPT (examples/c/char_gpt.h, through the C ABI) against.

Usage (needs torch; not needed to build or run the tests):
    python tests/reference/make_gpt_reference.py > tests/data/gpt_reference.json

The module is bench/gpt_anchor.py's (nanoGPT's structure and names, lm_head tied to transformer.wte): vocabulary 13,
context 8, 2 layers, 2 heads, 16 channels, dropout 0, PyTorch's default initialisation from seed 0. One batch of
(3, 6) tokens with targets, three of them -100 (ignored). The file holds every parameter by its named_parameters()
name (the tied one once, as transformer.wte.weight), the tokens and targets, F.cross_entropy's mean loss over the
targets not ignored, and every parameter's gradient. Every value is a float32 written as the exact double.
"autocast" holds the same batch's loss and gradients with the forward under torch.autocast("cpu", dtype=bfloat16)
(the loss in f32), for dpar's bf16 precision policy.

Beside it, "mha": torch.nn.MultiheadAttention(8, 2, bias=True, batch_first=True) as causal self-attention,
module(x, x, x, need_weights=False, attn_mask=causal, is_causal=True)[0] on x (2, 5, 8), with the loss
sum(out * dout): its parameters, x, dout, the output and every gradient (x's included).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import gpt_anchor  # noqa: E402


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def main():
    torch.manual_seed(0)
    V, T_max, L, H, C = 13, 8, 2, 2, 16
    model = gpt_anchor.make_gpt(torch, V, T_max, L, H, C)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (3, 6), generator=gen)
    targets = torch.randint(0, V, (3, 6), generator=gen)
    targets[0, 2] = targets[1, 5] = targets[2, 0] = -100
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))
    loss.backward()
    out = {"vocab": V, "block": T_max, "layers": L, "heads": H, "embd": C, "tokens": idx.reshape(-1).tolist(),
           "targets": targets.reshape(-1).tolist(), "shape": list(idx.shape), "loss": float(loss.detach()),
           "params": {n: as_list(p) for n, p in model.named_parameters()},
           "grads": {n: as_list(p.grad) for n, p in model.named_parameters()},
           "state_dict_keys": list(model.state_dict().keys())}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, V), targets.view(-1))
    loss.backward()
    out["autocast"] = {"loss": float(loss.detach()),
                       "grads": {n: as_list(p.grad) for n, p in model.named_parameters()}}
    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(8, 2, bias=True, batch_first=True)
    with torch.no_grad():  # nonzero biases, so that their use shows
        mha.in_proj_bias.uniform_(-0.5, 0.5)
        mha.out_proj.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 5, 8, requires_grad=True)
    dout = torch.randn(2, 5, 8)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    y = mha(x, x, x, need_weights=False, attn_mask=causal, is_causal=True)[0]
    (y * dout).sum().backward()
    out["mha"] = {"x": as_list(x), "dout": as_list(dout), "output": as_list(y),
                  "dx": as_list(x.grad), "params": {n: as_list(p) for n, p in mha.named_parameters()},
                  "grads": {n: as_list(p.grad) for n, p in mha.named_parameters()}}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
