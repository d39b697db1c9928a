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

Scaled dot-product attention under dpar's bf16 contract (src/common/op_specs.h, AttentionSpec::dtype) reads q, k and
v rounded to bf16 (the packed projection before it writes them rounded), computes the scores and the softmax in
f32, rounds the normalised weights to bf16 before their product with v, and in backward rounds dout and the
scores' gradient to bf16 before their products; out and every gradient are f32. "emulated" below writes that out.

Models (PyTorch's default initialisation from fixed seeds; every parameter is in the file by its state_dict name):
  mlp: Linear(12, 32), ReLU, Linear(32, 5) on x (16, 12), cross-entropy with labels (16);
  gelu_mlp: Linear(12, 32), GELU, Linear(32, 5) on x (16, 12), cross-entropy with labels (16);
  cnn: Conv2d(2, 6, 3, padding=1), ReLU, Flatten, Linear(6*5*5, 4) on x (4, 2, 5, 5), cross-entropy;
  attention: nanoGPT's causal self-attention (attn.c_attn = Linear(8, 24), 2 heads, attn.c_proj = Linear(8, 8)),
    then head = Linear(8, 5), on x (3, 6, 8), cross-entropy with labels (3, 6).
For each: the parameters, x, labels (and their shape), and for "f32", "emulated" and "autocast" the mean loss and
every gradient.
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
        # (B, T, C) inputs as B*T rows, as dpar's linear layer reads them.
        rows = g.reshape(-1, g.shape[-1])
        return g @ wb, rows.t() @ xb.reshape(-1, xb.shape[-1]), gy.reshape(-1, gy.shape[-1]).sum(0)


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


class Rounded(torch.autograd.Function):
    """A layer's output written in bf16 (the f32 value rounded once); its gradient passes through in f32."""
    @staticmethod
    def forward(ctx, x):
        return bf16(x)

    @staticmethod
    def backward(ctx, gy):
        return gy


class EmulatedAttention(torch.autograd.Function):
    """Causal attention over (B, H, T, D) q, k, v, as AttentionSpec::dtype bf16 defines it."""
    @staticmethod
    def forward(ctx, q, k, v):
        qb, kb, vb = bf16(q), bf16(k), bf16(v)
        scale = q.shape[-1] ** -0.5
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        s = (qb @ kb.transpose(-1, -2)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = torch.exp(s - lse)
        w = bf16(p)
        out = w @ vb
        ctx.save_for_backward(qb, kb, vb, p, w, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        qb, kb, vb, p, w, out = ctx.saved_tensors
        g = bf16(dout)
        dv = w.transpose(-1, -2) @ g
        dp = g @ vb.transpose(-1, -2)
        d = (dout * out).sum(-1, keepdim=True)
        ds = bf16(p * (dp - d))
        return ctx.scale * (ds @ kb), ctx.scale * (ds.transpose(-1, -2) @ qb), dv


class AttentionModel(torch.nn.Module):
    def __init__(self, c, heads, classes):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.c_attn = torch.nn.Linear(c, 3 * c)
        self.attn.c_proj = torch.nn.Linear(c, c)
        self.head = torch.nn.Linear(c, classes)
        self.heads = heads

    def split(self, qkv):
        b, t, c3 = qkv.shape
        return [z.view(b, t, self.heads, c3 // 3 // self.heads).transpose(1, 2) for z in qkv.split(c3 // 3, 2)]

    def merge(self, y):
        b, h, t, d = y.shape
        return y.transpose(1, 2).reshape(b, t, h * d)

    def forward(self, x):
        q, k, v = self.split(self.attn.c_attn(x))
        y = self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.head(self.attn.c_proj(y)).flatten(0, 1)

    def emulated(self, x):
        qkv = Rounded.apply(EmulatedLinear.apply(x, self.attn.c_attn.weight, self.attn.c_attn.bias))
        q, k, v = self.split(qkv)
        y = self.merge(EmulatedAttention.apply(q, k, v))
        y = EmulatedLinear.apply(y, self.attn.c_proj.weight, self.attn.c_proj.bias)
        return EmulatedLinear.apply(y, self.head.weight, self.head.bias).flatten(0, 1)


def run(model, forward_emulated, x, y):
    out = {}
    for mode in ("f32", "emulated", "autocast"):
        model.zero_grad()
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y.flatten())
        elif mode == "emulated":
            # dpar's loss gradient is the sum over the batch's rows, divided by their number only once the replicas'
            # gradients are summed (so that any split of the batch gives the same mean): the gradient that the
            # layers round to bf16 is the sum's. (For a batch of 2^k rows the two roundings are the same bits.)
            total = F.cross_entropy(forward_emulated(x), y.flatten(), reduction="sum")
            total.backward()
            for p in model.parameters():
                p.grad /= y.numel()
            out[mode] = {"loss": float(total.detach()) / y.numel(),
                         "grads": {n: as_list(p.grad) for n, p in model.named_parameters()}}
            continue
        else:
            loss = F.cross_entropy(model(x), y.flatten())
        loss.backward()
        out[mode] = {"loss": float(loss.detach()),
                     "grads": {n: as_list(p.grad) for n, p in model.named_parameters()}}
    out["params"] = {n: as_list(p) for n, p in model.named_parameters()}
    out["x"] = as_list(x)
    out["x_shape"] = list(x.shape)
    out["labels"] = y.flatten().tolist()
    out["labels_shape"] = list(y.shape)
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

    torch.manual_seed(3)
    attention = AttentionModel(8, 2, 5)
    x = torch.randn(3, 6, 8)
    y = torch.randint(0, 5, (3, 6))
    result["attention"] = run(attention, attention.emulated, x, y)
    result["torch_version"] = torch.__version__
    json.dump(result, __import__("sys").stdout)


if __name__ == "__main__":
    main()
