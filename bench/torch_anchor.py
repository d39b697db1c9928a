#!/usr/bin/env python3
"""PyTorch's training step on the same GPU as bench_cuda_train: the anchor of issue 7, section 8.

    python3 bench/torch_anchor.py [--only demo|wide] [--batches B1,B2,..] [--steps N] [--blocks K]
                                  [--variants plain,dataparallel,ddp,graph] [--json PATH]

The same MLPs, batches, data and step counts as bench_cuda_train (bench/cuda_configs.h): the demo MLP
784-256-128-10 at batch 128, 1024, 8192 and the wide MLP 784-4096-4096-4096-10 at 256, 1024, 8192; nn.Sequential of
Linear + ReLU (no ReLU after the last Linear), CrossEntropyLoss, Adam(lr=1e-3, fused=True), f32 with IEEE f32 matmuls
(no TF32, as dpar's cuBLAS calls), uniform inputs and random labels already on the GPU (4 batches, cycled). Variants:

  plain         the module: zero_grad(set_to_none=True), forward, loss, backward, step
  dataparallel  nn.DataParallel(module, device_ids=[0])
  ddp           DistributedDataParallel(module, device_ids=[0]) in a process group of world size 1 (NCCL, through a
                FileStore in a temporary directory: no network needed)
  graph         the whole step captured in one CUDA graph (the torch.cuda.graphs whole-network recipe: static input
                and target, warm-up on a side stream, capture of forward, backward and Adam(capturable=True,
                fused=True).step()); a step is copying the batch into the static tensors and replaying the graph

Each step is followed by torch.cuda.synchronize() and timed by the wall clock around both, as bench_cuda_train times
one dpar_engine_train_step (which returns once the GPU's work is done). 10 warm-up steps, then blocks of timed
steps; median, p10 and p90 over all timed steps. Without torch or a GPU it says why, writes that to --json, and exits
0. --device cpu runs the plain, DataParallel and DDP (gloo) steps on the CPU: a check of this script, not an anchor.

    python3 bench/torch_anchor.py --cpu-threads 1,2 [--batches 256,1024] [--seconds S] [--adam fused|foreach|single]
                                  [--cpu-model demo|cnn]

is the CPU anchor that bench_train's part (e) runs between its own blocks: the demo MLP (the same nn.Sequential,
CrossEntropyLoss, Adam lr 1e-3; with --cpu-model cnn the CNN of examples/c/train_fashion_mnist.c, for bench_cnn) on the CPU with torch.set_num_threads(T), uniform inputs and random labels (8
batches, cycled), 10 warm-up steps, then at least 20 steps and --seconds; one line per thread count and batch with
the median and the shortest step time.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

# bench/cuda_configs.h
MODELS = {
    "demo": ([784, 256, 128, 10], [128, 1024, 8192]),
    "wide": ([784, 4096, 4096, 4096, 10], [256, 1024, 8192]),
}
VARIANTS = ["plain", "dataparallel", "ddp", "graph"]
DATA_BATCHES = 4
WARMUP = 10


def quantile(sorted_v, q):
    """Nearest rank, as bench_quantile_sorted."""
    return sorted_v[min(len(sorted_v) - 1, int(q * (len(sorted_v) - 1) + 0.5))]


class Anchor:
    def __init__(self, torch, device, steps, blocks):
        self.torch, self.device, self.steps, self.blocks = torch, device, steps, blocks
        self.errors = []
        self.ddp_ready = None  # None: not tried; True; or the reason it failed

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def mlp(self, sizes):
        nn = self.torch.nn
        self.torch.manual_seed(1)
        layers = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i + 2 < len(sizes):
                layers.append(nn.ReLU())
        return nn.Sequential(*layers).to(self.device)

    def adam(self, params, **kw):
        return self.torch.optim.Adam(params, lr=1e-3, fused=True, **kw)

    def time_steps(self, step):
        """Wall time of step(i) plus a synchronisation, per step, in ms: median, p10, p90."""
        for i in range(WARMUP):
            step(i)
        self.sync()
        times = []
        for i in range(self.steps * self.blocks):
            t0 = time.perf_counter()
            step(i)
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return statistics.median(times), quantile(times, 0.1), quantile(times, 0.9)

    def init_ddp(self):
        """A process group of world size 1; its failure is recorded and the DDP column stays empty."""
        if self.ddp_ready is not None:
            return self.ddp_ready
        dist = self.torch.distributed
        try:
            if not dist.is_available():
                raise RuntimeError("torch.distributed is not available in this build")
            # NCCL's bootstrap needs a socket; the GPU machine has no network, and loopback is enough for one rank.
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            self.store_dir = tempfile.TemporaryDirectory()
            store = dist.FileStore(os.path.join(self.store_dir.name, "store"), 1)
            backend = "nccl" if self.device == "cuda" else "gloo"
            kw = {"device_id": self.torch.device("cuda", 0)} if self.device == "cuda" else {}
            dist.init_process_group(backend, store=store, rank=0, world_size=1, **kw)
            self.ddp_ready = True
        except Exception as e:  # noqa: BLE001 - any failure is reported, not fatal
            self.ddp_ready = f"{type(e).__name__}: {e}"
            self.errors.append(f"ddp: init_process_group failed: {self.ddp_ready}")
        return self.ddp_ready

    def run(self, variant, sizes, xs, ys):
        torch, nn = self.torch, self.torch.nn
        loss_fn = nn.CrossEntropyLoss()
        model = self.mlp(sizes)
        n = len(xs)
        if variant in ("plain", "dataparallel", "ddp"):
            if variant == "dataparallel":
                wrapped = nn.DataParallel(model, device_ids=[0] if self.device == "cuda" else None)
            elif variant == "ddp":
                if self.init_ddp() is not True:
                    return None
                from torch.nn.parallel import DistributedDataParallel

                wrapped = DistributedDataParallel(model, device_ids=[0] if self.device == "cuda" else None)
            else:
                wrapped = model
            opt = self.adam(wrapped.parameters())

            def step(i):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(wrapped(xs[i % n]), ys[i % n])
                loss.backward()
                opt.step()

            return self.time_steps(step)

        assert variant == "graph"
        if self.device != "cuda":
            raise RuntimeError("CUDA graphs need a GPU")
        opt = self.adam(model.parameters(), capturable=True)
        static_x, static_y = xs[0].clone(), ys[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: Adam's state and cuBLAS's workspace exist after
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                loss_fn(model(static_x), static_y).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)  # backward inside the graph allocates .grad from the graph's pool
        with torch.cuda.graph(graph):
            static_loss = loss_fn(model(static_x), static_y)
            static_loss.backward()
            opt.step()

        def step(i):
            static_x.copy_(xs[i % n])
            static_y.copy_(ys[i % n])
            graph.replay()

        return self.time_steps(step)


def fashion_cnn(torch):
    """The CNN of examples/c/train_fashion_mnist.c (add_cnn), module for module, with the same names."""
    nn = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)

    class FashionCnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(32)
            self.layer1 = nn.Sequential(BasicBlock(32))
            self.fc = nn.Linear(32 * 7 * 7, 10)

        def forward(self, x):
            x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x.view(-1, 1, 28, 28)))), 2)
            x = torch.max_pool2d(self.layer1(x), 2)
            return self.fc(torch.flatten(x, 1))

    return FashionCnn()


def cpu_anchor(torch, threads_list, batches, seconds, warmup, adam_kind, model_kind="demo", device="cpu",
               precision="f32"):
    """PyTorch on the CPU beside bench_train's part (e) (the demo MLP) or bench_cnn (the CNN), Adam, at each thread
    count and batch.

    One line per configuration, "cpu_anchor threads=T batch=B median_ms=M steps=N min_ms=S", which bench_train
    and bench_cnn read. device="cuda" (bench_cnn --device cuda): model and batches on cuda:0, each step followed by
    torch.cuda.synchronize() inside its timing (as dpar's step returns once the GPU's work is done), cuDNN in FP32
    (TF32 off, as dpar's cuDNN calls) with its autotuner on (torch.backends.cudnn.benchmark, PyTorch's fastest
    FP32 setting); the threads figure is then the CPU threads PyTorch's host side had. model_kind "wide" is an MLP
    784-1024-1024-1024-10 (GEMM-bound on a CPU). precision="bf16" runs the forward under torch.autocast(device,
    dtype=torch.bfloat16) (the loss in f32), beside dpar's bf16 policy."""
    sizes = [784, 1024, 1024, 1024, 10] if model_kind == "wide" else MODELS["demo"][0]
    nn = torch.nn
    for threads in threads_list:
        torch.set_num_threads(threads)
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            xs = [torch.rand(batch, sizes[0], generator=gen) for _ in range(8)]
            ys = [torch.randint(0, sizes[-1], (batch,), generator=gen) for _ in range(8)]
            torch.manual_seed(1)
            if model_kind == "cnn":
                model = fashion_cnn(torch)
            else:
                layers = []
                for i in range(len(sizes) - 1):
                    layers += [nn.Linear(sizes[i], sizes[i + 1])] + ([nn.ReLU()] if i + 2 < len(sizes) else [])
                model = nn.Sequential(*layers)
            if device == "cuda":
                torch.backends.cudnn.allow_tf32 = False
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.benchmark = True
                model = model.cuda()
                xs = [x.cuda() for x in xs]
                ys = [y.cuda() for y in ys]
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, **({"fused": True} if adam_kind == "fused" else
                                                                   {"foreach": adam_kind == "foreach"}))
            loss_fn = nn.CrossEntropyLoss()

            def step(i):
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    logits = model(xs[i % 8])
                loss_fn(logits.float(), ys[i % 8]).backward()
                opt.step()
                sync()

            for i in range(warmup):
                step(i)
            times, start, i = [], time.perf_counter(), 0
            while True:
                t0 = time.perf_counter()
                step(i)
                t1 = time.perf_counter()
                times.append(t1 - t0)
                i += 1
                if i >= 20 and t1 - start >= seconds:
                    break
            print(f"cpu_anchor threads={threads} batch={batch} median_ms={statistics.median(times) * 1e3:.4f} "
                  f"steps={len(times)} min_ms={min(times) * 1e3:.4f}", flush=True)


