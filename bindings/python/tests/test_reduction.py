"""Engine.set_gradient_reduction: the engine's trace shows its buckets reduce-scattered (ZeRO-2), and without
clipping it trains to the bits of the all-reduce, over several buckets split unevenly between 2 CPU devices, switching
between steps included; an unknown reduction is refused with dpar's message."""
import enum
import os
import tempfile
import unittest

import numpy as np

import dpar


def model():
    return dpar.Model(seed=11).linear(6, 16).activation(dpar.RELU).linear(16, 8).activation(dpar.RELU).linear(8, 3)


def batch(step):
    """Batch `step` of 11 rows (6 and 5 per replica)."""
    x = np.array([(((i + 7 * step) * 37) % 101) / 101.0 - 0.5 for i in range(66)], dtype=np.float32).reshape(11, 6)
    y = np.array([(r + step) % 3 for r in range(11)], dtype=np.int32)
    return x, y


def engine(m):
    # 128-byte buckets: 32 gradients each, several buckets, most of them not a multiple of 2.
    return dpar.Engine(m, optimizer=dpar.ADAM, lr=0.01, devices=2, processes=dpar.PROCESSES_SINGLE,
                       first_bucket_bytes=128, bucket_cap_bytes=128)


def traced_step(e, x, y):
    """One training step, traced: its loss and the trace's text."""
    e.trace_start()
    loss = e.train_step(x, y)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        e.trace_stop(path)
        with open(path) as f:
            return loss, f.read()


class Reduction(unittest.TestCase):
    def test_the_enum_has_dpar_hs_values(self):
        self.assertTrue(issubclass(dpar.Reduction, enum.IntEnum))
        self.assertEqual((dpar.REDUCTION_ALL_REDUCE, dpar.REDUCTION_REDUCE_SCATTER, dpar.REDUCTION_ALL_REDUCE_SHARDED),
                         (0, 1, 2))
        self.assertIs(dpar.REDUCTION_REDUCE_SCATTER, dpar.Reduction.REDUCE_SCATTER)
        self.assertIs(dpar.REDUCTION_ALL_REDUCE_SHARDED, dpar.Reduction.ALL_REDUCE_SHARDED)

    def test_reduce_scatter_trains_to_the_bits_of_the_all_reduce(self):
        with model() as m, engine(m) as all_reduce, engine(m) as scatter:
            n = m.num_param_elements
            scatter.set_gradient_reduction(dpar.REDUCTION_REDUCE_SCATTER)
            all_reduce.set_gradient_reduction(dpar.Reduction.ALL_REDUCE)  # the default, set again
            self.assertGreater(scatter.num_buckets, 2)
            initial = all_reduce.params(0, n)
            for step in range(6):
                if step == 3:  # one process: the same shards
                    scatter.set_gradient_reduction(dpar.REDUCTION_ALL_REDUCE_SHARDED)
                if step == 4:  # switching between steps
                    scatter.set_gradient_reduction(dpar.REDUCTION_ALL_REDUCE)
                if step == 5:
                    scatter.set_gradient_reduction(dpar.REDUCTION_REDUCE_SCATTER)
                x, y = batch(step)
                if step == 0:
                    # The setting reached dpar: its buckets are reduce-scattered, the other engine's all-reduced.
                    (la, trace_all), (ls, trace_scatter) = traced_step(all_reduce, x, y), traced_step(scatter, x, y)
                    self.assertIn('"bucket reduce-scatter"', trace_scatter)
                    self.assertNotIn('"bucket all-reduce"', trace_scatter)
                    self.assertIn('"bucket all-reduce"', trace_all)
                    self.assertNotIn('"bucket reduce-scatter"', trace_all)
                else:
                    la, ls = all_reduce.train_step(x, y), scatter.train_step(x, y)
                la, ls = np.float32(la), np.float32(ls)
                self.assertEqual(la.view(np.uint32), ls.view(np.uint32), f"step {step}: {la} against {ls}")
            first = all_reduce.params(0, n)
            self.assertFalse(np.array_equal(first, initial), "training moved nothing")
            for replica in range(2):
                for e in (all_reduce, scatter):
                    np.testing.assert_array_equal(e.params(replica, n).view(np.uint32), first.view(np.uint32),
                                                  f"replica {replica}")

    def test_an_unknown_reduction_is_refused(self):
        with model() as m, engine(m) as e:
            for bad in (3, -1):
                with self.assertRaises(dpar.DparError) as cm:
                    e.set_gradient_reduction(bad)
                self.assertEqual(cm.exception.status, dpar.ERR_INVALID_ARGUMENT)
                self.assertIn("reduction", cm.exception.message)
            e.set_gradient_reduction(dpar.REDUCTION_REDUCE_SCATTER)


class WeightDecayExclusion(unittest.TestCase):
    def test_biases_and_norms_step_without_decay_and_weights_as_before(self):
        with dpar.Model(seed=7).linear(6, 3).batchnorm1d(3) as bn:
            self.assertEqual([bn.param_decays(i) for i in range(4)], [True, False, False, False])
            with self.assertRaises(dpar.DparError) as cm:
                bn.param_decays(4)
            self.assertIn("index", cm.exception.message)
        kw = dict(optimizer=dpar.ADAMW, lr=0.1, weight_decay=0.5, devices=2, processes=dpar.PROCESSES_SINGLE)
        with dpar.Model(seed=7).linear(6, 3) as m, dpar.Engine(m, **kw) as plain, dpar.Engine(m, **kw) as excluding:
            excluding.set_weight_decay_exclusion(True)
            with self.assertRaises(dpar.DparError) as cm:
                excluding.set_weight_decay_exclusion(2)
            self.assertIn("exclude_biases_and_norms", cm.exception.message)
            x, y = batch(0)
            plain.train_step(x, y)
            excluding.train_step(x, y)
            a, b = plain.params(0, 21), excluding.params(0, 21)
            np.testing.assert_array_equal(a[:18].view(np.uint32), b[:18].view(np.uint32))
            self.assertTrue(np.all(a[18:] != b[18:]), "the bias stepped as with decay")

    def test_loss_scaling_by_a_power_of_two_trains_as_none_and_an_overflow_skips_the_step(self):
        kw = dict(optimizer=dpar.ADAM, lr=0.01, devices=2, processes=dpar.PROCESSES_SINGLE)
        with dpar.Model(seed=7).linear(6, 3) as m, dpar.Engine(m, **kw) as plain, dpar.Engine(m, **kw) as scaled:
            self.assertEqual(scaled.loss_scale, 1.0)
            with self.assertRaises(dpar.DparError) as cm:
                scaled.set_loss_scaling(1024.0, backoff_factor=1.5)
            self.assertIn("backoff_factor", cm.exception.message)
            scaled.set_loss_scaling(1024.0, growth_interval=2)
            for step in range(2):
                x, y = batch(step)
                self.assertEqual(plain.train_step(x, y), scaled.train_step(x, y))
                self.assertFalse(scaled.last_step_skipped)
            np.testing.assert_array_equal(plain.params(0, 21).view(np.uint32), scaled.params(0, 21).view(np.uint32))
            self.assertEqual(scaled.loss_scale, 2048.0)
            x, y = batch(0)
            x[0, 0] = np.nan
            before = scaled.params(0, 21)
            scaled.train_step(x, y)
            self.assertTrue(scaled.last_step_skipped)
            self.assertEqual(scaled.loss_scale, 1024.0)
            self.assertEqual(scaled.step_count, 2)
            np.testing.assert_array_equal(before.view(np.uint32), scaled.params(0, 21).view(np.uint32))


if __name__ == "__main__":
    unittest.main()
