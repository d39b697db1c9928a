"""dpar's Python binding against the C reference (tests/binding_reference.c): the same model, data and seed on 2
CPU devices give the same loss bits; a bad call raises DparError with dpar's message; a callback's exception comes
back with its own text; a layer written in NumPy trains as the built-in linear does.
Run from anywhere but bindings/python (whose dpar/ is the package without its extension), with dpar installed or on
PYTHONPATH: python -m unittest discover -s bindings/python/tests. The reference losses are $DPAR_REFERENCE_LOSSES,
else this tree's build/tests/reference_losses.txt (written by the CTest test binding_reference); the test that needs
them skips, saying so, where there are none."""
import json
import os
import tempfile
import threading
import unittest

import numpy as np

import dpar


def reference_model():
    return dpar.Model(seed=7).linear(4, 8).activation(dpar.RELU).linear(8, 3)


def reference_batch():
    x = np.array([((i * 37) % 101) / 101.0 - 0.5 for i in range(40)], dtype=np.float32).reshape(10, 4)
    y = np.array([r % 3 for r in range(10)], dtype=np.int32)
    return x, y


def reference_losses_path():
    """$DPAR_REFERENCE_LOSSES, else build/tests/reference_losses.txt in this tree; (path, None) where it exists, else
    (None, why not)."""
    path = os.environ.get("DPAR_REFERENCE_LOSSES")
    if path:
        return path, None  # named: a missing file fails the test
    tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.path.join(tree, "build", "tests", "reference_losses.txt")
    if os.path.exists(path):
        return path, None
    return None, (f"no reference losses: DPAR_REFERENCE_LOSSES is unset and {path} does not exist (build dpar in "
                  "build/ and run `ctest --test-dir build -R binding_reference`, which writes it)")


def engine(model, **kw):
    return dpar.Engine(model, lr=0.1, momentum=0.9, devices=2, processes=dpar.PROCESSES_SINGLE, **kw)


