#!/usr/bin/env python3
"""Writes tests/data/token_loss_reference.json: what PyTorch's nn.CrossEntropyLoss() (its default
ignore_index=-100) computes for a GPT's (B, T, V) logits and (B, T) targets, for tests/test_token_loss.cpp.

Usage (needs torch; not needed to build or run the tests):
    python tests/reference/make_token_loss_reference.py > tests/data/token_loss_reference.json

Each case is logits (B, T, V) and targets (B, T) with some -100, given to the loss as a GPT gives them:
loss = F.cross_entropy(logits.view(-1, V), targets.view(-1)). It holds the mean loss and d(mean)/d(logits), and
the sum (reduction='sum') and d(sum)/d(logits), which is what a replica computes before the engine divides by the
global count of targets that are not ignored. Every value is a float32 written as the exact double.
"""
import json

import torch
import torch.nn.functional as F


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def case(name, B, T, V, ignored, gen):
    logits = (torch.randn(B, T, V, generator=gen) * 2.0).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=gen)
    for b, t in ignored:
        targets[b, t] = -100
    mean = F.cross_entropy(logits.view(-1, V), targets.view(-1))  # nn.CrossEntropyLoss()'s defaults
    (dmean,) = torch.autograd.grad(mean, logits)
    total = F.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="sum")
    (dsum,) = torch.autograd.grad(total, logits)
    return {"name": name, "B": B, "T": T, "V": V, "logits": as_list(logits),
            "targets": [int(v) for v in targets.reshape(-1).tolist()],
            "counted": int((targets != -100).sum()), "loss_mean": float(mean.detach()), "dlogits_mean": as_list(dmean),
            "loss_sum": float(total.detach()), "dlogits_sum": as_list(dsum)}


def main():
    gen = torch.Generator().manual_seed(20240611)
    cases = [
        # A whole sequence ignored (row 1), and scattered positions of the others.
        case("gpt_3x5x7", 3, 5, 7, [(0, 0), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 4)], gen),
        # Nothing ignored: the plain mean over B*T tokens.
        case("none_ignored_2x4x11", 2, 4, 11, [], gen),
    ]
    print(json.dumps({"torch_version": torch.__version__, "ignore_index": -100, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
