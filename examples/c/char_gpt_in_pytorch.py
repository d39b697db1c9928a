#!/usr/bin/env python3
"""Loads a checkpoint of train_char_gpt into nanoGPT's GPT in PyTorch and computes its validation loss.

    python3 examples/c/char_gpt_in_pytorch.py char_gpt.safetensors [--data FILE|DIR] [--block T] [--layers L]
                                              [--heads H] [--embd C] [--batch-size B] [--eval-batches E]

The module is bench/gpt_anchor.py's (nanoGPT's structure and state_dict keys, lm_head.weight tied to
transformer.wte.weight). The checkpoint's parameters load with load_state_dict(strict=True) (both keys of the tied
weight are in the file, as PyTorch's state_dict gives them); the optimizer's state (optimizer.*) is left aside. The
corpus, vocabulary, split and validation batches are the example's (the same splitmix64 offsets from seed 1234567),
so the loss printed, PyTorch's from dpar's weights in eval mode, is the example's last "val loss" (to float
rounding). Pass the model options the example was run with. Needs torch and numpy (not needed to build or test dpar).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import gpt_anchor  # noqa: E402

MASK = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        state = {}
        for name, t in header.items():
            if name == "__metadata__" or name.startswith("optimizer."):
                continue
            begin, end = t["data_offsets"]
            f.seek(8 + n + begin)
            dtype = {"F32": np.float32, "I64": np.int64}[t["dtype"]]
            state[name] = torch.from_numpy(np.frombuffer(f.read(end - begin), dtype).copy().reshape(t["shape"]))
    return state


def load_corpus(path):
    if not os.path.isdir(path):
        return open(path, "rb").read()
    names = sorted(n for n in os.listdir(path)
                   if not n.startswith(".") and not n.endswith(".dat") and not n.endswith(".u8")
                   and os.path.isfile(os.path.join(path, n)))
    return b"".join(open(os.path.join(path, n), "rb").read() for n in names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--data", default="/usr/share/games/fortunes")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-batches", type=int, default=8)
    args = ap.parse_args()
    corpus = load_corpus(args.data)
    vocab = sorted(set(corpus))
    id_of = {b: i for i, b in enumerate(vocab)}
    tokens = np.array([id_of[b] for b in corpus], np.int64)
    val = tokens[len(tokens) * 9 // 10:]
    model = gpt_anchor.make_gpt(torch, len(vocab), args.block, args.layers, args.heads, args.embd)
    print(model.load_state_dict(load_safetensors(args.checkpoint), strict=True))
    model.eval()
    state, total, count = 1234567, 0.0, 0
    T = args.block
    with torch.no_grad():
        for _ in range(args.eval_batches):
            offsets = []
            for _ in range(args.batch_size):
                state, r = splitmix64(state)
                offsets.append(r % (len(val) - T - 1))
            x = torch.from_numpy(np.stack([val[o:o + T] for o in offsets]))
            y = torch.from_numpy(np.stack([val[o + 1:o + T + 1] for o in offsets]))
            logits = model(x)
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, len(vocab)).double(), y.reshape(-1),
                                                       reduction="sum").item()
            count += y.numel()
    print(f"validation loss in PyTorch from dpar's checkpoint: {total / count:.4f}")


if __name__ == "__main__":
    main()
