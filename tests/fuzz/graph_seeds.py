#!/usr/bin/env python3
"""Writes fuzz_graph's seed corpus: valid models of every layer kind that train (or run forward and backward), save
and load, each a call sequence encoded as the harness decodes it.

    python3 tests/fuzz/graph_seeds.py tests/fuzz/corpus/graph

FuzzedDataProvider takes integral draws from the end of the input, the most significant byte first, each as many
bytes as its range needs; Enc records the draws in the harness's order (tests/fuzz/fuzz_graph.cpp) and writes them
backwards. Run it again when the harness's decoding changes, and check each seed's call sequence with
FUZZ_GRAPH_TRACE=1 build-fuzz/tests/fuzz/fuzz_graph tests/fuzz/corpus/graph/SEED."""
import os
import random
import sys

# fuzz_graph's operation numbers (LLVMFuzzerTestOneInput's switch) and step modes (run_step's Mode).
LINEAR, ACTIVATION, DROPOUT, CONV2D, POOL2D, ADAPTIVE, BATCHNORM, LAYERNORM, EMBEDDING = 0, 2, 4, 5, 7, 8, 9, 10, 11
SUM, CONCAT, FLATTEN, RESHAPE, BRANCH_FROM, SET_NODE_NAME = 12, 13, 14, 15, 16, 17
FORWARD_BACKWARD, CROSS_ENTROPY, MSE, EVAL = 0, 1, 2, 3
RELU, TANH = 0, 2
NAMES = 31  # entries in set_node_name's dictionary
FC, LAYER1_0, BN = 0, 22, 24  # "fc", "layer1.0", "bn" in it


