"""Moving statistics that follow gradient accumulation (`accumulation_steps=k`).

Runs on every backend (`.ci/run` runs it on each); `DataParallel` and
`tf.distribute` are tested in `jax_distribution_test.py` and
`synchronized_test.py`.
"""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn

K, M, C = 4, 8, 3  # Micro-batches per optimizer step, examples per micro-batch, features.


def _data(batches, seed=0):
    rng = np.random.RandomState(seed)
    # Every micro-batch its own offset: pooled and total variance differ.
    offsets = np.repeat(np.arange(batches) * 2.0, M)[:, None]
    return (rng.randn(batches * M, C) * 1.5 + offsets).astype(np.float32)


def _numpy(variable):
    return np.asarray(keras.ops.convert_to_numpy(variable), np.float64)


def _pooled(x, slice_size):
    """The mean of the slices' means and of their biased variances, in float64."""
    slices = np.asarray(x, np.float64).reshape(-1, slice_size, x.shape[-1])
    return slices.mean(1).mean(0), slices.var(1).mean(0)


class ValidationTest(absltest.TestCase):
    def test_non_int_is_refused(self):
        with self.assertRaisesRegex(TypeError, r"Received: accumulation_steps=2\.0"):
            keras_bn.BatchNormalization(accumulation_steps=2.0)

    def test_one_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"pass None\)\. Received: accumulation_steps=1"):
            keras_bn.BatchNormalization(accumulation_steps=1)

    def test_frozen_statistics_are_refused(self):
        with self.assertRaisesRegex(
            ValueError, r"Received: accumulation_steps=4, statistics='moving'"
        ):
            keras_bn.BatchNormalization(accumulation_steps=4, statistics="moving")


class MicroBatchTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("momentum", {"momentum": 0.9}),
        ("cumulative", {"momentum": None}),
        ("unbiased", {"momentum": 0.9, "unbiased_variance": True}),
        ("warmup", {"momentum": 0.9, "momentum_warmup": True}),
        ("renorm", {"momentum": 0.9, "renorm": True}),
    )
    def test_k_micro_batches_equal_one_batch_of_k_ghost_batches(self, kwargs):
        """k micro-batches of m give the statistics of one k·m batch in ghost batches of m."""
        x = _data(2 * K)
        accumulated = keras_bn.BatchNormalization(accumulation_steps=K, **kwargs)
        ghost = keras_bn.BatchNormalization(virtual_batch_size=M, **kwargs)
        for step in range(2):  # Two optimizer steps.
            for micro in range(K):
                start = (step * K + micro) * M
                accumulated(x[start : start + M], training=True)
            ghost(x[step * K * M : (step + 1) * K * M], training=True)
        for name in ("moving_mean", "moving_variance"):
            np.testing.assert_allclose(
                _numpy(getattr(accumulated, name)),
                _numpy(getattr(ghost, name)),
                rtol=1e-5,
                atol=1e-6,
                err_msg=name,
            )
        if kwargs["momentum"] is None:
            self.assertEqual(float(_numpy(accumulated.moving_batches)), 2.0)

    def test_statistics_stay_until_the_kth_micro_batch(self):
        x = _data(K)
        layer = keras_bn.BatchNormalization(accumulation_steps=K, momentum=0.0)
        for micro in range(K - 1):
            layer(x[micro * M : (micro + 1) * M], training=True)
            np.testing.assert_array_equal(_numpy(layer.moving_mean), np.zeros(C))
            self.assertEqual(float(_numpy(layer.accumulated_steps)), micro + 1)
        layer(x[(K - 1) * M :], training=True)
        mean, variance = _pooled(x, M)
        np.testing.assert_allclose(_numpy(layer.moving_mean), mean, rtol=1e-5)
        np.testing.assert_allclose(_numpy(layer.moving_variance), variance, rtol=1e-5)
        # The moving mean is the k·m batch's; the variance leaves out the spread of the means.
        np.testing.assert_allclose(_numpy(layer.moving_mean), x.mean(0), rtol=1e-5)
        self.assertTrue(np.all(_numpy(layer.moving_variance) < x.var(0)))
        for name in ("accumulated_steps", "accumulated_count", "accumulated_mean"):
            self.assertFalse(np.any(_numpy(getattr(layer, name))), name)

    def test_a_micro_batch_of_one_example_adds_nothing(self):
        x = _data(K)
        layer = keras_bn.BatchNormalization(accumulation_steps=K, momentum=0.0)
        for micro in range(K - 1):
            layer(x[micro * M : (micro + 1) * M], training=True)
        layer(x[-1:], training=True)  # The k-th holds one example: no spread.
        mean, variance = _pooled(x[: (K - 1) * M], M)
        np.testing.assert_allclose(_numpy(layer.moving_mean), mean, rtol=1e-5)
        np.testing.assert_allclose(_numpy(layer.moving_variance), variance, rtol=1e-5)

    def test_a_non_finite_micro_batch_skips_its_update_only(self):
        x = _data(2 * K)
        x[M + 1, 0] = np.nan  # In the second micro-batch of the first step.
        layer = keras_bn.BatchNormalization(
            accumulation_steps=K, momentum=0.0, count_skipped_updates=True
        )
        for micro in range(K):
            layer(x[micro * M : (micro + 1) * M], training=True)
        np.testing.assert_array_equal(_numpy(layer.moving_mean), np.zeros(C))
        self.assertEqual(float(_numpy(layer.skipped_updates)), 1.0)
        for micro in range(K, 2 * K):
            layer(x[micro * M : (micro + 1) * M], training=True)
        mean, _ = _pooled(x[K * M :], M)
        np.testing.assert_allclose(_numpy(layer.moving_mean), mean, rtol=1e-5)

    @parameterized.parameters(1, 4)
    def test_fit_with_the_optimizers_accumulation(self, steps_per_execution):
        """`fit` with `gradient_accumulation_steps=k`: one update per optimizer step."""
        if steps_per_execution > 1 and keras.backend.backend() == "torch":
            self.skipTest("Keras 3.15's PyTorch trainer takes steps_per_execution=1 only")
        x = _data(2 * K, seed=1)
        model = keras.Sequential(
            [
                keras.Input((C,)),
                keras_bn.BatchNormalization(accumulation_steps=K, momentum=None, name="bn"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=K),
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
        model.fit(x, np.zeros((len(x), 1)), batch_size=M, shuffle=False, verbose=0)
        bn = model.get_layer("bn")
        self.assertEqual(float(_numpy(bn.moving_batches)), 2.0)  # 8 without accumulation.
        mean, variance = _pooled(x, M)  # Two equal merges, averaged.
        np.testing.assert_allclose(_numpy(bn.moving_mean), mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_numpy(bn.moving_variance), variance, rtol=1e-5)

    def test_weight_files_keep_the_accumulation_by_name(self):
        x = _data(K)
        model = keras.Sequential(
            [keras.Input((C,)), keras_bn.BatchNormalization(accumulation_steps=K, name="bn")]
        )
        model(x[:M], training=True)  # One micro-batch accumulated.
        path = os.path.join(tempfile.mkdtemp(), "model.weights.h5")
        model.save_weights(path)
        fresh = keras.Sequential(
            [keras.Input((C,)), keras_bn.BatchNormalization(accumulation_steps=K, name="bn")]
        )
        fresh.load_weights(path)
        for ours, theirs in zip(fresh.get_layer("bn").weights, model.get_layer("bn").weights):
            np.testing.assert_array_equal(_numpy(ours), _numpy(theirs), err_msg=ours.name)
        keras_layer = keras.Sequential([keras.Input((C,)), keras.layers.BatchNormalization()])
        keras_path = os.path.join(tempfile.mkdtemp(), "keras.weights.h5")
        keras_layer.save_weights(keras_path)
        fresh.load_weights(keras_path)  # Ours reads Keras' file: nothing accumulated.
        self.assertEqual(float(_numpy(fresh.get_layer("bn").accumulated_steps)), 0.0)

    def test_config_round_trip(self):
        layer = keras_bn.BatchNormalization(accumulation_steps=K)
        config = layer.get_config()
        self.assertEqual(keras_bn.BatchNormalization.from_config(config).accumulation_steps, K)
        self.assertIsNone(keras_bn.BatchNormalization().get_config()["accumulation_steps"])
        # The default layer keeps Keras' four weights.
        default = keras_bn.BatchNormalization()
        default.build((None, C))
        self.assertLen(default.weights, 4)


if __name__ == "__main__":
    absltest.main()
