"""Engine.set_reduce_dtype: f32 by default, another dtype refused with dpar's message, and bf16 rounding the
reduction for real (the parameters differ from f32's) while the replicas stay bit-identical."""
import math
import unittest

import numpy as np

import dpar


class ReduceDtypeTest(unittest.TestCase):
    def test_bf16_reduction(self):
        elements = 6 * 8 + 8 + 8 * 3 + 3
        with dpar.Model(seed=3).linear(6, 8).activation(dpar.RELU).linear(8, 3) as m, \
                dpar.Engine(m, optimizer=dpar.SGD, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as plain, \
                dpar.Engine(m, optimizer=dpar.SGD, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
            self.assertEqual(e.reduce_dtype, dpar.DType.F32)
            with self.assertRaises(dpar.DparError) as err:
                e.set_reduce_dtype(7)
            self.assertEqual(err.exception.status, dpar.Status.ERR_INVALID_ARGUMENT)
            self.assertIn("reduce_dtype", str(err.exception))
            self.assertEqual(e.reduce_dtype, dpar.DType.F32)
            e.set_reduce_dtype(dpar.DType.BF16)
            self.assertEqual(e.reduce_dtype, dpar.DType.BF16)
            x = np.array([((i * 37) % 101) / 101.0 - 0.5 for i in range(66)], dtype=np.float32).reshape(11, 6)
            y = np.array([r % 3 for r in range(11)], dtype=np.int32)
            for _ in range(3):
                self.assertTrue(math.isfinite(e.train_step(x, y)))
                plain.train_step(x, y)
            p0, p1 = e.params(0, elements), e.params(1, elements)
            self.assertEqual(p0.tobytes(), p1.tobytes(), "replicas differ")
            self.assertFalse(np.array_equal(p0, plain.params(0, elements)), "the bf16 rounding changed nothing")


if __name__ == "__main__":
    unittest.main()