class Enc:
    """The draws of one input, in the order the harness makes them."""

    def __init__(self):
        self.order = []  # bytes in the order they are consumed
        self.last = -1  # the model's last node

    def draw(self, value, lo, hi):
        """ConsumeIntegralInRange(lo, hi) returning value."""
        span, x = hi - lo, value - lo
        assert 0 <= x <= span, (value, lo, hi)
        n = 0
        while n < 8 and span >> (8 * n):
            n += 1
        self.order += [(x >> (8 * (n - 1 - i))) & 0xFF for i in range(n)]

    def flag(self, value):
        """ConsumeBool()."""
        self.draw(1 if value else 0, 0, 255)

    def extent(self, value):
        """extent(): the small, sane branch, or 0 to 32."""
        if 1 <= value <= 6:
            self.draw(0, 0, 7)
            self.draw(value, 1, 6)
        else:
            self.draw(4, 0, 7)
            self.draw(value, 0, 32)

    def fitted(self):
        """fitted(): the extent that fits the shape the next node reads."""
        self.draw(0, 0, 1)

    def node_id(self, node):
        if node == -1:
            self.draw(0, 0, 7)
        else:
            self.draw(5, 0, 7)
            self.draw(node, 0, self.last)

    def pair(self, value, nullable=True):
        """pair(): both extents `value`."""
        if nullable:
            self.draw(0, 0, 3)
        self.extent(value)
        self.flag(True)

    def data(self):
        return bytes(reversed(self.order))

    # ---- The calls

    def start(self, seed, shape, calls):
        self.draw(seed, 0, 255)
        self.draw(0, 0, 15)  # a valid input shape
        self.draw([2, 4, 1, 3].index(len(shape)), 0, 3)
        for i, extent in enumerate(shape):
            self.draw(0, 0, 31)
            self.draw(extent, 1, 5 if i == 0 else 6)
        self.draw(calls, 1, 32)

    def op(self, number, adds=True):
        self.draw(number, 0, 19)
        self.last += adds

    def linear(self, out, bias=True):  # in_features fitted to a 2-D input
        self.op(LINEAR)
        self.fitted()
        self.extent(out)
        self.flag(bias)

    def activation(self, kind):
        self.op(ACTIVATION)
        self.flag(True)
        self.draw(kind, 0, 3)

    def dropout(self):  # p = 0.5
        self.op(DROPOUT)
        self.draw(0, 0, 3)

    def conv2d(self, out, kernel, stride=1, padding=0, bias=True):  # in_channels fitted; padding 0 or 1
        self.op(CONV2D)
        self.fitted()
        self.extent(out)
        self.pair(kernel)
        self.pair(stride)
        self.pair(1)
        self.flag(padding == 0)  # zeroed, or kept
        self.pair(1)
        self.flag(True)  # dilation 1
        self.flag(True)  # groups 1
        self.flag(bias)

    def pool2d(self, is_max, kernel, stride=None):  # stride None: NULL, the kernel's; padding 0
        self.op(POOL2D)
        self.flag(is_max)
        self.draw(0, 0, 7)  # kernel_size not NULL
        self.pair(kernel, nullable=False)
        if stride is None:
            self.draw(3, 0, 3)
        else:
            self.pair(stride)
        self.pair(1)
        self.flag(True)  # padding zeroed

    def adaptive(self):  # (1, 1)
        self.op(ADAPTIVE)
        self.flag(True)
        self.flag(True)

    def batchnorm(self, dims, affine=True):  # dims 0: SyncBatchNorm; channels fitted; default eps and momentum
        self.op(BATCHNORM)
        self.draw(dims, 0, 2)
        self.fitted()
        self.draw(0, 0, 3)
        self.draw(0, 0, 3)
        self.flag(affine)

    def layernorm(self, affine=True):  # over the last dim, fitted
        self.op(LAYERNORM)
        self.fitted()
        self.draw(0, 0, 3)
        self.flag(affine)

    def embedding(self, rows, dim):
        self.op(EMBEDDING)
        self.extent(rows)
        self.extent(dim)
        self.flag(False)  # no padding_idx

    def join(self, is_sum, nodes):  # nodes[0] must be the next input
        self.op(SUM if is_sum else CONCAT, adds=False)
        self.draw(0, 0, 9)
        self.draw(len(nodes), 2, 4)
        for k, node in enumerate(nodes):
            if k == 0:
                self.fitted()
            else:
                self.draw(1, 0, 1)
                self.node_id(node)
        self.last += 1

    def flatten(self):
        self.op(FLATTEN)

    def reshape(self, ndim, divisors):  # a row fitted to the next input: gcds with `divisors` for all dims but one
        self.op(RESHAPE)
        self.draw([1, 2, 3, 0, 4, 5].index(ndim), 0, 5)
        self.draw(0, 0, 15)
        for _ in range(ndim):
            self.extent(1)
        self.fitted()
        for d in divisors:
            self.draw(d, 1, 8)
        self.draw(0, 0, 15)  # row_shape not NULL

    def set_node_name(self, node, name):  # a name of the dictionary
        self.op(SET_NODE_NAME, adds=False)
        self.node_id(node)
        self.draw(0, 0, 31)
        self.draw(2, 0, 3)
        self.draw(name, 0, NAMES - 1)

    def step(self, devices, mode, momentum, inputs=(), indices=0, targets=(), classes=0):
        """The step: `inputs` are f32 values in [-100, 100] / 50, or indices below `indices` where it is not 0;
        `targets` are labels below `classes` (cross-entropy) or values in [-10, 10] / 10 (MSE)."""
        self.draw(0, 0, 15)  # the model's own dtype
        self.draw(devices, 1, 2)
        self.draw(mode, 0, 3)
        self.flag(momentum)
        for v in inputs:
            if indices:
                self.draw(v, 0, indices - 1)
                self.draw(0, 0, 63)
            else:
                self.draw(0, 0, 63)
                self.draw(v, -100, 100)
        if mode in (CROSS_ENTROPY, MSE):
            self.draw(0, 0, 15)  # a target of the right shape
            for t in targets:
                if mode == CROSS_ENTROPY:
                    self.draw(t, 0, classes - 1)
                    self.draw(0, 0, 63)
                else:
                    self.draw(t, -10, 10)