def write_json(path, doc):
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"\nwrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(MODELS))
    ap.add_argument("--batches", help="batch sizes for the chosen model(s), e.g. 128,1024")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per block (default 50)")
    ap.add_argument("--blocks", type=int, default=5, help="blocks of timed steps (default 5)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="default: " + ",".join(VARIANTS))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: check this script without a GPU (not an anchor)")
    ap.add_argument("--json", help="write the results as JSON")
    ap.add_argument("--cpu-threads", help="the CPU anchor of bench_train (e): PyTorch on the CPU at these thread "
                    "counts, e.g. 1,2, for the demo MLP at --batches (default 256,1024) for --seconds each")
    ap.add_argument("--seconds", type=float, default=1.0, help="with --cpu-threads: timed seconds per configuration")
    ap.add_argument("--adam", choices=["fused", "foreach", "single"], default="fused",
                    help="with --cpu-threads: PyTorch's Adam implementation (default fused)")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                    help="with --cpu-threads: bf16 runs the forward under torch.autocast(dtype=torch.bfloat16)")
    ap.add_argument("--cpu-model", choices=["demo", "wide", "cnn"], default="demo",
                    help="with --cpu-threads: the demo MLP (bench_train) or the Fashion-MNIST CNN (bench_cnn)")
    ap.add_argument("--anchor-device", choices=["cpu", "cuda"], default="cpu",
                    help="with --cpu-threads: run that anchor on the CPU (default) or on cuda:0 (bench_cnn --device cuda)")
    args = ap.parse_args()
    if args.cpu_threads:
        try:
            import torch
        except ImportError as e:
            print(f"cpu_anchor skipped: no PyTorch ({e})")
            return 0
        if args.anchor_device == "cuda" and not torch.cuda.is_available():
            print(f"cpu_anchor skipped: no CUDA device for PyTorch {torch.__version__}")
            return 0
        print(f"cpu_anchor torch={torch.__version__} device={args.anchor_device} adam={args.adam} "
              f"precision={args.precision} "
              f"blas={torch.backends.mkl.is_available() and 'MKL' or 'other'} "
              f"mkldnn={torch.backends.mkldnn.is_available()}", flush=True)
        threads = [int(t) for t in args.cpu_threads.split(",") if t]
        batches = [int(b) for b in args.batches.split(",")] if args.batches else [256, 1024]
        cpu_anchor(torch, threads, batches, args.seconds, WARMUP, args.adam, args.cpu_model, args.anchor_device,
                   args.precision)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants) or args.steps < 1 or args.blocks < 1:
        ap.error("bad --variants, --steps or --blocks")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    sys.stdout.reconfigure(line_buffering=True)

    print("torch_anchor: PyTorch's training step beside bench_cuda_train (issue 7, section 8)")
    doc = {"program": "torch_anchor", "skipped": None, "errors": [], "results": []}
    try:
        import torch
    except ImportError as e:
        doc["skipped"] = f"no PyTorch ({e})"
    else:
        doc["torch_version"] = torch.__version__
        if args.device == "cuda" and not torch.cuda.is_available():
            doc["skipped"] = f"no CUDA device for PyTorch {torch.__version__} (torch.version.cuda = {torch.version.cuda})"
    if doc["skipped"]:
        print("skipped:", doc["skipped"])
        write_json(args.json, doc)
        return 0

    # IEEE f32 matmuls, as dpar's cuBLAS handle (CUBLAS_DEFAULT_MATH); "highest" is PyTorch's default, set anyway.
    torch.set_float32_matmul_precision("highest")
    doc["matmul_precision"] = torch.get_float32_matmul_precision()
    if args.device == "cuda":
        doc["gpu"] = torch.cuda.get_device_name(0)
        doc["cuda"] = torch.version.cuda
        print(f"GPU: cuda:0, {doc['gpu']}; PyTorch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        doc["gpu"] = "none: --device cpu, a check of this script, not an anchor"
        print(f"device: cpu (a check of this script, not an anchor); PyTorch {torch.__version__}")
    doc.update(device=args.device, steps_per_block=args.steps, blocks=args.blocks, warmup=WARMUP)
    print(f"f32 matmul precision {doc['matmul_precision']}; Adam fused; {WARMUP} warm-up steps, then {args.blocks} "
          f"blocks of {args.steps}; ms per step (wall time of the step and a synchronisation), median [p10, p90]\n")

    anchor = Anchor(torch, args.device, args.steps, args.blocks)
    print(f"  {'config':11} | " + " | ".join(f"{v:>28}" for v in variants))
    for name, (sizes, default_batches) in MODELS.items():
        if args.only and name != args.only:
            continue
        for batch in batches or default_batches:
            gen = torch.Generator(device=args.device).manual_seed(batch)
            xs = [torch.rand(batch, sizes[0], device=args.device, generator=gen) for _ in range(DATA_BATCHES)]
            ys = [torch.randint(0, sizes[-1], (batch,), device=args.device, generator=gen) for _ in range(DATA_BATCHES)]
            entry = {"model": name, "batch": batch}
            cells = []
            for v in variants:
                try:
                    r = anchor.run(v, sizes, xs, ys)
                except Exception as e:  # noqa: BLE001 - out of memory, capture failures: reported, not fatal
                    anchor.errors.append(f"{v} {name},{batch}: {type(e).__name__}: {str(e).splitlines()[0]}")
                    r = None
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                entry[f"{v}_ms"] = r[0] if r else None
                if r:
                    entry[f"{v}_p10_ms"], entry[f"{v}_p90_ms"] = r[1], r[2]
                    entry[f"{v}_samples_per_s"] = batch / r[0] * 1e3
                cells.append(f"{r[0]:8.3f} [{r[1]:7.3f}, {r[2]:7.3f}]" if r else f"{'-':>28}")
            doc["results"].append(entry)
            print(f"  {name + ',' + str(batch):11} | " + " | ".join(cells))
            del xs, ys
    doc["errors"] = anchor.errors
    for e in anchor.errors:
        print("  error:", e)
    if anchor.ddp_ready is True:
        torch.distributed.destroy_process_group()
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
