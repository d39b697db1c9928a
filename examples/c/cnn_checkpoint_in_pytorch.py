#!/usr/bin/env python3
"""Loads a checkpoint of train_fashion_mnist_cnn into the same PyTorch module and evaluates it.

    python3 examples/c/cnn_checkpoint_in_pytorch.py fashion_mnist_cnn.safetensors [DATA_DIR]

The module is bench/torch_anchor.py's fashion_cnn (torchvision's names: conv1, bn1, layer1.0.conv1, ..., fc). The
checkpoint's parameters and buffers (running statistics, num_batches_tracked as int64) load with
load_state_dict(strict=True); the optimizer's state (optimizer.*) is left aside. The test accuracy printed is
PyTorch's, from dpar's weights, in eval mode: the same as the example's last line. Needs torch and numpy (not
needed to build or test dpar).
"""
import gzip
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import torch_anchor  # noqa: E402


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


def main():
    path = sys.argv[1]
    data = sys.argv[2] if len(sys.argv) > 2 else "/usr/share/datasets/fashion-mnist"
    model = torch_anchor.fashion_cnn(torch)
    print(model.load_state_dict(load_safetensors(path), strict=True))
    images = np.frombuffer(gzip.open(f"{data}/t10k-images-idx3-ubyte.gz").read(), np.uint8, offset=16)
    labels = np.frombuffer(gzip.open(f"{data}/t10k-labels-idx1-ubyte.gz").read(), np.uint8, offset=8)
    x = (images.reshape(-1, 784).astype(np.float32) / 255 - 0.2860) / 0.3530  # the example's normalisation
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(1).numpy()
    print(f"test accuracy in PyTorch from dpar's checkpoint: {100 * (predicted == labels).mean():.2f}%")


if __name__ == "__main__":
    main()
