"""dpar's Python binding against the C reference (tests/binding_reference.c): the same model, data and seed on 2
CPU devices give the same loss bits; a bad call raises DparError with dpar's message; a callback's exception comes
back with its own text. Run: python -m unittest discover bindings/python/tests (DPAR_REFERENCE_LOSSES set)."""
import os
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


def engine(model, **kw):
    return dpar.Engine(model, lr=0.1, momentum=0.9, devices=2, processes=dpar.PROCESSES_SINGLE, **kw)


class Reference(unittest.TestCase):
    def test_losses_have_the_c_reference_bits(self):
        path = os.environ.get("DPAR_REFERENCE_LOSSES")
        self.assertIsNotNone(path, "DPAR_REFERENCE_LOSSES: the file build/tests/binding_reference writes")
        with open(path) as f:
            expected = f.read().split()
        self.assertEqual(len(expected), 5)
        x, y = reference_batch()
        with reference_model() as m, engine(m) as e:
            got = [format(np.float32(e.train_step(x, y)).view(np.uint32), "08x") for _ in range(5)]
            self.assertEqual(e.step_count, 5)
        self.assertEqual(got, expected)

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


if __name__ == "__main__":
    unittest.main()
