#!/usr/bin/env python3
"""nanoGPT's GPT in PyTorch: the module dpar's train_char_gpt builds node by node, and its training step timed on
the CPU, the anchor of bench_gpt.

    python3 bench/gpt_anchor.py --threads 1,2 [--batch 32] [--block 128] [--layers 4] [--heads 4] [--embd 128]
                                [--vocab 178] [--seconds 10] [--json PATH]

The module has nanoGPT's structure and state_dict keys (transformer.wte, transformer.wpe, transformer.h.<i>.ln_1,
.attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj, transformer.ln_f, lm_head tied to wte), biases on,
dropout 0, attention through F.scaled_dot_product_attention(is_causal=True) (PyTorch's fused CPU kernel in f32).
A step: zero_grad(set_to_none=True), forward, F.cross_entropy over (B*T, V) logits, backward, clip_grad_norm_(1.0),
AdamW(lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on the matrices, fused=False: PyTorch's default foreach) step;
random tokens. 3 warm-up steps, then at least 5 steps and --seconds; one JSON line per thread count with the median
step time and tokens/s. Without torch it says so and exits 0.
"""
import argparse
import json
import math
import statistics
import sys
import time


def make_gpt(torch, vocab, block, layers, heads, embd, dropout=0.0):
    nn = torch.nn
    F = torch.nn.functional

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(embd, 3 * embd)
            self.c_proj = nn.Linear(embd, embd)
            self.resid_dropout = nn.Dropout(dropout)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(embd, dim=2)
            q = q.view(B, T, heads, C // heads).transpose(1, 2)
            k = k.view(B, T, heads, C // heads).transpose(1, 2)
            v = v.view(B, T, heads, C // heads).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0.0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(embd, 4 * embd)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * embd, embd)
            self.dropout = nn.Dropout(dropout)

        def forward(self, x):
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(embd)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(embd)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(vocab, embd),
                wpe=nn.Embedding(block, embd),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList([Block() for _ in range(layers)]),
                ln_f=nn.LayerNorm(embd),
            ))
            self.lm_head = nn.Linear(embd, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # tied, as GPT-2's

        def forward(self, idx):
            T = idx.size(1)
            pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for b in self.transformer.h:
                x = b(x)
            return self.lm_head(self.transformer.ln_f(x))

    return GPT()


def adamw(torch, model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.99))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=178)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                    help="bf16: forward under torch.autocast(\"cpu\", dtype=torch.bfloat16)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print(json.dumps({"skipped": "torch is not installed"}))
        return 0
    F = torch.nn.functional
    lines = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        model = make_gpt(torch, args.vocab, args.block, args.layers, args.heads, args.embd)
        opt = adamw(torch, model, 1e-3)
        batches = [(torch.randint(0, args.vocab, (args.batch, args.block)),
                    torch.randint(0, args.vocab, (args.batch, args.block))) for _ in range(4)]

        def step(i):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        for i in range(3):
            step(i)
        times, begin = [], time.perf_counter()
        while len(times) < 5 or time.perf_counter() - begin < args.seconds:
            t0 = time.perf_counter()
            step(len(times))
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        line = {"framework": "pytorch", "torch": torch.__version__, "precision": args.precision, "threads": threads,
                "batch": args.batch,
                "block": args.block, "steps": len(times), "median_step_s": median,
                "tokens_per_s": args.batch * args.block / median}
        print(json.dumps(line))
        sys.stdout.flush()
        lines.append(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(lines, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
