"""Moving statistics you can trust: non-finite batches are skipped, warm-up (TensorFlow)."""

import functools
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from tests import sync_fixtures

sync_fixtures.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_bn  # noqa: E402

STATISTICS = (
    "moving_mean",
    "moving_variance",
    "moving_batches",
    "moving_stddev",
    "renorm_mean",
    "renorm_stddev",
    "num_updates",
)


def _state(layer):
    return {n: np.array(getattr(layer, n)) for n in STATISTICS if getattr(layer, n) is not None}


def _batches(seed=0, n=3, shape=(8, 4, 3)):
    rng = np.random.RandomState(seed)
    return [(rng.randn(*shape) * 2 + 1).astype(np.float32) for _ in range(n)]


class NonFiniteTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("ema", {}),
        ("cumulative", {"momentum": None}),
        ("unbiased", {"unbiased_variance": True}),
        ("renorm", {"renorm": True, "renorm_clipping": {"rmax": 3.0}}),
        ("ghost", {"virtual_batch_size": 4}),
        ("warmup", {"momentum_warmup": True}),
        ("conv_axis_1", {"axis": 1}),
    )
    def test_nan_batch_leaves_statistics_unchanged(self, kwargs):
        layer = keras_bn.BatchNormalization(count_skipped_updates=True, **kwargs)
        good, other, _ = _batches()
        layer(good, training=True)
        before = _state(layer)
        bad = other.copy()
        bad[0, 0, 0] = np.nan
        y = layer(bad, training=True)
        self.assertFalse(np.all(np.isfinite(y)))  # The output is the batch's own.
        for name, value in _state(layer).items():
            np.testing.assert_array_equal(value, before[name], err_msg=name)
        self.assertEqual(float(layer.skipped_updates), 1.0)
        layer(other, training=True)  # A finite batch updates again.
        self.assertFalse(np.array_equal(np.array(layer.moving_mean), before["moving_mean"]))
        self.assertEqual(float(layer.skipped_updates), 1.0)

    def test_inf_under_a_mask_and_compiled(self):
        layer = keras_bn.BatchNormalization(count_skipped_updates=True)
        x = _batches(1)[0]
        mask = np.ones(x.shape[:-1], bool)
        layer(x, training=True, mask=mask)
        before = _state(layer)
        x[1, 2, 1] = np.inf
        step = tf.function(lambda x, m: layer(x, training=True, mask=m), jit_compile=True)
        step(tf.constant(x), tf.constant(mask))
        for name, value in _state(layer).items():
            np.testing.assert_array_equal(value, before[name], err_msg=name)
        self.assertEqual(float(layer.skipped_updates), 1.0)

    def test_turned_off_the_statistics_take_the_nan(self):
        layer = keras_bn.BatchNormalization(skip_nonfinite_updates=False)
        bad = _batches()[0]
        bad[0, 0, 0] = np.nan
        layer(bad, training=True)
        self.assertIsNone(layer.skipped_updates)
        self.assertTrue(np.isnan(np.array(layer.moving_mean)).any())

    def test_mixed_float16_overflow_with_fit(self):
        """A loss-scaled step that overflows: Keras' layer keeps NaN, keras_bn skips it."""
        rng = np.random.RandomState(0)
        x = rng.randn(96, 8).astype(np.float32)
        y = rng.randn(96, 1).astype(np.float32)
        x[32:64] *= 1e5  # The second batch of 32 overflows the float16 Dense output.
        results = {}
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            for name, norm in (
                ("keras", keras.layers.BatchNormalization),
                (
                    "keras_bn",
                    functools.partial(keras_bn.BatchNormalization, count_skipped_updates=True),
                ),
            ):
                keras.utils.set_random_seed(1)
                model = keras.Sequential(
                    [
                        keras.Input((8,)),
                        keras.layers.Dense(16),
                        norm(name="bn"),
                        keras.layers.Dense(1, dtype="float32"),
                    ]
                )
                model.compile(keras.optimizers.SGD(0.01), "mse")
                self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
                fit = {"batch_size": 32, "epochs": 1, "verbose": 0, "shuffle": False}
                model.fit(x[:32], y[:32], **fit)
                layer = model.get_layer("bn")
                before = [np.array(layer.moving_mean), np.array(layer.moving_variance)]
                model.fit(x[32:64], y[32:64], **fit)  # The overflowing batch.
                after_bad = [np.array(layer.moving_mean), np.array(layer.moving_variance)]
                model.fit(x[64:], y[64:], **fit)
                loss = model.evaluate(x[64:], y[64:], batch_size=32, verbose=0)
                results[name] = (layer, before, after_bad, loss)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        _, _, after_bad, loss = results["keras"]
        self.assertTrue(np.isnan(after_bad[0]).any())  # The reason for the guard.
        self.assertFalse(np.isfinite(loss))
        layer, before, after_bad, loss = results["keras_bn"]
        for b, a in zip(before, after_bad):
            np.testing.assert_array_equal(a, b)
        self.assertEqual(float(layer.skipped_updates), 1.0)
        self.assertTrue(np.isfinite(loss))
        self.assertTrue(np.all(np.isfinite(np.array(layer.moving_mean))))

    @parameterized.named_parameters(("two", 2), ("four", 4))
    def test_synchronized_replicas_all_skip(self, replicas):
        strategy = sync_fixtures.mirrored_cpu_strategy(replicas)
        with strategy.scope():
            layer = keras_bn.BatchNormalization(synchronized=True, count_skipped_updates=True)
            layer.build((None, 3))
        rng = np.random.RandomState(3)
        parts = [rng.randn(4, 3).astype(np.float32) for _ in range(replicas)]
        parts[-1][2, 1] = np.nan  # Only the last replica's slice is non-finite.
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group])
        )
        strategy.run(tf.function(lambda x: layer(x, training=True)), args=(values,))
        for name in ("moving_mean", "moving_variance", "skipped_updates"):
            copies = [
                np.array(v) for v in strategy.experimental_local_results(getattr(layer, name).value)
            ]
            expected = {"moving_mean": 0.0, "moving_variance": 1.0, "skipped_updates": 1.0}[name]
            for replica, copy in enumerate(copies):
                np.testing.assert_array_equal(
                    copy, np.full_like(copy, expected), err_msg=f"{name} {replica}"
                )


