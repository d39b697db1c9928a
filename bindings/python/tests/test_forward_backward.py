"""DataParallel's own path, Engine.forward, backward and step, with every kind of input train_step takes (NumPy
arrays, strided ones, lists, float64, Tensors): the gradient of the mean squared error computed in NumPy from
forward's output, backward, then step, trains over 2 CPU devices as train_step with the MSE loss does on an identical
engine. Before, backward(array) always failed: the tensor wrapping the array was freed before dpar read it.

A refused forward leaves the engine's views of the input before it for backward: that input stays alive, even when
nothing but the engine refers to it (before, it was let go and backward read memory handed out again)."""
import gc
import unittest

import numpy as np

import dpar

STEPS = 3


def mse_model():
    return dpar.Model(seed=5).linear(4, 8).activation(dpar.TANH).linear(8, 3)


def mse_batch():
    """9 rows: 5 and 4 per replica."""
    rng = np.random.default_rng(11)
    return rng.uniform(-1, 1, (9, 4)).astype(np.float32), rng.uniform(-1, 1, (9, 3)).astype(np.float32)


def mse_engine(model):
    return dpar.Engine(model, lr=0.1, momentum=0.9, devices=2, loss=dpar.LOSS_MSE, seed=3,
                       processes=dpar.PROCESSES_SINGLE)


def mse_grad(out, y):
    """d/d(out) of mean((out - y)**2) over every element, as PyTorch's mse_loss backward: 2 (out - y) / numel."""
    return (out - y) * np.float32(2.0 / out.size)


def strided(a):
    """A view of a's values that is not C-contiguous."""
    return np.repeat(a, 2, axis=1)[:, ::2]


# How each kind of input is made from the float32 arrays: (name, input of forward, gradient given to backward).
WAYS = [("float32 arrays", lambda x: x, lambda g: g),
        ("Tensors", dpar.Tensor.from_numpy, dpar.Tensor.from_numpy),
        ("lists and float64 arrays", lambda x: x.tolist(), lambda g: g.astype(np.float64)),
        ("strided arrays", np.asfortranarray, strided)]


class ForwardBackwardStep(unittest.TestCase):
    def test_trains_as_train_step_with_the_mse_loss_for_every_kind_of_input(self):
        x, y = mse_batch()
        for name, as_input, as_grad in WAYS:
            with self.subTest(name), mse_model() as m, mse_engine(m) as e, mse_engine(m) as reference:
                n = m.num_param_elements
                initial = e.params(0, n)
                for step in range(STEPS):
                    expected_loss = reference.train_step(x, y)
                    out = e.forward(as_input(x)).numpy()
                    self.assertEqual(out.shape, y.shape)
                    loss = float(np.mean((out.astype(np.float64) - y) ** 2))
                    self.assertAlmostEqual(loss, expected_loss, delta=1e-5 * expected_loss, msg=f"step {step}")
                    grad = mse_grad(out, y)
                    given = as_grad(grad)
                    e.backward(given)
                    if isinstance(given, np.ndarray):
                        np.testing.assert_array_equal(given, grad)  # read, never written
                    e.step()
                self.assertEqual(e.step_count, STEPS)
                p = e.params(0, n)
                # The gradient crosses the ABI rounded to float32 either way; dpar's and NumPy's 2/numel may differ
                # in the last bit, so the parameters agree within float rounding.
                np.testing.assert_allclose(p, reference.params(0, n), rtol=1e-5, atol=1e-6)
                self.assertGreater(np.max(np.abs(p - initial)), 1e-2)  # it trained
                np.testing.assert_array_equal(e.params(1, n), p)  # the replicas stay identical

    def test_backward_refuses_a_gradient_of_the_wrong_shape_with_dpars_message(self):
        x, y = mse_batch()
        with mse_model() as m, mse_engine(m) as e:
            out = e.forward(x).numpy()
            with self.assertRaisesRegex(dpar.DparError, r"grad_output \(9, 2\) must be shaped as forward's output"):
                e.backward(np.zeros((9, 2), np.float32))
            e.backward(mse_grad(out, y))  # the refused backward kept the forward
            e.step()
            self.assertEqual(e.step_count, 1)

    def test_a_refused_forward_keeps_the_input_before_it_alive_for_backward(self):
        x, y = mse_batch()
        grad = np.full(y.shape, 0.25, np.float32)
        with mse_model() as m, mse_engine(m) as e, mse_engine(m) as reference:
            reference.forward(x)
            reference.backward(grad)
            reference.step()

            e.forward(x.tolist())  # converted: the engine's is the only reference to the array
            with self.assertRaisesRegex(dpar.DparError, "does not fit the model"):
                e.forward(np.zeros((9, 5), np.float32))
            gc.collect()
            churn = [np.full(x.shape, 1e6, np.float32) for _ in range(32)]  # reuses the array's memory if freed
            e.backward(grad)
            e.step()
            n = m.num_param_elements
            np.testing.assert_array_equal(e.params(0, n), reference.params(0, n))
            del churn


if __name__ == "__main__":
    unittest.main()
