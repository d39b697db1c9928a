#!/usr/bin/env python3
"""PyTorch's anchor for bench_attention: F.scaled_dot_product_attention forward + backward in f32 on the CPU, one
thread, causal, on q, k, v split from one packed (B, T, 3C) projection as a GPT splits them; the median of 20 runs
in ms, for the shapes bench_attention times."""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
SHAPES = [(8, 128, 128, 4), (16, 128, 128, 4), (32, 128, 128, 4), (8, 256, 256, 4), (16, 256, 256, 4),
          (32, 256, 256, 4)]


def time_shape(B, T, C, heads, reps=20):
    D = C // heads
    qkv = (torch.rand(B, T, 3 * C) * 2 - 1).requires_grad_(True)
    dout = torch.rand(B, T, C) * 2 - 1
    times = []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (x.view(B, T, heads, D).transpose(1, 2) for x in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        y.backward(dout)
        t1 = time.perf_counter()
        qkv.grad = None
        if r >= 2:
            times.append((t1 - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


print(f"PyTorch {torch.__version__}, F.scaled_dot_product_attention f32, 1 thread, ms (median of 20)")
for B, T, C, heads in SHAPES:
    print(f"{B:4d} {T:4d} {C:4d} {heads:5d} {C // heads:3d}  {time_shape(B, T, C, heads):10.3f}")
