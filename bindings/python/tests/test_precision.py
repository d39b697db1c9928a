"""Engine.set_precision: f32 by default, unknown dtypes refused with dpar's message, TF32 absent on CPU devices, and
bf16 and f16 each either accepted or refused whole with the reason (a CPU without bf16 arithmetic; f16 on CPUs)."""
import math
import unittest

import numpy as np

import dpar


class PrecisionTest(unittest.TestCase):
    def test_policy(self):
        with dpar.Model(seed=3).linear(6, 8).activation(dpar.RELU).linear(8, 3) as m, \
                dpar.Engine(m, optimizer=dpar.SGD, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
            self.assertEqual(e.precision, dpar.DType.F32)
            try:
                e.set_precision(dpar.DType.F16)
            except dpar.DparError as refused:
                self.assertEqual(refused.status, dpar.Status.ERR_NOT_SUPPORTED)
                self.assertIn("f16", str(refused))
                self.assertEqual(e.precision, dpar.DType.F32)
            else:
                self.assertEqual(e.precision, dpar.DType.F16)
                e.set_precision(dpar.DType.F32)
            with self.assertRaises(dpar.DparError) as err:
                e.set_precision(7)
            self.assertIn("compute_dtype", str(err.exception))
            self.assertFalse(e.set_allow_tf32(True), "CPU devices have no TF32")
            x = np.array([((i * 37) % 101) / 101.0 - 0.5 for i in range(66)], dtype=np.float32).reshape(11, 6)
            y = np.array([r % 3 for r in range(11)], dtype=np.int32)
            try:
                e.set_precision(dpar.DType.BF16)
            except dpar.DparError as refused:
                self.assertEqual(refused.status, dpar.Status.ERR_NOT_SUPPORTED)
                self.assertEqual(e.precision, dpar.DType.F32)
                return
            self.assertEqual(e.precision, dpar.DType.BF16)
            self.assertTrue(math.isfinite(e.train_step(x, y)))


if __name__ == "__main__":
    unittest.main()
