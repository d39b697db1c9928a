"""Engine.set_reproducible: off by default, a negative count refused with dpar's message, and the same bits from
one device and from three."""
import math
import unittest

import numpy as np

import dpar


class ReproducibleTest(unittest.TestCase):
    def test_same_bits_on_one_and_three_devices(self):
        elements = 6 * 8 + 8 + 8 * 3 + 3
        with dpar.Model(seed=3).linear(6, 8).activation(dpar.RELU).linear(8, 3) as m, \
                dpar.Engine(m, optimizer=dpar.SGD, lr=0.1, devices=1, processes=dpar.PROCESSES_SINGLE) as one, \
                dpar.Engine(m, optimizer=dpar.SGD, lr=0.1, devices=3, processes=dpar.PROCESSES_SINGLE) as three:
            self.assertEqual(three.reproducible, 0)
            with self.assertRaises(dpar.DparError) as err:
                three.set_reproducible(-2)
            self.assertEqual(err.exception.status, dpar.Status.ERR_INVALID_ARGUMENT)
            self.assertIn("-2", str(err.exception))
            self.assertEqual(three.reproducible, 0)
            for e in (one, three):
                e.set_reproducible(2)
                self.assertEqual(e.reproducible, 2)
            x = np.array([((i * 37) % 101) / 101.0 - 0.5 for i in range(66)], dtype=np.float32).reshape(11, 6)
            y = np.array([r % 3 for r in range(11)], dtype=np.int32)
            for _ in range(3):
                loss = one.train_step(x, y)
                self.assertTrue(math.isfinite(loss))
                self.assertEqual(loss, three.train_step(x, y))
            self.assertEqual(one.params(0, elements).tobytes(), three.params(2, elements).tobytes())


if __name__ == "__main__":
    unittest.main()
