"""Engine.memory_stats and reset_peak_memory: what each replica's device holds after a step (at least its parameters
and gradients), a peak no lower, a reset peak at what is held, and a replica out of range refused with dpar's
message."""
import unittest

import numpy as np

import dpar


class MemoryStatsTest(unittest.TestCase):
    def test_each_replica_holds_its_parameters_and_the_peak_resets(self):
        elements = 6 * 8 + 8 + 8 * 3 + 3
        with dpar.Model(seed=3).linear(6, 8).activation(dpar.RELU).linear(8, 3) as m, \
                dpar.Engine(m, optimizer=dpar.SGD, lr=0.1, devices=2, processes=dpar.PROCESSES_SINGLE) as e:
            x = np.array([((i * 37) % 101) / 101.0 - 0.5 for i in range(66)], dtype=np.float32).reshape(11, 6)
            y = np.array([r % 3 for r in range(11)], dtype=np.int32)
            e.train_step(x, y)
            for r in range(2):
                allocated, peak = e.memory_stats(r)
                self.assertGreaterEqual(allocated, 2 * 4 * elements)
                self.assertGreaterEqual(peak, allocated)
                e.reset_peak_memory(r)
                allocated, peak = e.memory_stats(r)
                self.assertEqual(peak, allocated)
            for call in (lambda: e.memory_stats(2), lambda: e.reset_peak_memory(2)):
                with self.assertRaises(dpar.DparError) as err:
                    call()
                self.assertEqual(err.exception.status, dpar.Status.ERR_INVALID_ARGUMENT)
                self.assertIn("replica: 2", str(err.exception))


if __name__ == "__main__":
    unittest.main()
