"""Model.conv2d, max_pool2d, avg_pool2d and adaptive_avg_pool2d reach dpar: names and shapes as PyTorch's, ints or
pairs as PyTorch takes them, refusals with dpar's message, and a small CNN trained on (B, 1, 8, 8) inputs over 2 CPU
devices to the parameters of one device."""
import unittest

import numpy as np

import dpar


def cnn():
    return (dpar.Model(seed=5)
            .conv2d(1, 4, 3, padding=1)
            .activation(dpar.RELU)
            .max_pool2d(2)
            .conv2d(4, 4, (3, 3), stride=(2, 2), padding=2, dilation=2, groups=2, bias=False)
            .avg_pool2d(2, stride=1, padding=1)
            .adaptive_avg_pool2d(1))


class Conv(unittest.TestCase):
    def test_layers_are_pytorchs_and_refusals_say_why(self):
        m = cnn()
        self.assertEqual(m.num_layers, 6)
        self.assertEqual(m.param_info(0), ("0.weight", (4, 1, 3, 3)))
        self.assertEqual(m.param_info(1), ("0.bias", (4,)))
        self.assertEqual(m.param_info(2), ("3.weight", (4, 2, 3, 3)))
        with self.assertRaises(dpar.DparError) as c:
            m.conv2d(4, 6, 3, groups=4)
        self.assertEqual(c.exception.status, dpar.ERR_INVALID_ARGUMENT)
        self.assertIn("divisible by groups", c.exception.message)
        with self.assertRaises(dpar.DparError) as c:
            m.max_pool2d(2, stride=(0, 1))
        self.assertIn("stride[0]", c.exception.message)
        with self.assertRaises(dpar.DparError) as c:
            m.adaptive_avg_pool2d((2, 2))
        self.assertEqual(c.exception.status, dpar.ERR_NOT_SUPPORTED)
        self.assertIn("only 1x1", c.exception.message)
        with self.assertRaises(dpar.DparError):
            m.conv2d(4, 4, (3, 3, 3))
        self.assertEqual(m.num_layers, 6)

    def test_a_cnn_on_two_devices_trains_as_on_one(self):
        m = cnn()
        x = np.array([((i * 37) % 101) / 101.0 - 0.5 for i in range(5 * 64)], dtype=np.float32).reshape(5, 1, 8, 8)
        y = np.array([((i * 13) % 7) / 7.0 - 0.5 for i in range(5 * 4)], dtype=np.float32).reshape(5, 4, 1, 1)
        finals = []
        for devices in (1, 2):
            e = dpar.Engine(m, lr=0.5, devices=devices, loss=dpar.LOSS_MSE, processes=dpar.PROCESSES_SINGLE)
            first = e.train_step(x, y)
            for _ in range(10):
                last = e.train_step(x, y)
            self.assertLess(last, first)
            finals.append(np.asarray(e.params(0, m.num_param_elements)))
            e.close()
        np.testing.assert_allclose(finals[1], finals[0], rtol=1e-5, atol=1e-7)


if __name__ == "__main__":
    unittest.main()
