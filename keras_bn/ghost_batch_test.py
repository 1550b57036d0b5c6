"""Ghost batches (`virtual_batch_size`) under TensorFlow: eager, tf.function, MirroredStrategy."""

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
from tests import references  # noqa: E402

EPSILON = 1e-3


def _data(shape, seed, loc=3.0, scale=2.0):
    rng = np.random.RandomState(seed)
    x = rng.randn(*shape) * scale + loc
    # Each group of 4 examples gets its own offset: ghost statistics differ.
    x += np.repeat(np.arange(shape[0] // 4), 4).reshape((-1,) + (1,) * (len(shape) - 1))
    return x.astype(np.float32)


def _layer(**kwargs):
    kwargs.setdefault("momentum", 0.0)
    return keras_bn.BatchNormalization(virtual_batch_size=4, epsilon=EPSILON, **kwargs)


def _step(layer, x, upstream, mask=None):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True, mask=mask)
        loss = tf.reduce_sum(y * upstream)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
    return y, dx, dgamma, dbeta


class GhostBatchTest(parameterized.TestCase):
    def _assert_matches(self, results, expected, channels):
        y, dx, dgamma, dbeta = (np.asarray(r, np.float64) for r in results)
        np.testing.assert_allclose(y.reshape(-1, channels), expected["y"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx.reshape(-1, channels), expected["dx"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dgamma, expected["dgamma"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dbeta, expected["dbeta"], rtol=1e-5, atol=1e-5)

    @parameterized.named_parameters(("dense", (16, 3)), ("conv_map", (8, 2, 3, 4)))
    def test_eager_matches_float64_reference(self, shape):
        x, upstream = _data(shape, 0), _data(shape, 1, 0.0, 1.0)
        layer = _layer()
        results = _step(layer, tf.constant(x), tf.constant(upstream))
        channels = shape[-1]
        # Consecutive rows of the flattened map: each ghost batch of 4
        # examples is 4·H·W rows.
        expected = references.reference_sliced_batch_norm(
            x.reshape(-1, channels),
            upstream.reshape(-1, channels),
            1.0,
            0.0,
            shape[0] // 4,
            EPSILON,
        )
        self._assert_matches(results, expected, channels)
        # Moving statistics move towards the ghost batches' mean moments.
        np.testing.assert_allclose(np.asarray(layer.moving_mean), expected["mean"], rtol=1e-5)
        np.testing.assert_allclose(
            np.asarray(layer.moving_variance), expected["variance"], rtol=1e-5
        )
        # Ghost batches differ from the whole batch (the check can fail).
        whole = references.reference_sliced_batch_norm(
            x.reshape(-1, channels), upstream.reshape(-1, channels), 1.0, 0.0, 1, EPSILON
        )
        self.assertGreater(np.abs(whole["y"] - expected["y"]).max(), 0.1)

    def test_tf_function_with_unknown_batch(self):
        x, upstream = _data((16, 3), 2), _data((16, 3), 3, 0.0, 1.0)
        layer = _layer()
        layer.build((None, 3))
        step = tf.function(
            lambda x, u: _step(layer, x, u),
            input_signature=[tf.TensorSpec((None, 3)), tf.TensorSpec((None, 3))],
        )
        expected = references.reference_sliced_batch_norm(x, upstream, 1.0, 0.0, 4, EPSILON)
        self._assert_matches(step(tf.constant(x), tf.constant(upstream)), expected, 3)
        # A batch the ghost size does not divide fails at run time, naming both.
        with self.assertRaisesRegex(
            tf.errors.InvalidArgumentError, r"virtual_batch_size=4 must divide[\s\S]*\b10\b"
        ):
            step(tf.constant(x[:10]), tf.constant(upstream[:10]))

    def test_mirrored_strategy_each_replica_its_own_ghost_batches(self):
        strategy = sync_fixtures.mirrored_cpu_strategy(2)
        x, upstream = _data((16, 3), 4), _data((16, 3), 5, 0.0, 1.0)
        with strategy.scope():
            layer = _layer()
            layer.build((None, 3))

        def parts(array):
            return strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(np.split(array, 2)[ctx.replica_id_in_sync_group])
            )

        results = strategy.run(
            tf.function(lambda x, u: _step(layer, x, u)), args=(parts(x), parts(upstream))
        )
        for replica in range(2):
            rows = slice(8 * replica, 8 * replica + 8)
            expected = references.reference_sliced_batch_norm(
                x[rows], upstream[rows], 1.0, 0.0, 2, EPSILON
            )
            local = [strategy.experimental_local_results(r)[replica] for r in results]
            self._assert_matches(local, expected, 3)
        # Each replica moved its own copy; a cross-replica read averages them:
        # the mean over all four ghost batches.
        expected = references.reference_sliced_batch_norm(x, upstream, 1.0, 0.0, 4, EPSILON)
        np.testing.assert_allclose(np.asarray(layer.moving_mean), expected["mean"], rtol=1e-5)
        np.testing.assert_allclose(
            np.asarray(layer.moving_variance), expected["variance"], rtol=1e-5
        )

    def test_masked_and_unbiased_moving_statistics_are_pooled(self):
        x = _data((8, 5, 2), 6)
        mask = np.ones((8, 5), bool)
        mask[0, 2:] = False  # Ghost batch 0 has 17 of its 20 values.
        mask[5:, :] = False
        mask[4, 1:] = False  # Ghost batch 1 has one value.
        layer = _layer(unbiased_variance=True)
        layer(tf.constant(x), training=True, mask=tf.constant(mask))
        sums, counts, m2s = [], [], []
        for ghost in range(2):
            values = x[4 * ghost : 4 * ghost + 4][mask[4 * ghost : 4 * ghost + 4]].astype(
                np.float64
            )
            counts.append(len(values))
            sums.append(values.sum(0))
            m2s.append(((values - values.mean(0)) ** 2).sum(0))
        np.testing.assert_allclose(
            np.asarray(layer.moving_mean), np.sum(sums, 0) / np.sum(counts), rtol=1e-5
        )
        # Pooled unbiased variance: Σ M2 / Σ (n − 1) over the ghost batches.
        np.testing.assert_allclose(
            np.asarray(layer.moving_variance), np.sum(m2s, 0) / (np.sum(counts) - 2), rtol=1e-5
        )

    def test_inference_takes_any_batch_and_ignores_ghost_batches(self):
        layer = _layer(momentum=0.5)
        x = _data((8, 3), 7)
        layer(tf.constant(x), training=True)
        mean, variance = np.asarray(layer.moving_mean), np.asarray(layer.moving_variance)
        y = np.asarray(layer(tf.constant(x[:3]), training=False))
        np.testing.assert_allclose(
            y, (x[:3] - mean) / np.sqrt(variance + EPSILON), rtol=1e-5, atol=1e-6
        )

    def test_config_and_keras_file_round_trip(self):
        model = keras.Sequential([keras.Input((3,)), _layer(momentum=0.5), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        x = _data((16, 3), 8)
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
        self.assertEqual(model.layers[0].get_config()["virtual_batch_size"], 4)
        path = os.path.join(tempfile.mkdtemp(), "ghost.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(loaded.layers[0].virtual_batch_size, 4)
        np.testing.assert_allclose(
            loaded.predict(x[:5], verbose=0), model.predict(x[:5], verbose=0), rtol=1e-6
        )
        # Training continues with ghost batches after the reload.
        loaded.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)

    @parameterized.named_parameters(
        ("string", TypeError, {"virtual_batch_size": "4"}, r"Received: virtual_batch_size='4'"),
        ("float", TypeError, {"virtual_batch_size": 4.0}, r"Received: virtual_batch_size=4.0"),
        ("bool", TypeError, {"virtual_batch_size": True}, r"Received: virtual_batch_size=True"),
        ("one", ValueError, {"virtual_batch_size": 1}, r"Received: virtual_batch_size=1"),
        (
            "sync_group_size",
            ValueError,
            {"virtual_batch_size": 4, "synchronized": True, "sync_group_size": 2},
            r"pass it or sync_group_size\. Received: virtual_batch_size=4, sync_group_size=2",
        ),
    )
    def test_rejects_in_init(self, error, kwargs, pattern):
        with self.assertRaisesRegex(error, pattern):
            keras_bn.BatchNormalization(**kwargs)

    def test_rejects_batch_axis_as_feature_axis(self):
        with self.assertRaisesRegex(ValueError, r"Received: virtual_batch_size=4, axis=\(0,\)"):
            keras_bn.BatchNormalization(axis=0, virtual_batch_size=4).build((8, 3))

    def test_rejects_a_batch_it_does_not_divide(self):
        with self.assertRaisesRegex(
            ValueError, r"virtual_batch_size=4 must divide each replica's batch of 6"
        ):
            _layer()(tf.constant(_data((8, 3), 9)[:6]), training=True)


if __name__ == "__main__":
    absltest.main()
