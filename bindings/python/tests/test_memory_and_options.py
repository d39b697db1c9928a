"""Views of dpar's memory outlive close() safely; Engine's keywords are every option field and nothing else; a
loader iterates again; DLPack export speaks the 1.0 protocol; enums are IntEnums; a hook does not pin its engine.

The view tests read a view after its tensor (or loader) was closed and the freed memory was handed out again with
other values: before views held their memory, they read those values (or crashed)."""
import gc
import math
import os
import struct
import tempfile
import unittest
import weakref

import numpy as np

import dpar

from test_dpar import engine, reference_batch, reference_model


def churn(shape, dtype, value):
    """Tensors of the given shape filled with value, allocated until freed memory of that size is surely reused."""
    return [dpar.Tensor.from_numpy(np.full(shape, value, dtype=dtype)) for _ in range(32)]


def write_idx(directory, images, labels):
    """An IDX image file and label file (the MNIST layout) holding images (n, h, w) uint8 and labels (n)."""
    n, h, w = images.shape
    ipath, lpath = os.path.join(directory, "images.idx"), os.path.join(directory, "labels.idx")
    with open(ipath, "wb") as f:
        f.write(struct.pack(">IIII", 0x803, n, h, w) + images.astype(np.uint8).tobytes())
    with open(lpath, "wb") as f:
        f.write(struct.pack(">II", 0x801, n) + labels.astype(np.uint8).tobytes())
    return ipath, lpath


class ViewsKeepTheirMemory(unittest.TestCase):
    def test_a_view_read_after_close(self):
        values = np.arange(4096, dtype=np.float32)
        t = dpar.Tensor.from_numpy(values)
        view = t.numpy()
        t.close()
        gc.collect()
        kept = churn(values.shape, np.float32, -1.0)
        np.testing.assert_array_equal(view, values)
        view[0] = 5.0  # still dpar's memory, writable, and no one else's
        self.assertTrue(all(float(k.numpy()[0]) == -1.0 for k in kept))
        with self.assertRaises(dpar.DparError) as cm:  # a closed tensor refuses calls rather than reach freed memory
            t.numpy()
        self.assertIn("closed", cm.exception.message)

    def test_a_view_read_after_its_with_block(self):
        x = np.random.default_rng(5).standard_normal((2048, 4), dtype=np.float32)  # an output of 24 KiB
        with reference_model() as m, engine(m) as e:
            e.set_training(False)
            expected = e.forward(x).copy_to_numpy()
            with e.forward(x) as out:
                view = out.numpy()[2:]  # a view of a view holds the memory too
        gc.collect()
        kept = churn(expected.shape, np.float32, 7.0)
        np.testing.assert_array_equal(view, expected[2:])
        del kept

    def test_a_loader_batch_view_read_after_the_loader_closes(self):
        rng = np.random.default_rng(3)
        images, labels = rng.integers(0, 256, (8, 4, 4)), rng.integers(0, 10, 8)
        with tempfile.TemporaryDirectory() as d:
            data = dpar.Dataset(*write_idx(d, images, labels))
            loader = dpar.Loader(data, batch_size=8)
            x, y = loader.next()
            xv, yv = x.numpy(), y.numpy()
            loader.close()
            data.close()
        gc.collect()
        kept = churn((8, 16), np.float32, -3.0) + churn((8,), np.int32, -3)
        np.testing.assert_array_equal(xv, images.reshape(8, 16).astype(np.float32) / 255)
        np.testing.assert_array_equal(yv, labels)
        del kept


