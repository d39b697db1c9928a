#!/usr/bin/env python3
"""Loads a checkpoint of train_char_gpt into nanoGPT's GPT in PyTorch and computes its validation loss; or, with
--train, trains that module in PyTorch as train_char_gpt trains it, for its loss curve beside dpar's.

    python3 examples/c/char_gpt_in_pytorch.py char_gpt.safetensors [--data FILE|DIR] [--block T] [--layers L]
                                              [--heads H] [--embd C] [--batch-size B] [--eval-batches E]
    python3 examples/c/char_gpt_in_pytorch.py --train [--steps S] [--eval-every K] [--lr LR] [--seed S] [--threads N]
                                              [the model options above]

The module is bench/gpt_anchor.py's (nanoGPT's structure and state_dict keys, lm_head.weight tied to
transformer.wte.weight). The checkpoint's parameters load with load_state_dict(strict=True) (both keys of the tied
weight are in the file, as PyTorch's state_dict gives them); the optimizer's state (optimizer.*) is left aside. The
corpus, vocabulary, split and validation batches are the example's (the same splitmix64 offsets from seed 1234567),
so the loss printed, PyTorch's from dpar's weights in eval mode, is the example's last "val loss" (to float
rounding). Pass the model options the example was run with. Needs torch and numpy (not needed to build or test dpar).

--train draws the example's training batches (the same splitmix64 offsets from the same seed, the whole global
batch), initialises as nanoGPT's _init_weights (its own draws: the values differ from dpar's, their distribution
does not), and steps AdamW (betas 0.9, 0.99; weight decay 0.1 on the matrices), with the example's warm-up and cosine
schedule and clip_grad_norm_(1.0), printing the example's lines: the same batches through the same model and
optimizer, so its losses follow dpar's to the noise of the initial draw.
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


def draw_batch(state, tokens, batch, T):
    """The example's batch: `batch` windows at splitmix64 offsets; the next state, the inputs and the targets."""
    offsets = []
    for _ in range(batch):
        state, r = splitmix64(state)
        offsets.append(r % (len(tokens) - T - 1))
    x = torch.from_numpy(np.stack([tokens[o:o + T] for o in offsets]))
    y = torch.from_numpy(np.stack([tokens[o + 1:o + T + 1] for o in offsets]))
    return state, x, y


def validation_loss(model, val, vocab_size, T, batch, batches):
    model.eval()
    state, total, count = 1234567, 0.0, 0
    with torch.no_grad():
        for _ in range(batches):
            state, x, y = draw_batch(state, val, batch, T)
            logits = model(x)
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size).double(), y.reshape(-1),
                                                       reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


def train(args, tokens, vocab_size):
    import math
    import time
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    n_train = len(tokens) * 9 // 10
    train_tokens, val = tokens[:n_train], tokens[n_train:]
    model = gpt_anchor.make_gpt(torch, vocab_size, args.block, args.layers, args.heads, args.embd)
    for name, p in model.named_parameters():  # nanoGPT's _init_weights, then its c_proj scaling
        if "ln_" in name:
            continue
        if name.endswith(".bias"):
            torch.nn.init.zeros_(p)
        else:
            std = 0.02 / math.sqrt(2 * args.layers) if name.endswith("c_proj.weight") else 0.02
            torch.nn.init.normal_(p, 0.0, std)
    opt = gpt_anchor.adamw(torch, model, args.lr)
    state = (args.seed * 0x9E3779B97F4A7C15 + 1) & MASK
    warmup = args.steps // 20
    T, B = args.block, args.batch_size
    loss_sum, since, t0 = 0.0, 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        state, x, y = draw_batch(state, train_tokens, B, T)
        progress = (step - 1) / args.steps
        scale = step / warmup if step <= warmup else 0.5 * (1.0 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = args.lr * (0.1 + 0.9 * scale)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, vocab_size), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_sum += loss.item()
        since += 1
        if step % args.eval_every and step != args.steps:
            continue
        seconds = time.perf_counter() - t0
        val_loss = validation_loss(model, val, vocab_size, T, B, args.eval_batches)
        print(f"step {step:5d}  train loss {loss_sum / since:.4f}  val loss {val_loss:.4f}  "
              f"{since * B * T / seconds:.0f} tokens/s (PyTorch, {args.threads} threads)", flush=True)
        loss_sum, since, t0 = 0.0, 0, time.perf_counter()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
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
    if args.train:
        return train(args, tokens, len(vocab))
    if not args.checkpoint:
        ap.error("a checkpoint to load, or --train")
    val = tokens[len(tokens) * 9 // 10:]
    model = gpt_anchor.make_gpt(torch, len(vocab), args.block, args.layers, args.heads, args.embd)
    print(model.load_state_dict(load_safetensors(args.checkpoint), strict=True))
    loss = validation_loss(model, val, len(vocab), args.block, args.batch_size, args.eval_batches)
    print(f"validation loss in PyTorch from dpar's checkpoint: {loss:.4f}")


if __name__ == "__main__":
    main()
