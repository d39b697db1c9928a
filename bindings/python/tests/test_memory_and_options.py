"""Views of dpar's memory outlive close() safely, and Engine's keywords are every option field and nothing else.

The view tests read a view after its tensor (or loader) was closed and the freed memory was handed out again with
other values: before views held their memory, they read those values (or crashed)."""
import gc
import os
import struct
import tempfile
import unittest

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


if __name__ == "__main__":
    unittest.main()