class EngineKeywords(unittest.TestCase):
    def test_an_unknown_keyword_is_a_type_error_naming_it(self):
        with reference_model() as m:
            with self.assertRaises(TypeError) as cm:
                dpar.Engine(m, momentun=0.9)
            self.assertIn("momentun", str(cm.exception))

    def test_a_bad_value_names_the_argument_and_the_value(self):
        cases = [dict(lr="fast"), dict(nesterov=2), dict(seed=-1), dict(devices=1.5), dict(beta1="x"),
                 dict(first_bucket_bytes=2**70), dict(loss=2**40), dict(device_ids=["a"])]
        with reference_model() as m:
            for kw in cases:
                (name, value), = kw.items()
                with self.subTest(**{name: repr(value)}):
                    with self.assertRaises((TypeError, ValueError)) as cm:
                        dpar.Engine(m, **kw)
                    text = str(cm.exception)
                    self.assertTrue(text.startswith(name + ":"), text)
                    self.assertIn(repr(value) if not isinstance(value, int) else str(value), text)
                    self.assertNotIn("in method", text)

    def test_swigs_messages_never_reach_the_user(self):
        with dpar.Model() as m:
            for call, name, value in [(lambda: m.linear("a", 3), "in_features", "'a'"),
                                      (lambda: m.dropout("x"), "p", "'x'"),
                                      (lambda: m.linear(4, 2**70), "out_features", str(2**70))]:
                with self.assertRaises((TypeError, OverflowError)) as cm:
                    call()
                text = str(cm.exception)
                self.assertIn(name, text)
                self.assertIn(value, text)
                self.assertNotIn("in method", text)

    def params_after(self, steps=3, **kw):
        x, y = reference_batch()
        with reference_model() as m, dpar.Engine(m, devices=2, processes=dpar.PROCESSES_SINGLE, **kw) as e:
            for _ in range(steps):
                e.train_step(x, y)
            return e.params(0, m.num_param_elements)

    def test_every_optimizer_field_reaches_dpar(self):
        # Each keyword changes the parameters after a few steps; a keyword dropped on the way would not.
        adam = dict(optimizer=dpar.ADAM, lr=0.01)
        base = self.params_after(**adam)
        for kw in [dict(beta1=0.5), dict(beta2=0.9), dict(eps=0.1), dict(weight_decay=0.5)]:
            with self.subTest(**kw):
                self.assertFalse(np.array_equal(self.params_after(**adam, **kw), base))
        np.testing.assert_array_equal(self.params_after(**adam, beta1=0.9, beta2=0.999, eps=1e-8), base)
        sgd = dict(lr=0.1, momentum=0.9)
        base = self.params_after(**sgd)
        for kw in [dict(dampening=0.5), dict(nesterov=True), dict(weight_decay=0.5)]:
            with self.subTest(**kw):
                self.assertFalse(np.array_equal(self.params_after(**sgd, **kw), base))
        # The defaults are dpar's: spelled out, they give the same bits.
        np.testing.assert_array_equal(self.params_after(**sgd, dampening=0.0, nesterov=False), base)

    def test_engine_fields_reach_dpar(self):
        with reference_model() as m:
            with dpar.Engine(m, devices=3, output_device=1, blas_threads=1, pin_workers=False,
                             first_bucket_bytes=64, bucket_cap_bytes=64, processes=dpar.PROCESSES_SINGLE) as e:
                self.assertEqual(e.num_replicas, 3)
                self.assertGreater(e.num_buckets, 1)  # 64-byte buckets split the reference model's 67 floats
            with self.assertRaises(dpar.DparError) as cm:  # an output device that is not one of the devices
                dpar.Engine(m, devices=2, output_device=5, processes=dpar.PROCESSES_SINGLE)
            self.assertEqual(cm.exception.status, dpar.ERR_INVALID_ARGUMENT)

    def test_create_timeout_seconds_reaches_dpar(self):
        # dpar refuses a negative or NaN one by its name; a finite or infinite one gives an engine that trains.
        x, y = reference_batch()
        with reference_model() as m:
            for bad in (-1, float("nan")):
                with self.subTest(create_timeout_seconds=bad):
                    with self.assertRaises(dpar.DparError) as cm:
                        dpar.Engine(m, devices=2, processes=dpar.PROCESSES_SINGLE, create_timeout_seconds=bad)
                    self.assertEqual(cm.exception.status, dpar.ERR_INVALID_ARGUMENT)
                    self.assertIn("create_timeout_seconds", cm.exception.message)
            for good in (30, math.inf):
                with self.subTest(create_timeout_seconds=good):
                    with dpar.Engine(m, devices=2, processes=dpar.PROCESSES_SINGLE, timeout_seconds=60,
                                     create_timeout_seconds=good) as e:
                        loss = e.train_step(x, y)
                        self.assertTrue(math.isfinite(loss) and loss > 0, loss)
            with self.assertRaises(TypeError) as cm:  # checked before SWIG sees it, naming the keyword
                dpar.Engine(m, create_timeout_seconds="soon")
            self.assertTrue(str(cm.exception).startswith("create_timeout_seconds:"), str(cm.exception))


