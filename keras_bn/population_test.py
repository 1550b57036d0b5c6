"""Tests of keras_bn.estimate_population_statistics.

Several replicas pool their batches (one process's estimate over the same
batches): tested here under a `tf.distribute.MirroredStrategy` of logical
CPUs (TensorFlow) and `keras.distribution.DataParallel` over 8 host devices
(JAX); ranks of `torch.distributed` in keras_bn/torch_distributed_test.py.
"""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

import keras_bn
from tests import sync_fixtures

BACKEND = keras.backend.backend()
REPLICAS = 4


def _model(unbiased):
    return keras.Sequential(
        [
            keras.Input((4, 4, 2)),
            keras_bn.BatchNormalization(unbiased_variance=unbiased, name="bn_in"),
            keras.layers.Conv2D(3, 1, use_bias=False, name="conv"),
            keras_bn.BatchNormalization(momentum=None, unbiased_variance=unbiased, name="bn_conv"),
        ]
    )


class PopulationTest(parameterized.TestCase):
    @parameterized.named_parameters(("biased", False), ("unbiased", True))
    def test_count_weighted_average_of_batch_statistics(self, unbiased):
        keras.utils.set_random_seed(1)
        model = _model(unbiased)
        rng = np.random.RandomState(0)
        data = (rng.randn(20, 4, 4, 2) * 3 + 2).astype(np.float32)
        # Batches of 8, 8 and 4: the last one weighs half as much.
        dataset = tf.data.Dataset.from_tensor_slices((data, np.zeros(20))).batch(8)
        trainable_before = [w.numpy() for w in model.trainable_weights]
        estimates = keras_bn.estimate_population_statistics(model, dataset, num_batches=10)

        kernel = model.get_layer("conv").kernel.numpy().astype(np.float64)
        sums = {"bn_in": [0, 0, 0], "bn_conv": [0, 0, 0]}
        for start in (0, 8, 16):
            x = data[start : start + 8].astype(np.float64)
            for name in ("bn_in", "bn_conv"):
                mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
                m = x.shape[0] * 16
                if unbiased:
                    var = var * m / (m - 1)
                sums[name][0] += m
                sums[name][1] = sums[name][1] + m * mean
                sums[name][2] = sums[name][2] + m * var
                if name == "bn_in":
                    x = (x - x.mean((0, 1, 2))) / np.sqrt(x.var((0, 1, 2)) + 1e-3)
                    x = np.einsum("nhwc,cd->nhwd", x, kernel[0, 0])
        for name in ("bn_in", "bn_conv"):
            layer = model.get_layer(name)
            count, mean_sum, var_sum = sums[name]
            np.testing.assert_allclose(layer.moving_mean, mean_sum / count, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(layer.moving_variance, var_sum / count, rtol=1e-5)
            np.testing.assert_array_equal(estimates[layer.path][0], layer.moving_mean.numpy())
        self.assertEqual(float(model.get_layer("bn_conv").moving_batches), 3.0)
        for before, after in zip(trainable_before, model.trainable_weights):
            np.testing.assert_array_equal(before, after)

    def test_num_batches_limits_the_passes(self):
        model = _model(False)
        data = np.random.RandomState(1).randn(16, 4, 4, 2).astype(np.float32)
        dataset = tf.data.Dataset.from_tensor_slices(data).batch(4)
        keras_bn.estimate_population_statistics(model, dataset, num_batches=1)
        np.testing.assert_allclose(
            model.get_layer("bn_in").moving_mean, data[:4].mean((0, 1, 2)), rtol=1e-5, atol=1e-6
        )

    def test_a_batch_of_one_example_counts_where_the_layer_moves(self):
        # A conv map of one example holds 16 values per channel: the layer
        # moves, and the batch weighs 1 of 5 examples. A dense input of one
        # example holds one value per feature: the layer does not move, and
        # the batch is left out.
        rng = np.random.RandomState(2)
        maps = [(rng.randn(n, 4, 4, 2) * 3 + 2).astype(np.float32) for n in (4, 1)]
        conv = keras.Sequential([keras.Input((4, 4, 2)), keras_bn.BatchNormalization()])
        keras_bn.estimate_population_statistics(conv, maps, num_batches=2)
        want = (4 * maps[0].mean((0, 1, 2)) + maps[1].mean((0, 1, 2))) / 5
        np.testing.assert_allclose(conv.layers[0].moving_mean, want, rtol=1e-5)
        rows = [(rng.randn(n, 3) + 5).astype(np.float32) for n in (4, 1)]
        dense = keras.Sequential([keras.Input((3,)), keras_bn.BatchNormalization(momentum=None)])
        keras_bn.estimate_population_statistics(dense, rows, num_batches=2)
        layer = dense.layers[0]
        np.testing.assert_allclose(layer.moving_mean, rows[0].mean(0), rtol=1e-5)
        np.testing.assert_allclose(layer.moving_variance, rows[0].var(0), rtol=1e-5)
        self.assertEqual(float(layer.moving_batches), 1.0)

    def test_accumulating_layers_estimate_every_batch_and_frozen_ones_stay(self):
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras_bn.BatchNormalization(accumulation_steps=4, name="accumulating"),
                keras_bn.BatchNormalization(
                    statistics="moving",
                    moving_mean_initializer=keras.initializers.Constant(5.0),
                    name="frozen",
                ),
            ]
        )
        data = (np.random.RandomState(2).randn(16, 3) * 2 + 1).astype(np.float32)
        model(data[:8], training=True)  # Leaves one micro-batch accumulated.
        before = [w.numpy() for w in model.get_layer("frozen").weights]
        accumulated = model.get_layer("accumulating").accumulated_mean.numpy()
        estimates = keras_bn.estimate_population_statistics(
            model, [data[:8], data[8:]], num_batches=2
        )
        layer = model.get_layer("accumulating")
        batches = data.astype(np.float64).reshape(2, 8, 3)
        np.testing.assert_allclose(layer.moving_mean.numpy(), batches.mean(1).mean(0), rtol=1e-5)
        np.testing.assert_allclose(layer.moving_variance.numpy(), batches.var(1).mean(0), rtol=1e-5)
        np.testing.assert_array_equal(layer.accumulated_mean.numpy(), accumulated)
        self.assertNotIn(model.get_layer("frozen").path, estimates)
        for a, b in zip(model.get_layer("frozen").weights, before):
            np.testing.assert_array_equal(a.numpy(), b)

    @parameterized.named_parameters(("local", False), ("synchronized", True))
    def test_replicas_pool_their_batches_as_one_process_would(self, synchronized):
        if BACKEND == "torch":
            self.skipTest("ranks of torch.distributed: keras_bn/torch_distributed_test.py")
        rng = np.random.RandomState(4)
        # Three global batches of 8 rows, 2 per replica: each replica's rows its own batch.
        data = (rng.randn(3, 8, 2, 2, 3) * np.array([1.0, 2.0, 3.0]) + 4.0).astype(np.float32)

        def model():
            keras.utils.set_random_seed(5)
            layer = keras_bn.BatchNormalization(synchronized=synchronized, momentum=None)
            return keras.Sequential([keras.Input((2, 2, 3)), layer]), layer

        # One process, no replicas: the replicas' batches (the global ones when synchronised).
        single, single_layer = model()
        batches = list(data) if synchronized else list(data.reshape(12, 2, 2, 2, 3))
        keras_bn.estimate_population_statistics(single, batches, num_batches=len(batches))
        if BACKEND == "tensorflow":
            strategy = sync_fixtures.mirrored_cpu_strategy(REPLICAS)
            with strategy.scope():
                replicated, layer = model()
                dataset = tf.data.Dataset.from_tensor_slices(data.reshape(24, 2, 2, 3)).batch(8)
                keras_bn.estimate_population_statistics(replicated, dataset, num_batches=3)
            # Every replica holds the estimate: each replica's copy, not their mean on read.
            copies = strategy.experimental_local_results(layer.moving_mean.value)
        else:
            import jax

            distribution = keras.distribution.DataParallel(devices=jax.devices()[:REPLICAS])
            with distribution.scope():
                replicated, layer = model()
                keras_bn.estimate_population_statistics(replicated, list(data), num_batches=3)
            copies = [layer.moving_mean.value]
        for copy in copies:
            np.testing.assert_allclose(copy, single_layer.moving_mean.numpy(), rtol=1e-6)
        np.testing.assert_allclose(
            layer.moving_variance.numpy(), single_layer.moving_variance.numpy(), rtol=1e-6
        )
        # The global batches read, each replica's count of its own batches.
        self.assertEqual(float(layer.moving_batches.numpy()), 3.0)

    def test_rejects_bad_num_batches(self):
        with self.assertRaisesRegex(ValueError, r"positive int. Received: num_batches=0"):
            keras_bn.estimate_population_statistics(_model(False), [], num_batches=0)

    def test_rejects_model_without_layers(self):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        with self.assertRaisesRegex(
            ValueError,
            r"BatchNormalization layer whose statistics move.*Received: model=",
        ):
            keras_bn.estimate_population_statistics(model, [np.ones((2, 3))], num_batches=1)

    def test_rejects_empty_dataset(self):
        with self.assertRaisesRegex(ValueError, r"no batch"):
            keras_bn.estimate_population_statistics(_model(False), [], num_batches=2)


if __name__ == "__main__":
    absltest.main()
