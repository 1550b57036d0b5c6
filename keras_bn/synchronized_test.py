"""Synchronised moments under MirroredStrategy on logical CPU devices."""

import functools
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from keras_bn import testing

testing.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_bn import batch_normalization  # noqa: E402
from keras_bn import normalize  # noqa: E402

BatchNormalization = batch_normalization.BatchNormalization


@functools.lru_cache(maxsize=None)
def _strategy(num_replicas):
    """One strategy per replica count for the whole process.

    Collective all-reduce keys are process-global: a second collective
    strategy restarts at group key 1 and the runtime rejects it ("joining a
    group with size 4, but that group has size 2"). So the 4-replica strategy
    is the one using collective ops (CPU's default), and the 2-replica one
    reduces through one device, MirroredStrategy's other supported mode.
    """
    devices = [f"/cpu:{i}" for i in range(num_replicas)]
    if num_replicas == 4:
        return tf.distribute.MirroredStrategy(devices)
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def _per_replica(strategy, parts):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group])
    )


def _split(array, sizes):
    return np.split(array, np.cumsum(sizes)[:-1])


def _layer_step(layer):
    """Forward + gradients of sum(y * w) for one replica's part."""

    def step(x, w, m=None):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=m)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
        dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return y, dx, dgamma, dbeta

    return step


def _single_device(shape_kwargs, x, w, steps, mask=None, **kwargs):
    layer = BatchNormalization(**shape_kwargs, **kwargs)
    step = _layer_step(layer)
    for _ in range(steps):
        out = step(tf.constant(x), tf.constant(w), None if mask is None else tf.constant(mask))
    return layer, [o.numpy() for o in out]


def _mirrored(num_replicas, sizes, shape_kwargs, x, w, steps, mask=None, **kwargs):
    strategy = _strategy(num_replicas)
    with strategy.scope():
        layer = BatchNormalization(synchronized=True, **shape_kwargs, **kwargs)
        layer.build((None,) + x.shape[1:])
    step = tf.function(_layer_step(layer))
    args = [_per_replica(strategy, _split(x, sizes)), _per_replica(strategy, _split(w, sizes))]
    if mask is not None:
        args.append(_per_replica(strategy, _split(mask, sizes)))
    for _ in range(steps):
        y, dx, dgamma, dbeta = strategy.run(step, args=tuple(args))
    unwrap = strategy.experimental_local_results
    outputs = [
        np.concatenate([t.numpy() for t in unwrap(y)]),
        np.concatenate([t.numpy() for t in unwrap(dx)]),
        strategy.reduce("SUM", dgamma, axis=None).numpy(),
        strategy.reduce("SUM", dbeta, axis=None).numpy(),
    ]
    return strategy, layer, outputs


def _replica_copies(variable):
    """Each replica's copy of a sync-on-read moving statistic."""
    return [v.numpy() for v in variable.value.values]


def _data(shape, seed, loc=1.0, scale=2.0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(*shape) * scale + loc).astype(np.float32)
    w = rng.randn(*shape).astype(np.float32)
    return x, w


class MirroredTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("two_equal", 2, [8, 8], (16, 5), {}),
        ("four_equal", 4, [4, 4, 4, 4], (16, 5), {}),
        ("two_unequal", 2, [11, 5], (16, 5), {}),
        ("four_one_empty", 4, [6, 0, 7, 3], (16, 5), {}),
        ("conv_two", 2, [3, 5], (8, 4, 4, 3), {}),
        ("conv_channels_first_four", 4, [2, 2, 1, 3], (8, 3, 4, 5), {"axis": 1}),
    )
    def test_matches_single_device_on_global_batch(self, num_replicas, sizes, shape, shape_kwargs):
        x, w = _data(shape, sum(sizes) + num_replicas)
        for unbiased in (False, True):
            kwargs = dict(momentum=0.7, unbiased_variance=unbiased)
            reference, expected = _single_device(shape_kwargs, x, w, steps=2, **kwargs)
            _, layer, actual = _mirrored(num_replicas, sizes, shape_kwargs, x, w, steps=2, **kwargs)
            for name, a, e in zip(("y", "dx", "dgamma", "dbeta"), actual, expected):
                np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=name)
            for variable, ref in (
                (layer.moving_mean, reference.moving_mean),
                (layer.moving_variance, reference.moving_variance),
            ):
                copies = _replica_copies(variable)
                self.assertLen(copies, num_replicas)
                for copy in copies:
                    np.testing.assert_array_equal(copy, copies[0])
                np.testing.assert_allclose(copies[0], ref.numpy(), rtol=1e-5, atol=1e-6)

    def test_masked_and_mixed_precision(self):
        x, w = _data((4, 6, 3), 5)
        mask = np.random.RandomState(6).rand(4, 6) > 0.4
        _, expected = _single_device({}, x, w, steps=1, mask=mask)
        _, _, actual = _mirrored(2, [1, 3], {}, x, w, steps=1, mask=mask)
        for a, e in zip(actual, expected):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            _, layer, (y, *_) = _mirrored(2, [2, 2], {}, x, w, steps=1, momentum=0.0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertEqual(y.dtype, tf.bfloat16.as_numpy_dtype)
        x_low = tf.cast(tf.cast(x, tf.bfloat16), tf.float32).numpy().astype(np.float64)
        np.testing.assert_allclose(_replica_copies(layer.moving_mean)[1], x_low.mean((0, 1)), rtol=1e-5, atol=1e-6)

    def test_large_mean_variance_is_precise(self):
        rng = np.random.RandomState(7)
        x = (1e4 + rng.randn(64, 8)).astype(np.float32)
        w = np.zeros_like(x)
        _, layer, _ = _mirrored(2, [40, 24], {}, x, w, steps=1, momentum=0.0)
        expected = x.astype(np.float64).var(0)
        np.testing.assert_allclose(_replica_copies(layer.moving_variance)[0], expected, rtol=1e-3)

    def test_checkpoint_restores_moving_statistics(self):
        x, w = _data((8, 4), 8)
        strategy, layer, _ = _mirrored(2, [4, 4], {}, x, w, steps=2, momentum=0.5)
        path = tf.train.Checkpoint(layer=layer).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
        with strategy.scope():
            restored = BatchNormalization(synchronized=True, momentum=0.5)
            restored.build((None, 4))
        tf.train.Checkpoint(layer=restored).restore(path).assert_existing_objects_matched()
        for a, b in ((layer.moving_mean, restored.moving_mean), (layer.moving_variance, restored.moving_variance)):
            for copy in _replica_copies(b):
                np.testing.assert_array_equal(copy, _replica_copies(a)[0])

    def test_falls_back_to_local_moments_outside_replica_context(self):
        x, w = _data((8, 4), 9)
        _, expected = _single_device({}, x, w, steps=1)
        layer = BatchNormalization(synchronized=True)
        actual = _layer_step(layer)(tf.constant(x), tf.constant(w))
        for a, e in zip(actual, expected):
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
        with _strategy(2).scope():  # Cross-replica context: local moments.
            layer = BatchNormalization(synchronized=True)
            np.testing.assert_allclose(layer(x, training=True), expected[0], rtol=1e-6, atol=1e-6)

    def test_keras_fit_under_strategy(self):
        strategy = _strategy(2)
        x, _ = _data((8, 6, 6, 3), 10)
        y = np.random.RandomState(11).randint(0, 4, size=8)
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((6, 6, 3)),
                keras.layers.Conv2D(4, 3, use_bias=False),
                BatchNormalization(synchronized=True),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(4),
            ])
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        self.assertTrue(np.all(np.isfinite(history.history["loss"])))
        copies = _replica_copies(model.layers[1].moving_mean)
        np.testing.assert_array_equal(copies[0], copies[1])
        self.assertFalse(np.allclose(copies[0], 0.0))


class XlaTest(parameterized.TestCase):
    """The synchronised path compiled with XLA (static shapes, as on TPUs)."""

    @parameterized.named_parameters(("dense", (16, 5), (0,)), ("conv", (4, 5, 5, 3), (0, 1, 2)))
    def test_sync_path_compiles_and_matches_local(self, shape, axes):
        x, w = _data(shape, 12)
        gamma = tf.constant(np.random.RandomState(13).rand(*([1] * (len(shape) - 1) + [shape[-1]])) + 0.5, tf.float32)
        beta = tf.zeros_like(gamma)

        def run(context):
            @tf.function(jit_compile=True)
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch([x, gamma, beta])
                    y, mean, variance, count = normalize.normalize_with_batch_statistics(
                        x, gamma, beta, axes=axes, epsilon=1e-3, context=context
                    )
                    loss = tf.reduce_sum(y * w)
                return [y, mean, variance, count] + tape.gradient(loss, [x, gamma, beta])

            return [t.numpy() for t in step(tf.constant(x))]

        context = testing.LoneReplicaContext(num_replicas=4)
        synced = run(context)
        self.assertEqual(context.all_reduce_calls, 2)  # One forward, one backward.
        for a, b in zip(synced, run(None)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":
    absltest.main()