class Reference(unittest.TestCase):
    def test_cpu_gemm_backend_names_the_library_and_its_kernels(self):
        what = dpar.cpu_gemm_backend()
        self.assertIsInstance(what, str)
        self.assertTrue(what.startswith("oneDNN "), what)
        self.assertIn(" kernels", what)
        self.assertEqual(what, dpar.cpu_gemm_backend())

    def test_losses_have_the_c_reference_bits(self):
        path, why_not = reference_losses_path()
        if path is None:
            self.skipTest(why_not)
        with open(path) as f:
            expected = f.read().split()
        self.assertEqual(len(expected), 5)
        x, y = reference_batch()
        with reference_model() as m, engine(m) as e:
            got = [format(np.float32(e.train_step(x, y)).view(np.uint32), "08x") for _ in range(5)]
            self.assertEqual(e.step_count, 5)
            self.assertEqual(e.processes, (0, 1))
            self.assertEqual(e.process_transport, "")  # one process: nothing travels between processes
            e.set_gradient_compression(dpar.COMPRESSION_BF16)  # one process: changes nothing
            with self.assertRaises(dpar.DparError) as cm:
                e.set_gradient_compression(7)
            self.assertIn("compression", cm.exception.message)
        self.assertEqual(got, expected)

    def test_a_residual_graph_is_built_named_and_checked(self):
        m = dpar.Model(3)
        self.assertEqual(m.last_node, dpar.MODEL_INPUT)
        m.linear(4, 8).activation(dpar.RELU).linear(8, 4)
        fc2 = m.last_node
        self.assertEqual(fc2, 2)
        m.add_sum([fc2, dpar.MODEL_INPUT]).set_node_name(0, "block.fc1")
        m.branch_from(3).add_reshape([2, 2]).add_concat([4, 4]).add_flatten().linear(8, 3)
        self.assertEqual(m.num_layers, 8)
        self.assertEqual(m.param_info(0)[0], "block.fc1.weight")
        self.assertEqual(m.param_info(4)[0], "7.weight")
        with self.assertRaises(dpar.DparError) as c:
            m.add_sum([0, 42])
        self.assertEqual(c.exception.status, dpar.ERR_INVALID_ARGUMENT)
        self.assertIn("node 42", str(c.exception))
        with self.assertRaises(dpar.DparError) as c:
            m.set_node_name(1, "block.fc1")
        self.assertIn("already node 0", str(c.exception))
        x, y = reference_batch()
        with engine(m) as e:
            self.assertTrue(np.isfinite(e.train_step(x, y)))

    def test_bad_call_raises_with_dpars_message(self):
        with reference_model() as m, engine(m) as e:
            with self.assertRaises(dpar.DparError) as cm:
                e.train_step(np.zeros((2, 5), np.float32), np.zeros(2, np.int32))
            self.assertEqual(cm.exception.status, dpar.ERR_INVALID_ARGUMENT)
            self.assertEqual(cm.exception.name, "DPAR_ERR_INVALID_ARGUMENT")
            self.assertIn("4", cm.exception.message)
        with self.assertRaises(dpar.DparError) as cm:
            dpar.parse_device("tpu:1")
        self.assertIn("tpu:1", cm.exception.message)
        self.assertEqual(dpar.parse_device("cpu:1"), (dpar.DEVICE_CPU, 1))  # the message was cleared

    def test_hook_exception_comes_back_with_its_message_and_hooks_run_on_workers(self):
        x, y = reference_batch()
        seen = []
        main = threading.get_ident()

        def hook(replica, in_shape, out_shape):
            seen.append((replica, in_shape, out_shape, threading.get_ident() != main))
            if replica == 1:
                raise dpar.DparError(dpar.ERR_DEVICE, "the Python probe failed on replica 1")

        with reference_model() as m, engine(m) as e:
            e.set_forward_hook(hook)
            with self.assertRaises(dpar.DparError) as cm:
                e.train_step(x, y)
            self.assertEqual(cm.exception.status, dpar.ERR_DEVICE)
            self.assertIn("the Python probe failed on replica 1", cm.exception.message)
            self.assertEqual(sorted(s[:3] for s in seen), [(0, (5, 4), (5, 3)), (1, (5, 4), (5, 3))])
            self.assertTrue(all(s[3] for s in seen))
            e.set_forward_hook(lambda r, i, o: 1 / 0)
            with self.assertRaises(dpar.DparError) as cm:
                e.train_step(x, y)
            self.assertEqual(cm.exception.status, dpar.ERR_INTERNAL)
            self.assertIn("ZeroDivisionError", cm.exception.message)
            e.set_forward_hook(None)
            e.train_step(x, y)

    def test_a_trace_is_written_as_chromes_json(self):
        x, y = reference_batch()
        with reference_model() as m, engine(m) as e:
            with self.assertRaises(dpar.DparError) as cm:
                e.trace_stop()
            self.assertEqual(cm.exception.status, dpar.ERR_INVALID_STATE)
            e.trace_start()
            e.train_step(x, y)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "trace.json")
                e.trace_stop(path)
                with open(path) as f:
                    trace = json.load(f)
            spans = [(ev["tid"], ev["name"]) for ev in trace["traceEvents"] if ev["ph"] == "X"]
            for name in ("forward", "loss", "backward", "optimizer", "device sync"):
                self.assertIn((1, name), spans)  # replica 0's worker
                self.assertIn((3, name), spans)  # replica 1's
            self.assertIn((0, "train_step"), spans)
            e.trace_stop()  # only stops, again: allowed

    def test_gradient_clipping_and_the_reported_norm(self):
        x, y = reference_batch()
        with reference_model() as m, engine(m) as plain, engine(m) as clipping:
            self.assertTrue(np.isnan(clipping.grad_norm))
            clipping.set_max_grad_norm(1e6)  # far above the norm: the same step
            plain.train_step(x, y), clipping.train_step(x, y)  # a step's loss is taken before its update
            self.assertEqual(plain.train_step(x, y), clipping.train_step(x, y))
            norm = clipping.grad_norm
            self.assertTrue(0 < norm < 1e6)
            clipping.set_max_grad_norm(norm / 10)
            plain.train_step(x, y), clipping.train_step(x, y)
            self.assertNotEqual(plain.train_step(x, y), clipping.train_step(x, y))
            with self.assertRaises(dpar.DparError) as cm:
                clipping.set_max_grad_norm(-1.0)
            self.assertIn("max_grad_norm", cm.exception.message)

    def test_the_clipped_step_has_the_norm_it_was_clipped_to(self):
        # Plain SGD with lr 1 moves the parameters by the (clipped) gradient itself, up to the rounding of p - g:
        # below the gradient's norm the move's L2 norm is max_norm and it points where the unclipped move does;
        # above it nothing is scaled. grad_norm is the norm before clipping.
        x, y = reference_batch()
        with reference_model() as m:
            n = m.num_param_elements

            def move(max_norm):
                with dpar.Engine(m, lr=1.0, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
                    before = e.params(0, n).astype(np.float64)
                    e.set_max_grad_norm(max_norm)
                    e.train_step(x, y)
                    return before - e.params(0, n).astype(np.float64), e.grad_norm

            plain, _ = move(0.0)
            norm = np.linalg.norm(plain)
            self.assertGreater(norm, 1e-2)
            same, reported = move(1e6)
            np.testing.assert_array_equal(same, plain)
            self.assertAlmostEqual(reported, norm, delta=1e-4 * norm)
            for fraction in (0.5, 0.1):
                max_norm = float(np.float32(norm * fraction))
                clipped, reported = move(max_norm)
                self.assertAlmostEqual(np.linalg.norm(clipped), max_norm, delta=1e-4 * max_norm)
                self.assertAlmostEqual(reported, norm, delta=1e-4 * norm)
                np.testing.assert_allclose(clipped, plain * (max_norm / norm), rtol=0, atol=1e-4 * max_norm)


class BatchNormBuffers(unittest.TestCase):
    def test_buffers_are_named_typed_and_equal_on_every_replica(self):
        with dpar.Model(seed=3).linear(4, 6, bias=False).batchnorm1d(6).linear(6, 3) as m:
            m.convert_sync_batchnorm()
            self.assertEqual(m.num_buffers, 3)
            self.assertEqual(m.buffer_info(0), ("1.running_mean", np.dtype(np.float32), (6,)))
            self.assertEqual(m.buffer_info(2), ("1.num_batches_tracked", np.dtype(np.int64), ()))
            np.testing.assert_array_equal(m.get_buffer(1), np.ones(6, np.float32))
            m.set_buffer(2, 4)
            self.assertEqual(int(m.get_buffer(2)), 4)
            with self.assertRaises(dpar.DparError):
                m.buffer_info(3)
            x, y = reference_batch()
            with dpar.Engine(m, lr=0.1, devices=3, processes=dpar.PROCESSES_SINGLE) as e:
                e.train_step(x, y)
                mean = e.buffer(m, 0, 0)
                self.assertFalse(np.all(mean == 0))
                np.testing.assert_array_equal(e.buffer(m, 2, 0), mean)
                self.assertEqual(int(e.buffer(m, 1, 2)), 5)
                with self.assertRaises(dpar.DparError):
                    e.buffer(m, 3, 0)


class LayerNormEmbedding(unittest.TestCase):
    def test_trains_on_int32_tokens_and_refuses_a_bad_index(self):
        with dpar.Model(seed=5).embedding(9, 4).layernorm(4).add_flatten().linear(12, 3) as m:
            with self.assertRaises(dpar.DparError):
                dpar.Model(seed=1).embedding(0, 4)
            with self.assertRaises(dpar.DparError):
                dpar.Model(seed=1).layernorm(4, eps=0.0)
            with dpar.Model(seed=1).embedding(4, 2, padding_idx=-1) as padded:
                np.testing.assert_array_equal(padded.get_param(0)[3], np.zeros(2, np.float32))
            with self.assertRaises(dpar.DparError):
                dpar.Model(seed=1).embedding(4, 2, padding_idx=4)
            tokens = (np.arange(15, dtype=np.int32) * 5 % 9).reshape(5, 3)
            labels = np.array([0, 1, 2, 1, 0], np.int32)
            with dpar.Engine(m, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
                self.assertTrue(np.isfinite(e.train_step(tokens, labels)))
                bad = tokens.copy()
                bad[1, 1] = 9
                with self.assertRaisesRegex(dpar.DparError, r"index 9 at position \(1, 1\)"):
                    e.train_step(bad, labels)
                with self.assertRaises(dpar.DparError):
                    e.train_step(tokens.astype(np.float32), labels)
                self.assertTrue(np.isfinite(e.train_step(tokens, labels)))

    def test_a_tied_weight_is_one_parameter_read_by_two_nodes(self):
        # The GPT pattern: the output projection reads the token embedding's weight (lm_head.weight = wte.weight).
        with dpar.Model(seed=4).embedding(7, 5).linear(5, 7, bias=False) as m:
            with self.assertRaisesRegex(dpar.DparError, 'has no parameter "bias"'):
                m.tie_param(1, "weight", 0, "bias")
            m.tie_param(1, "weight", 0, "weight")
            self.assertEqual((m.num_params, m.num_param_elements), (1, 35))
            self.assertEqual(m.param_info(0), ("0.weight", (7, 5)))
            with self.assertRaisesRegex(dpar.DparError, "tied already"):
                m.tie_param(1, "weight", 0, "weight")
            tokens = np.array([0, 3, 6, 2, 3], np.int32)
            labels = np.array([3, 6, 2, 3, 1], np.int32)
            with dpar.Engine(m, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
                first = e.train_step(tokens, labels)
                self.assertLess(e.train_step(tokens, labels), first)



def tiny_gpt():
    """nanoGPT's first layers, small: wte (11 tokens, 8 channels), wpe (4 positions), one attention block of 2 heads
    with its residual, then (B, T x C) to 3 classes for the cross-entropy over (B, classes)."""
    m = dpar.Model(seed=7)
    m.embedding(11, 8).set_node_name(0, "transformer.wte")
    m.position_embedding(4, 8).set_node_name(1, "transformer.wpe")
    x = m.last_node
    m.causal_self_attention(8, 2, name="transformer.h.0.attn")
    return m.add_sum([m.last_node, x]).add_flatten().linear(4 * 8, 3)


class Attention(unittest.TestCase):
    def test_layers_have_pytorchs_names_and_refuse_bad_values(self):
        with tiny_gpt() as m:
            self.assertEqual(m.num_layers, 8)  # wte, wpe, c_attn, attention, c_proj, sum, flatten, linear
            self.assertEqual([m.param_info(i) for i in range(m.num_params)], [
                ("transformer.wte.weight", (11, 8)), ("transformer.wpe.weight", (4, 8)),
                ("transformer.h.0.attn.c_attn.weight", (24, 8)), ("transformer.h.0.attn.c_attn.bias", (24,)),
                ("transformer.h.0.attn.c_proj.weight", (8, 8)), ("transformer.h.0.attn.c_proj.bias", (8,)),
                ("7.weight", (3, 32)), ("7.bias", (3,))])
            # A bad value is refused, named, and leaves the model as it was.
            for call, what in [(lambda: m.multihead_attention(8, 0), "num_heads: 0"),
                               (lambda: m.multihead_attention(8, 3), "num_heads: 3"),
                               (lambda: m.causal_self_attention(8, 2, dropout=1.0), "dropout_p: 1"),
                               (lambda: m.causal_self_attention(8, 3), "n_head: 3"),
                               (lambda: m.causal_self_attention(8, 2, name="transformer.h.0.attn"),
                                "transformer.h.0.attn.c_attn"),
                               (lambda: m.attention(2, inputs=[0, 1]), "n: 2"),
                               (lambda: m.attention(0), "num_heads: 0"),
                               (lambda: m.attention(2, scale=-1.0), "scale: -1"),
                               (lambda: m.position_embedding(0, 8), "max_positions: 0")]:
                with self.assertRaises(dpar.DparError) as c:
                    call()
                self.assertEqual(c.exception.status, dpar.ERR_INVALID_ARGUMENT)
                self.assertIn(what, c.exception.message)
            self.assertEqual((m.num_layers, m.num_params), (8, 8))
            with dpar.Engine(m, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
                with self.assertRaises(dpar.DparError) as c:
                    e.train_step((np.arange(20, dtype=np.int32) % 11).reshape(4, 5), np.zeros(4, np.int32))
                self.assertEqual(c.exception.status, dpar.ERR_INVALID_ARGUMENT)
                self.assertIn("a sequence of 5 positions is longer than the 4", c.exception.message)

        with dpar.Model(seed=1).embedding(11, 8).multihead_attention(8, 2, is_causal=True) as mha:
            self.assertEqual([mha.param_info(i) for i in range(1, 5)], [
                ("1.in_proj_weight", (24, 8)), ("1.in_proj_bias", (24,)), ("1.out_proj.weight", (8, 8)),
                ("1.out_proj.bias", (8,))])
            np.testing.assert_array_equal(mha.get_param(2), np.zeros(24, np.float32))  # zero biases, as the module's
            mha.multihead_attention(8, 1, bias=False)
            self.assertEqual(mha.num_params, 7)

        # Attention over q, k and v of explicit nodes, over one packed projection, and over the next input.
        with dpar.Model(seed=1).embedding(11, 8) as sdpa:
            sdpa.attention(2, inputs=[0, 0, 0], is_causal=True, dropout_p=0.1, scale=0.5)
            sdpa.linear(8, 24, bias=False).attention(4, inputs=[2], is_causal=True)
            sdpa.branch_from(2).attention(4)
            self.assertEqual((sdpa.num_layers, sdpa.num_params), (5, 2))

    def test_a_tiny_gpt_trains_on_tokens(self):
        tokens = (np.arange(16, dtype=np.int32) * 7 % 11).reshape(4, 4)
        labels = np.array([0, 1, 2, 1], np.int32)
        with tiny_gpt() as m, dpar.Engine(m, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
            first = e.train_step(tokens, labels)
            self.assertTrue(np.isfinite(first))
            self.assertLess(e.train_step(tokens, labels), first)


class Tensors(unittest.TestCase):
    def test_numpy_in_and_out_without_a_copy(self):
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        t = dpar.Tensor.wrap(a)
        v = t.numpy()
        self.assertEqual(v.shape, (2, 3))
        a[1, 2] = 42.0  # the same memory
        self.assertEqual(v[1, 2], 42.0)
        self.assertEqual(t.shape, (2, 3))
        with self.assertRaises(dpar.DparError):
            dpar.Tensor.wrap(np.zeros((2, 3), np.float64))

    def test_dlpack_both_ways(self):
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        t = dpar.Tensor.from_dlpack(a)  # NumPy's __dlpack__
        self.assertEqual(t.shape, (3, 4))
        a[0, 0] = -1.0
        self.assertEqual(t.numpy()[0, 0], -1.0)  # no copy
        back = np.from_dlpack(t)  # dpar's __dlpack__
        self.assertEqual(back.shape, (3, 4))
        t.numpy()[2, 3] = 7.0
        self.assertEqual(back[2, 3], 7.0)
        del t
        self.assertEqual(back[0, 0], -1.0)  # the capsule keeps the storage

    def test_dlpack_stream_protocol(self):
        # The Python array API's stream protocol: a CUDA producer is asked for stream=1 (the legacy default
        # stream, which dpar_tensor_from_dlpack waits for); a CPU producer gets no stream, as the protocol requires.
        class Producer:
            def __init__(self, array, device):
                self.array, self.device, self.calls = array, device, []

            def __dlpack_device__(self):
                return self.device

            def __dlpack__(self, **kwargs):
                self.calls.append(kwargs)
                return self.array.__dlpack__()  # host memory either way: this machine may have no GPU

        a = np.arange(4, dtype=np.float32)
        cpu = Producer(a, (1, 0))
        self.assertEqual(dpar.Tensor.from_dlpack(cpu).shape, (4,))
        self.assertEqual(cpu.calls, [{}])
        cuda = Producer(a, (2, 0))
        self.assertEqual(dpar.Tensor.from_dlpack(cuda).shape, (4,))
        self.assertEqual(cuda.calls, [{"stream": 1}])
        # dpar as a producer takes whatever stream a consumer names (its work is done when its calls return).
        t = dpar.Tensor.from_numpy(a)
        for stream in (None, -1, 1, 2, 12345):
            self.assertEqual(np.from_dlpack(_Capsule(t.__dlpack__(stream=stream))).shape, (4,))


class _Capsule:
    """Hands an existing DLPack capsule to np.from_dlpack, which takes objects with __dlpack__."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **_):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


class NumpyLinear(dpar.CustomLayer):
    """y = x W^T + b in NumPy, with a per-replica call count and a switch that makes one replica raise."""

    name = "numpy_linear"

    def __init__(self, n_in, n_out):
        self.n_in, self.n_out = n_in, n_out
        self.params = [dpar.Param("weight", (n_out, n_in), dpar.INIT_UNIFORM, 0.5), dpar.Param("bias", (n_out,))]
        self.forwards = {}
        self.fail_replica = None
        self.lock = threading.Lock()

    def output_shape(self, input_shape):
        if len(input_shape) != 2 or input_shape[1] != self.n_in:
            raise ValueError(f"numpy_linear takes {self.n_in} features, not {input_shape[1:]}")
        return (input_shape[0], self.n_out)

    def forward(self, call):
        with self.lock:
            self.forwards[call.replica] = self.forwards.get(call.replica, 0) + 1
        if call.replica == self.fail_replica:
            raise RuntimeError(f"numpy_linear refused replica {call.replica}")
        w, b = call.params
        call.output[...] = call.input @ w.T + b

    def backward(self, call):
        w, _ = call.params
        dw, db = call.grads
        dw[...] = call.grad_output.T @ call.input
        db[...] = call.grad_output.sum(axis=0)
        if call.grad_input is not None:
            call.grad_input[...] = call.grad_output @ w


def custom_and_builtin(layer):
    """(custom, built-in): linear 6-8, tanh, then the custom layer or a built-in linear 8-4 with its parameters."""
    custom = dpar.Model(seed=3).linear(6, 8).activation(dpar.TANH).custom(layer)
    builtin = dpar.Model(seed=5).linear(6, 8).activation(dpar.TANH).linear(8, 4)
    for i in range(custom.num_params):
        builtin.set_param(i, custom.get_param(i))
    return custom, builtin


def custom_batch():
    rng = np.random.default_rng(4)
    return rng.uniform(-1, 1, (10, 6)).astype(np.float32), rng.integers(0, 4, 10).astype(np.int32)


class CustomLayers(unittest.TestCase):
    def test_numpy_linear_trains_as_the_built_in_one_over_two_devices(self):
        layer = NumpyLinear(8, 4)
        custom, builtin = custom_and_builtin(layer)
        self.assertEqual(custom.param_info(2), ("2.weight", (4, 8)))
        self.assertEqual(custom.param_info(3), ("2.bias", (4,)))
        self.assertTrue(np.all(custom.get_param(3) == 0) and np.all(np.abs(custom.get_param(2)) <= 0.5))
        x, y = custom_batch()
        n = custom.num_param_elements
        with custom, builtin, engine(custom) as ec, engine(builtin) as eb:
            initial = ec.params(0, n)
            for step in range(8):
                lc, lb = ec.train_step(x, y), eb.train_step(x, y)
                # NumPy's and dpar's matrix products may sum in another order: equal within float rounding.
                self.assertAlmostEqual(lc, lb, delta=1e-5 * abs(lb), msg=f"step {step}")
            pc, pb = ec.params(0, n), eb.params(0, n)
            np.testing.assert_allclose(pc, pb, rtol=1e-5, atol=1e-6)
            self.assertGreater(np.max(np.abs(pc - initial)), 1e-2)  # it trained
            np.testing.assert_array_equal(ec.params(1, n), pc)  # replicas stay identical
            self.assertEqual(layer.forwards, {0: 8, 1: 8})  # 10 rows over 2 devices: both ran every step
            # Eval-mode forward goes through the layer too.
            ec.set_training(False)
            eb.set_training(False)
            np.testing.assert_allclose(ec.forward(x).numpy(), eb.forward(x).numpy(), rtol=1e-5, atol=1e-6)

    def test_an_exception_in_the_layer_comes_back_with_its_message(self):
        layer = NumpyLinear(8, 4)
        custom, _ = custom_and_builtin(layer)
        x, y = custom_batch()
        with custom, engine(custom) as e:
            layer.fail_replica = 1
            with self.assertRaises(dpar.DparError) as cm:
                e.train_step(x, y)
            self.assertEqual(cm.exception.status, dpar.ERR_INTERNAL)
            self.assertIn("numpy_linear", cm.exception.message)  # dpar names the layer
            self.assertIn("RuntimeError: numpy_linear refused replica 1", cm.exception.message)
        # A DparError keeps its status; a rejected input shape fails the call with the layer's text.
        layer = NumpyLinear(8, 4)
        custom, _ = custom_and_builtin(layer)
        with custom, engine(custom) as e:
            def fail(call):
                raise dpar.DparError(dpar.ERR_DEVICE, "the Python layer lost its device")

            layer.backward = fail
            with self.assertRaises(dpar.DparError) as cm:
                e.train_step(x, y)
            self.assertEqual(cm.exception.status, dpar.ERR_DEVICE)
            self.assertIn("the Python layer lost its device", cm.exception.message)
        with dpar.Model(seed=3).linear(6, 5).custom(NumpyLinear(8, 4)) as bad:
            with self.assertRaises(dpar.DparError) as cm:
                with engine(bad) as e:
                    e.train_step(x, y)
            self.assertIn("numpy_linear takes 8 features", cm.exception.message)


class Collectives(unittest.TestCase):
    def test_thread_group_all_reduce_and_abort(self):
        group = dpar.CommGroup(2, timeout_seconds=30)
        comms = [group.member(r) for r in range(2)]
        group.close()
        results = [None, None]

        def body(r):
            c = comms[r]
            buf = np.full(5, r + 1.0, np.float32)
            c.all_reduce(buf)
            results[r] = buf.copy()
            c.barrier()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        comms[1].abort("participant 1 stopped")  # every participant has left the collectives
        errors = [c.async_error() for c in comms]
        for r in range(2):
            np.testing.assert_array_equal(results[r], np.full(5, 3.0, np.float32))
            self.assertEqual(errors[r].status, dpar.ERR_REMOTE)
            self.assertIn("participant 1 stopped", errors[r].message)
        [c.close() for c in comms]

    def test_cuda_array_interface_buffers(self):
        # What a PyTorch CUDA tensor or a CuPy array shows: __cuda_array_interface__. Over host memory here, which
        # a group on CPU devices accepts, so that the same code path runs without a GPU.
        class HostAsCudaArray:
            def __init__(self, a, strides=None):
                self.a = a
                self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "version": 3,
                                                 "data": (a.ctypes.data, False), "strides": strides}

        group = dpar.CommGroup.on_devices(["cpu:0", "cpu:1"], timeout_seconds=30)
        comms = [group.member(r) for r in range(2)]
        group.close()
        grads = [[np.zeros(7, np.float32), np.zeros((3, 5), np.float32)] for _ in range(2)]
        sums = [None, None]

        def body(r):
            c = comms[r]
            buf = np.full(4, r + 1.0, np.float64)
            c.all_reduce(HostAsCudaArray(buf))
            sums[r] = buf.copy()
            red = dpar.Reducer(c, [HostAsCudaArray(g) for g in grads[r]], op=dpar.SUM)
            for i, g in enumerate(grads[r]):
                g[...] = r + 1 + i
                red.grad_ready(i)
            red.wait()
            red.close()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        [c.close() for c in comms]
        for r in range(2):
            np.testing.assert_array_equal(sums[r], np.full(4, 3.0))
            np.testing.assert_array_equal(grads[r][0], np.full(7, 3.0, np.float32))
            np.testing.assert_array_equal(grads[r][1], np.full((3, 5), 5.0, np.float32))
        with dpar.CommGroup(1) as g, g.member(0) as c:
            with self.assertRaises(dpar.DparError) as cm:
                c.all_reduce(np.zeros((4, 4), np.float32)[:, 1])  # strided
            self.assertIn("send", cm.exception.message)
            with self.assertRaises(dpar.DparError) as cm:
                c.all_reduce(HostAsCudaArray(np.zeros((2, 2), np.float32), strides=(4, 8)))
            self.assertIn("strided", cm.exception.message)
            with self.assertRaises(dpar.DparError) as cm:
                c.broadcast([1.0, 2.0], 0)
            self.assertIn("__cuda_array_interface__", cm.exception.message)

    def test_a_reducer_over_the_processes_of_a_job_of_one_gives_the_groups_mean_in_bf16(self):
        # Without mpirun, Comm.mpi() is rank 0 of 1: nothing crosses the processes, so bf16 rounds nothing, and the
        # mean is over the group's 2 members. Values that bfloat16 cannot hold (1/1024 beside 1 to 4) show any
        # rounding.
        processes = dpar.Comm.mpi(timeout_seconds=30)
        self.assertEqual(processes.rank_size, (0, 1))
        group = dpar.CommGroup(2, timeout_seconds=30)
        comms = [group.member(r) for r in range(2)]
        group.close()
        grads = [[np.zeros(300, np.float32), np.zeros((3, 5), np.float32)] for _ in range(2)]
        errors = []

        def body(r):
            try:
                with dpar.Reducer(comms[r], grads[r], 32, 256, dpar.MEAN, processes=processes,
                                  compression=dpar.COMPRESSION_BF16) as red:
                    self.assertEqual(red.num_buckets, 2)
                    for i in reversed(range(2)):
                        grads[r][i][...] = r + 1 + 2 * i + 1 / 1024
                        red.grad_ready(i)
                    red.wait()
            except Exception as e:  # reported by the test's thread
                comms[r].abort(str(e))
                errors.append(e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        [c.close() for c in comms]
        processes.close()
        self.assertEqual(errors, [])
        for r in range(2):
            np.testing.assert_array_equal(grads[r][0], np.full(300, 1.5 + 1 / 1024, np.float32))
            np.testing.assert_array_equal(grads[r][1], np.full((3, 5), 3.5 + 1 / 1024, np.float32))

    def test_a_reducer_refuses_its_own_comm_as_the_processes_and_an_unknown_compression(self):
        # Refusals that show that both options reach dpar.
        with dpar.CommGroup(1) as g, g.member(0) as c:
            grads = [np.zeros(4, np.float32)]
            with self.assertRaises(dpar.DparError) as cm:
                dpar.Reducer(c, grads, processes=c)
            self.assertEqual(cm.exception.status, dpar.ERR_INVALID_ARGUMENT)
            self.assertIn("opts.processes: is the reducer's own communicator", cm.exception.message)
            with self.assertRaises(dpar.DparError) as cm:
                dpar.Reducer(c, grads, compression=7)
            self.assertEqual(cm.exception.status, dpar.ERR_INVALID_ARGUMENT)
            self.assertIn("opts.compression: 7", cm.exception.message)
            with self.assertRaises(TypeError) as te:
                dpar.Reducer(c, grads, processes=g)
            self.assertIn("processes: expected a dpar.Comm", str(te.exception))
            with dpar.CommGroup(1) as other:
                closed = other.member(0)
                closed.close()
                with self.assertRaises(dpar.DparError) as cm:
                    dpar.Reducer(c, grads, processes=closed)
                self.assertIn("this Comm is closed", cm.exception.message)

    def test_group_on_devices(self):
        group = dpar.CommGroup.on_devices(["cpu:0", (dpar.DEVICE_CPU, 1)], timeout_seconds=30)
        comms = [group.member(r) for r in range(2)]
        group.close()
        self.assertEqual([c.device for c in comms], [(dpar.DEVICE_CPU, 0), (dpar.DEVICE_CPU, 1)])
        threads = [threading.Thread(target=c.all_reduce, args=(np.full(3, 1.0, np.float32),)) for c in comms]
        [t.start() for t in threads]
        [t.join() for t in threads]
        [c.close() for c in comms]
        with self.assertRaises(dpar.DparError) as cm:
            dpar.CommGroup.on_devices(["cpu:0", "cpu:1"], streams=[None])
        self.assertIn("streams", cm.exception.message)
        with self.assertRaises(dpar.DparError) as cm:
            dpar.CommGroup.on_devices(["cpu:0"], streams=[1234])
        self.assertIn("streams[0]", cm.exception.message)


if __name__ == "__main__":
    unittest.main()
