#!/usr/bin/env python3
"""Trains an MLP (784-256-128-10), or with --model cnn the small residual CNN of examples/c/fashion_cnn.h
(convolutions, BatchNorm, max pooling, a basic block, torchvision's names), on Fashion-MNIST over every GPU when dpar
finds any, and over every CPU device otherwise, as examples/c/train_fashion_mnist.c does, with the same options,
schedule and seed: it prints the same per-epoch losses and accuracies, bit for bit.

  python train_fashion_mnist.py [--model mlp|cnn] [--device auto|cuda|cpu] [--devices N] [--epochs E]
                                [--batch-size B] [--lr LR] [--optimizer adam|sgd] [--data DIR] [--seed S]
                                [--min-accuracy PCT] [--sync-batchnorm] [--steps-per-epoch N]

Needs the dpar package (pip install bindings/python) and NumPy.
"""
import argparse
import math
import sys
import time

import numpy as np

import dpar


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--sync-batchnorm", action="store_true", help="the CNN's BatchNorm over the global batch")
    p.add_argument("--steps-per-epoch", type=int, default=0, help="end each epoch after N batches")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--devices", type=int, default=0, help="replicas (0: one per GPU, or every CPU device)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=np.float32, default=np.float32(1e-3))  # a C float, as strtof gives it
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.0)
    return p.parse_args()


def conv_bn(model, conv, bn, cin, cout):
    """A 3x3 convolution without bias, then its BatchNorm, each named as torchvision names them."""
    model.conv2d(cin, cout, 3, padding=1, bias=False).set_node_name(model.last_node, conv)
    model.batchnorm2d(cout).set_node_name(model.last_node, bn)


def add_cnn(model, classes):
    """examples/c/fashion_cnn.h's CNN: conv1, bn1, relu, max pool; a basic block (layer1.0) with its shortcut; max
    pool, flatten, fc."""
    model.add_reshape([1, 28, 28])
    conv_bn(model, "conv1", "bn1", 1, 32)
    model.activation(dpar.RELU).max_pool2d(2)
    shortcut = model.last_node
    conv_bn(model, "layer1.0.conv1", "layer1.0.bn1", 32, 32)
    model.activation(dpar.RELU)
    conv_bn(model, "layer1.0.conv2", "layer1.0.bn2", 32, 32)
    model.add_sum([model.last_node, shortcut]).activation(dpar.RELU).max_pool2d(2)
    model.add_flatten().linear(32 * 7 * 7, classes).set_node_name(model.last_node, "fc")


def evaluate(engine, test, batch):
    """The fraction of `test` whose arg-max output is its label, in eval mode."""
    engine.set_training(False)
    correct = seen = 0
    with dpar.Loader(test, batch) as loader:
        for x, y in loader:
            logits = engine.forward(x).copy_to_numpy()  # on a GPU engine the output lives on its GPU
            # np.argmax takes the first of equal maxima, as the C example's loop does.
            correct += int(np.count_nonzero(np.argmax(logits, axis=1) == y.numpy()))
            seen += logits.shape[0]
    engine.set_training(True)
    return correct / seen


def main():
    a = parse_args()
    # The GPUs when there are any (auto) or when asked for (cuda); --devices N replicas spread over them in turn.
    gpus = 0
    if a.device == "cuda":
        gpus = dpar.device_count(dpar.DEVICE_CUDA)
        if gpus == 0:
            print("train_fashion_mnist: --device cuda: no CUDA device", file=sys.stderr)
            return 1
    elif a.device == "auto":
        try:
            gpus = dpar.device_count(dpar.DEVICE_CUDA)
        except dpar.DparError:
            gpus = 0
    use_cuda = gpus > 0
    devices = a.devices or (gpus if use_cuda else dpar.device_count(dpar.DEVICE_CPU))

    train = dpar.Dataset(f"{a.data}/train-images-idx3-ubyte.gz", f"{a.data}/train-labels-idx1-ubyte.gz")
    test = dpar.Dataset(f"{a.data}/t10k-images-idx3-ubyte.gz", f"{a.data}/t10k-labels-idx1-ubyte.gz")
    train.normalize(0.2860, 0.3530)  # Fashion-MNIST's pixel mean and standard deviation
    test.normalize(0.2860, 0.3530)
    n_train, features, classes = train.info()

    model = dpar.Model(seed=a.seed)
    if a.model == "cnn":
        add_cnn(model, classes)
        if a.sync_batchnorm:
            model.convert_sync_batchnorm()
    else:
        model.linear(features, 256).activation(dpar.RELU).linear(256, 128)
        model.activation(dpar.RELU).linear(128, classes)
    lr = float(a.lr)
    if a.optimizer == "sgd":
        optimizer = dict(optimizer=dpar.SGD, lr=lr, momentum=0.9)
    else:
        optimizer = dict(optimizer=dpar.ADAM, lr=lr)
    placement = (dict(device_kind=dpar.DEVICE_CUDA, device_ids=[i % gpus for i in range(devices)]) if use_cuda
                 else dict(devices=devices))
    engine = dpar.Engine(model, seed=a.seed, **optimizer, **placement)
    model.close()  # the engine holds its replicas
    rank, nproc = engine.processes
    if rank == 0:
        where = "replicas on GPUs" if use_cuda else "CPU devices"
        what = "CNN with a residual block" if a.model == "cnn" else f"MLP {features}-256-128-{classes}"
        print(f"dpar {dpar.version_string()} (Python): {what}, {a.optimizer} lr {a.lr:g}, "
              f"batch {a.batch_size} over {nproc} process(es) x {devices} {where}", flush=True)

    loader = dpar.Loader(train, a.batch_size, shuffle=True, seed=a.seed)
    if nproc > 1:
        loader.shard(rank, nproc)
    if use_cuda:  # batches on the first replica's GPU, each copied while the step before it runs
        loader.to_device(engine.replica_device(0))
    epoch_batches = loader.num_batches
    batches = min(a.steps_per_epoch, epoch_batches) if a.steps_per_epoch > 0 else epoch_batches
    accuracy = 0.0
    for epoch in range(a.epochs):
        loader.start_epoch(epoch)
        loss_sum, samples, t0 = 0.0, 0, time.perf_counter()
        for b, (x, y) in enumerate(loader):
            if b == batches:
                break
            # The same cosine schedule as the C example, computed the same way (in doubles, then a C float).
            progress = (epoch * batches + b) / (a.epochs * batches)
            engine.set_lr(0.5 * lr * (1.0 + math.cos(3.14159265358979 * progress)))
            loss = engine.train_step(x, y)  # the mean over the global batch
            rows = n_train % a.batch_size if b + 1 == epoch_batches and n_train % a.batch_size else a.batch_size
            loss_sum += loss * rows
            samples += rows
        seconds = time.perf_counter() - t0
        if rank != 0:
            continue  # forward() is local: rank 0 evaluates alone, the parameters being the same
        accuracy = evaluate(engine, test, 1000)
        print(f"epoch {epoch + 1:2d}  train loss {loss_sum / samples:.4f}  test accuracy {100.0 * accuracy:.2f}%  "
              f"{samples / seconds:.0f} samples/s", flush=True)
    loader.close()
    engine.close()
    if rank == 0 and 100.0 * accuracy < a.min_accuracy:
        print(f"test accuracy {100.0 * accuracy:.2f}% is below the required {a.min_accuracy:.2f}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