if __name__ == "__main__":
    unittest.main()


def hook_holding(engine, seen):
    """A forward hook that holds `engine` in its closure (as a hook that reads the engine's state does)."""
    return lambda replica, input_shape, output_shape: seen.append((replica, engine)[0])


class Protocols(unittest.TestCase):
    def test_a_second_for_iterates_again(self):
        rng = np.random.default_rng(4)
        images, labels = rng.integers(0, 256, (8, 2, 2)), np.arange(8)
        with tempfile.TemporaryDirectory() as d:
            with dpar.Dataset(*write_idx(d, images, labels)) as data, \
                    dpar.Loader(data, batch_size=4, shuffle=True, seed=1) as loader:
                epochs = [[y.copy_to_numpy().tolist() for _, y in loader] for _ in range(3)]
                loader.start_epoch(1)
                again = [y.copy_to_numpy().tolist() for _, y in loader]
        for epoch in epochs:  # each `for` is a whole epoch: every sample once
            self.assertEqual(len(epoch), 2)
            self.assertEqual(sorted(sum(epoch, [])), list(range(8)))
        self.assertNotEqual(epochs[0], epochs[1])  # the next epoch, reshuffled
        self.assertEqual(again, epochs[1])  # start_epoch(1) rewinds to that epoch's order

    def test_dlpack_export_versions_devices_and_copies(self):
        import ctypes
        is_valid = ctypes.pythonapi.PyCapsule_IsValid
        is_valid.restype, is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
        t = dpar.Tensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
        self.assertTrue(is_valid(t.__dlpack__(max_version=(1, 0)), b"dltensor_versioned"))
        self.assertTrue(is_valid(t.__dlpack__(), b"dltensor"))  # a consumer of DLPack 0.x
        shared = np.from_dlpack(t)  # NumPy asks for a versioned capsule: writable, as dpar's memory is
        self.assertTrue(shared.flags.writeable)
        shared[0, 1] = 42.0
        self.assertEqual(t.copy_to_numpy()[0, 1], 42.0)
        copied = np.from_dlpack(t, copy=True)
        copied[0, 0] = -5.0
        self.assertEqual(t.copy_to_numpy()[0, 0], 0.0)
        self.assertEqual(np.from_dlpack(t, device="cpu").shape, (2, 3))  # dl_device: the tensor's own
        with self.assertRaises(BufferError):
            t.__dlpack__(dl_device=(2, 0), copy=False)  # another device, and copying refused
        t.close()
        self.assertEqual(shared[0, 1], 42.0)  # the capsule's consumer keeps the storage

    def test_enums_are_int_enums(self):
        import enum
        for member in (dpar.RELU, dpar.SUM, dpar.F32, dpar.ADAM, dpar.LOSS_MSE, dpar.PROCESSES_SINGLE,
                       dpar.COMPRESSION_BF16, dpar.FAULT_ALLOC, dpar.DEVICE_CPU, dpar.INIT_UNIFORM, dpar.OK):
            self.assertIsInstance(member, enum.IntEnum)
        self.assertIs(dpar.Tensor.zeros((2,), dpar.I32).dtype, dpar.DType.I32)
        with self.assertRaises(dpar.DparError) as cm:
            dpar.parse_device("tpu:1")
        self.assertIs(cm.exception.status, dpar.Status.ERR_INVALID_ARGUMENT)

    def test_a_hook_that_captures_its_engine_does_not_keep_it_alive(self):
        x, y = reference_batch()
        seen = []
        with reference_model() as m:
            e = engine(m)
            e.set_forward_hook(hook_holding(e, seen))
            e.train_step(x, y)
            alive = weakref.ref(e)
            del e
            gc.collect()
        self.assertEqual(sorted(seen), [0, 1])  # the hook ran, on both replicas
        self.assertIsNone(alive(), "the engine outlived every reference but its hook's")