class WarmupTest(parameterized.TestCase):
    def test_moving_mean_follows_the_data_after_ten_steps(self):
        rng = np.random.RandomState(0)
        data_mean = np.array([5.0, -3.0, 10.0])
        errors = {}
        for warmup in (False, True):
            layer = keras_bn.BatchNormalization(momentum=0.99, momentum_warmup=warmup)
            for _ in range(10):
                layer((rng.randn(64, 3) + data_mean).astype(np.float32), training=True)
            errors[warmup] = np.max(np.abs(np.array(layer.moving_mean) / data_mean - 1.0))
        self.assertLess(errors[True], 0.05)
        self.assertGreater(errors[False], 0.85)  # 1 − 0.99¹⁰ ≈ 9.6% of the way.

    def test_rule_and_saved_step(self):
        layer = keras_bn.BatchNormalization(momentum=0.9, momentum_warmup=True)
        batches = _batches(2, n=4)
        expected = np.zeros(3)
        for t, x in enumerate(batches):
            layer(x, training=True)
            momentum = min(0.9, (1 + t) / (10 + t))
            expected = expected * momentum + x.mean((0, 1)) * (1 - momentum)
        np.testing.assert_allclose(np.array(layer.moving_mean), expected, rtol=1e-5, atol=1e-6)
        self.assertEqual(float(layer.num_updates), 4.0)
        model = keras.Sequential([keras.Input((4, 3)), layer])
        path = os.path.join(tempfile.mkdtemp(), "warm.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(float(loaded.layers[0].num_updates), 4.0)
        self.assertTrue(loaded.layers[0].momentum_warmup)


if __name__ == "__main__":
    absltest.main()
