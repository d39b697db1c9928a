"""dpar's Python package and PyTorch in one process, imported in the order argv[1] names ("dpar-first" or
"torch-first"): both must import, exchange tensors by DLPack both ways without a copy, and leave the process with one
copy of each CUDA library, PyTorch's (libdpar names none as a load-time dependency: the CUDA runtime is inside it,
NCCL, cuBLAS and cuDNN are loaded on first use from what the process already has).

    python import_orders.py dpar-first|torch-first      (PYTHONPATH: a directory holding the dpar package)

tests/torch/check_torch_guest.sh runs it with $DPAR_TEST_TORCH_PYTHON. Prints what it checked; exits 1 on a failure.
"""
import os
import sys

order = sys.argv[1]
if order == "dpar-first":
    import dpar
    import torch
elif order == "torch-first":
    import torch
    import dpar
else:
    sys.exit(f"usage: import_orders.py dpar-first|torch-first (got {order!r})")

import numpy as np  # noqa: E402  (after the two under test, whose order is the point)

CUDA_FAMILIES = ("libcudart.so", "libnccl.so", "libcublas.so", "libcublasLt.so", "libcudnn.so")


def cuda_files_mapped():
    """{family: set of files} of the CUDA libraries mapped into this process now."""
    found = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = os.path.basename(path)
            for family in CUDA_FAMILIES:
                if name.startswith(family):
                    found.setdefault(family, set()).add(os.path.realpath(path))
    return found


def exchange(device):
    """PyTorch -> dpar -> PyTorch, then dpar -> PyTorch, on `device`, each without a copy."""
    t = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4) * 0.5
    d = dpar.Tensor.from_dlpack(t)
    assert d.shape == (3, 4), d.shape
    kind = dpar.DEVICE_CUDA if device.startswith("cuda") else dpar.DEVICE_CPU
    assert d.info()[2][0] == kind, d.info()
    if kind == dpar.DEVICE_CPU:
        d.numpy()[1, 2] = 42.0  # dpar's view of PyTorch's memory: PyTorch sees the write
        assert t[1, 2].item() == 42.0
    back = torch.from_dlpack(d)
    assert back.data_ptr() == t.data_ptr(), "PyTorch -> dpar -> PyTorch copied the tensor"
    assert torch.equal(back, t)
    mine = dpar.Tensor.zeros((2, 3), device=(kind, 0))
    mine.copy_from(np.full((2, 3), 7.0, dtype=np.float32))
    theirs = torch.from_dlpack(mine)
    assert theirs.device.type == ("cuda" if kind == dpar.DEVICE_CUDA else "cpu"), theirs.device
    assert torch.equal(theirs.cpu(), torch.full((2, 3), 7.0)), theirs
    print(f"{order}: {device}: torch -> dpar -> torch shares the memory, dpar -> torch reads dpar's tensor")


def all_reduce_on_gpus(gpus):
    """dpar's collectives on PyTorch's CUDA tensors, one participant per GPU of `gpus` (NCCL between two or more
    distinct GPUs: dpar then loads NCCL, and must find PyTorch's already in the process), or two participants on
    GPU 0 where there is one (dpar's device-memory reduction)."""
    import threading

    devices = [f"cuda:{g}" for g in gpus] if len(gpus) > 1 else ["cuda:0", "cuda:0"]
    group = dpar.CommGroup.on_devices(devices, timeout_seconds=60)
    comms = [group.member(r) for r in range(len(devices))]
    group.close()
    tensors = [torch.full((1000,), float(r + 1), device=d) for r, d in enumerate(devices)]
    torch.cuda.synchronize()
    errors = []

    def body(r):
        try:
            comms[r].all_reduce(tensors[r])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(devices))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    [c.close() for c in comms]
    assert not errors, errors
    want = float(sum(range(1, len(devices) + 1)))
    for t in tensors:
        assert torch.all(t == want).item(), t
    how = "NCCL" if len(gpus) > 1 else "dpar's device-memory reduction (one GPU: NCCL is not used)"
    print(f"{order}: all_reduce over {', '.join(devices)} on PyTorch's tensors through {how}")


def train():
    """dpar trains beside PyTorch: a few steps on 2 CPU devices lower the loss."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = np.argmax(x[:, :3], axis=1).astype(np.int32)
    with dpar.Model(seed=1).linear(4, 16).activation(dpar.RELU).linear(16, 3) as model:
        with dpar.Engine(model, optimizer=dpar.ADAM, lr=0.02, devices=2, seed=1) as engine:
            losses = [engine.train_step(x, y) for _ in range(30)]
    assert losses[-1] < losses[0], losses
    print(f"{order}: dpar trained beside torch {torch.__version__} (loss {losses[0]:.3f} -> {losses[-1]:.3f})")


def main():
    assert torch.version.cuda is not None, "a CPU build of PyTorch"  # check_torch_guest.sh skips those
    exchange("cpu")
    if torch.cuda.is_available():
        exchange("cuda:0")
        all_reduce_on_gpus(list(range(torch.cuda.device_count())))
    else:
        print(f"{order}: no GPU visible to PyTorch: the CUDA tensors' exchange is not run")
    train()
    mapped = cuda_files_mapped()
    for family, files in sorted(mapped.items()):
        print(f"{order}: {family}*: {', '.join(sorted(files))}")
    torch_root = os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__)))  # site-packages
    twice = {f: files for f, files in mapped.items() if len(files) > 1}
    assert not twice, f"two copies of a CUDA library in one process: {twice}"
    foreign = sorted(p for files in mapped.values() for p in files if not p.startswith(torch_root + os.sep))
    assert not foreign, f"CUDA libraries that are not PyTorch's were loaded: {foreign}"
    print(f"{order}: passed")


main()
