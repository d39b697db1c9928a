#!/usr/bin/env python3
"""PyTorch's CPU anchor of bench_conv: the same convolution layers, trained the same way, timed the same way.

    python3 bench/conv_anchor.py --threads T --seconds S

For each configuration of bench_conv.c (the same list, in the same order) it builds nn.Conv2d (PyTorch's
initialisation), a fixed input and target drawn once, and times training steps of MSELoss + SGD(lr 0.01): forward,
loss, backward (input gradient included: the input requires grad, as a layer inside a network would), step, with
torch.set_num_threads(T). 5 warm-up steps, then steps until S seconds: one line per configuration,
"conv_anchor name=<name> median_ms=<ms>". Without torch it prints why and exits 0.
"""
import argparse
import statistics
import sys
import time

# bench/bench_conv.c's kConfigs: name, batch, C_in, C_out, H (= W), kernel, stride, padding, groups
CONFIGS = [
    ("3x3_32to64_16px", 32, 32, 64, 16, 3, 1, 1, 1),
    ("3x3_s2_64to128_16px", 32, 64, 128, 16, 3, 2, 1, 1),
    ("1x1_64to64_16px", 32, 64, 64, 16, 1, 1, 0, 1),
    ("depthwise3x3_64_16px", 32, 64, 64, 16, 3, 1, 1, 64),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=1.0)
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"conv_anchor no torch ({e})")
        return 0
    torch.set_num_threads(a.threads)
    print(f"conv_anchor torch {torch.__version__}, {a.threads} thread(s)")
    for name, n, cin, cout, hw, k, s, p, g in CONFIGS:
        torch.manual_seed(0)
        layer = torch.nn.Conv2d(cin, cout, k, stride=s, padding=p, groups=g)
        opt = torch.optim.SGD(layer.parameters(), lr=0.01)
        x = torch.rand(n, cin, hw, hw, requires_grad=True)
        with torch.no_grad():
            y = torch.rand_like(layer(x))
        times = []
        start = time.perf_counter()
        for i in range(1000000):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            x.grad = None
            loss = torch.nn.functional.mse_loss(layer(x), y)
            loss.backward()
            opt.step()
            t1 = time.perf_counter()
            if i >= 5:
                times.append(t1 - t0)
                if t1 - start > a.seconds and len(times) >= 10:
                    break
        print(f"conv_anchor name={name} median_ms={statistics.median(times) * 1e3:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
