#!/usr/bin/env python3
"""Writes tests/data/mixed_precision_reference.json: what PyTorch computes for one batch of three models under
torch.autocast("cpu", dtype=torch.bfloat16), and under dpar's bf16 contract emulated in f32, for
tests/test_mixed_precision.cpp to compare dpar's bf16 precision policy (dpar_engine_set_precision) against.

Usage (needs torch; not needed to build or run the tests):
    python tests/reference/make_mixed_precision_reference.py > tests/data/mixed_precision_reference.json

dpar's contract (src/backend/kernel_calls.h, LinearForward/LinearBackward in bf16): a linear layer or convolution
multiplies its input rounded to bf16 by its weight rounded to bf16, exactly, accumulating in f32, and adds its f32
bias; its output stays f32. Backward rounds the gradient of its output to bf16 and multiplies it by the same bf16
operands; every gradient is f32 (a linear layer's bias gradient sums the f32 gradient, a convolution's the rounded
one). Everything else runs in f32, but for a GELU after a linear layer, which dpar runs as autocast does: on the
linear's output rounded to bf16 (the pre-activation, kept so for backward), its own output rounded to bf16, its
backward in f32 from the rounded pre-activation. "emulated" below is that, written as autograd Functions over f32
tensors; "autocast" is PyTorch's own policy (which also rounds each output to bf16).

Models (PyTorch's default initialisation from fixed seeds; every parameter is in the file by its state_dict name):
  mlp: Linear(12, 32), ReLU, Linear(32, 5) on x (16, 12), cross-entropy with labels (16);
  gelu_mlp: Linear(12, 32), GELU, Linear(32, 5) on x (16, 12), cross-entropy with labels (16);
  cnn: Conv2d(2, 6, 3, padding=1), ReLU, Flatten, Linear(6*5*5, 4) on x (4, 2, 5, 5), cross-entropy.
For each: the parameters, x, labels, and for "f32", "emulated" and "autocast" the mean loss and every gradient.
Every value is a float32 written as the exact double.
"""
import json

import torch
import torch.nn.functional as F


def as_list(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


class EmulatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        xb, wb = bf16(x), bf16(w)
        ctx.save_for_backward(xb, wb)
        return xb @ wb.t() + b

    @staticmethod
    def backward(ctx, gy):
        xb, wb = ctx.saved_tensors
        g = bf16(gy)
        return g @ wb, g.t() @ xb, gy.sum(0)


class EmulatedLinearGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        xb, wb = bf16(x), bf16(w)
        pre = bf16(xb @ wb.t() + b)
        ctx.save_for_backward(xb, wb, pre)
        return bf16(F.gelu(pre))

    @staticmethod
    def backward(ctx, gy):
        xb, wb, pre = ctx.saved_tensors
        cdf = 0.5 * (1.0 + torch.erf(pre * 0.7071067811865476))
        pdf = torch.exp(-0.5 * pre * pre) * 0.3989422804014327
        gpre = gy * (cdf + pre * pdf)
        g = bf16(gpre)
        return g @ wb, g.t() @ xb, gpre.sum(0)


class EmulatedConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, padding):
        xb, wb = bf16(x), bf16(w)
        ctx.save_for_backward(xb, wb)
        ctx.padding = padding
        return F.conv2d(xb, wb, b, padding=padding)

    @staticmethod
    def backward(ctx, gy):
        xb, wb = ctx.saved_tensors
        g = bf16(gy)
        gx = torch.nn.grad.conv2d_input(xb.shape, wb, g, padding=ctx.padding)
        gw = torch.nn.grad.conv2d_weight(xb, wb.shape, g, padding=ctx.padding)
        # The bias gradient is summed from the rounded gradient too (oneDNN's and cuDNN's bf16 backward-weights
        # produce it with the weights' from the same operand), where a linear layer sums the f32 one.
        return gx, gw, g.sum((0, 2, 3)), None


def run(model, forward_emulated, x, y):
    out = {}
    for mode in ("f32", "emulated", "autocast"):
        model.zero_grad()
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
        elif mode == "emulated":
            loss = F.cross_entropy(forward_emulated(x), y)
        else:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        out[mode] = {"loss": float(loss.detach()),
                     "grads": {n: as_list(p.grad) for n, p in model.named_parameters()}}
    out["params"] = {n: as_list(p) for n, p in model.named_parameters()}
    out["x"] = as_list(x)
    out["x_shape"] = list(x.shape)
    out["labels"] = y.tolist()
    return out


def main():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    x = torch.randn(16, 12)
    y = torch.randint(0, 5, (16,))

    def mlp_emulated(v):
        h = torch.relu(EmulatedLinear.apply(v, mlp[0].weight, mlp[0].bias))
        return EmulatedLinear.apply(h, mlp[2].weight, mlp[2].bias)

    result = {"mlp": run(mlp, mlp_emulated, x, y)}

    torch.manual_seed(2)
    gelu_mlp = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    x = torch.randn(16, 12)
    y = torch.randint(0, 5, (16,))

    def gelu_mlp_emulated(v):
        h = EmulatedLinearGelu.apply(v, gelu_mlp[0].weight, gelu_mlp[0].bias)
        return EmulatedLinear.apply(h, gelu_mlp[2].weight, gelu_mlp[2].bias)

    result["gelu_mlp"] = run(gelu_mlp, gelu_mlp_emulated, x, y)

    torch.manual_seed(1)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(2, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(6 * 5 * 5, 4))
    x = torch.randn(4, 2, 5, 5)
    y = torch.randint(0, 4, (4,))

    def cnn_emulated(v):
        h = torch.relu(EmulatedConv.apply(v, cnn[0].weight, cnn[0].bias, 1))
        return EmulatedLinear.apply(h.flatten(1), cnn[3].weight, cnn[3].bias)

    result["cnn"] = run(cnn, cnn_emulated, x, y)
    result["torch_version"] = torch.__version__
    json.dump(result, __import__("sys").stdout)


if __name__ == "__main__":
    main()