def seeds():
    rnd = random.Random(7)

    def values(shape):
        n = 1
        for v in shape:
            n *= v
        return [rnd.randint(-100, 100) for _ in range(n)]

    out = {}
    # An MLP, cross-entropy over 2 devices: (4, 6) -> linear 5 -> relu -> linear 3.
    e = out["mlp_cross_entropy_2_devices"] = Enc()
    e.start(1, [4, 6], 3)
    e.linear(5), e.activation(RELU), e.linear(3)
    e.step(2, CROSS_ENTROPY, True, values([4, 6]), targets=[0, 1, 2, 1], classes=3)
    # A CNN: (2, 3, 6, 6) -> conv 4 (3x3, padding 1) -> batchnorm2d -> relu -> max pool 2 -> flatten -> linear 3.
    e = out["cnn_batchnorm_pool"] = Enc()
    e.start(2, [2, 3, 6, 6], 6)
    e.conv2d(4, 3, padding=1, bias=False), e.batchnorm(2), e.activation(RELU), e.pool2d(True, 2), e.flatten()
    e.linear(3)
    e.step(1, CROSS_ENTROPY, True, values([2, 3, 6, 6]), targets=[2, 0], classes=3)
    # A residual block, MSE: (3, 4) -> linear 4 -> relu -> linear 4, + node 0 -> linear 2.
    e = out["residual_mse"] = Enc()
    e.start(3, [3, 4], 5)
    e.linear(4), e.activation(RELU), e.linear(4), e.join(True, [2, 0]), e.linear(2)
    e.step(1, MSE, False, values([3, 4]), targets=[3, -2, 5, 0, -7, 1])
    # Views and a concat, forward, backward and step on 2 devices: (2, 6) -> linear 6 -> reshape (2, 3) -> tanh,
    # concatenated with the reshape -> flatten -> linear 2.
    e = out["views_concat_backward"] = Enc()
    e.start(4, [2, 6], 6)
    e.linear(6), e.reshape(2, [2]), e.activation(TANH), e.join(False, [2, 1]), e.flatten(), e.linear(2)
    e.step(2, FORWARD_BACKWARD, True, values([2, 6]))
    # Indices, cross-entropy: i32 (3, 4) -> embedding (10, 6) -> layernorm -> flatten -> linear 2.
    e = out["embedding_layernorm"] = Enc()
    e.start(5, [3, 4], 4)
    e.embedding(10, 6), e.layernorm(), e.flatten(), e.linear(2)
    e.step(1, CROSS_ENTROPY, False, [rnd.randint(0, 9) for _ in range(12)], indices=10, targets=[1, 0, 1], classes=2)
    # SyncBatchNorm and dropout over 2 devices: (5, 5) -> linear 6 -> sync batchnorm -> dropout -> linear 2.
    e = out["sync_batchnorm_dropout_2_devices"] = Enc()
    e.start(6, [5, 5], 4)
    e.linear(6), e.batchnorm(0), e.dropout(), e.linear(2)
    e.step(2, CROSS_ENTROPY, True, values([5, 5]), targets=[0, 1, 1, 0, 1], classes=2)
    # Pools, eval forward: (2, 2, 5, 5) -> conv 3 (3x3) -> avg pool 2 stride 1 -> adaptive avg pool -> flatten ->
    # linear 2.
    e = out["pools_eval"] = Enc()
    e.start(7, [2, 2, 5, 5], 5)
    e.conv2d(3, 3), e.pool2d(False, 2, 1), e.adaptive(), e.flatten(), e.linear(2)
    e.step(1, EVAL, False, values([2, 2, 5, 5]))
    # BatchNorm1d over (B, C, L), forward, backward and step on 2 devices: (3, 4, 5) -> batchnorm1d -> relu ->
    # flatten -> linear 3.
    e = out["batchnorm1d_backward_2_devices"] = Enc()
    e.start(8, [3, 4, 5], 4)
    e.batchnorm(1), e.activation(RELU), e.flatten(), e.linear(3)
    e.step(2, FORWARD_BACKWARD, False, values([3, 4, 5]))
    # Named nodes, whose state_dict keys the checkpoint saved after the step holds: (2, 5) -> linear 4 "fc" ->
    # batchnorm1d "bn" -> relu -> linear 3 "layer1.0", cross-entropy with momentum.
    e = out["named_nodes_checkpoint"] = Enc()
    e.start(9, [2, 5], 7)
    e.linear(4), e.set_node_name(0, FC), e.batchnorm(1), e.set_node_name(1, BN), e.activation(RELU), e.linear(3)
    e.set_node_name(3, LAYER1_0)
    e.step(1, CROSS_ENTROPY, True, values([2, 5]), targets=[2, 0], classes=3)
    return out


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    os.makedirs(sys.argv[1], exist_ok=True)
    for name, enc in seeds().items():
        with open(os.path.join(sys.argv[1], name), "wb") as f:
            f.write(enc.data())
    return 0


if __name__ == "__main__":
    sys.exit(main())
