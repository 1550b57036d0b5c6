"""Tests of keras_bn.BatchNormalization against NumPy references."""

import json
import os
import subprocess
import sys
import tempfile
import zipfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_bn import batch_normalization
from tests import references

BatchNormalization = batch_normalization.BatchNormalization

SHAPES = (
    ("dense", (16, 5), -1),
    ("conv_nhwc", (4, 6, 6, 3), -1),
    ("conv_nchw", (4, 3, 5, 5), 1),
    ("two_axes", (4, 3, 5, 6), [1, 3]),
    ("sequence", (3, 7, 4), 2),
)


def _random(shape, seed, loc=0.0, scale=1.0):
    return (np.random.RandomState(seed).randn(*shape) * scale + loc).astype(np.float32)


def _feature_shape(shape, axis):
    axes = axis if isinstance(axis, list) else [axis]
    return tuple(shape[a] for a in sorted(a % len(shape) for a in axes))


def _layer_with_random_params(shape, axis, seed=0, **kwargs):
    layer = BatchNormalization(axis=axis, **kwargs)
    layer.build(shape)
    feature_shape = _feature_shape(shape, axis)
    if layer.scale:
        layer.gamma.assign(_random(feature_shape, seed + 1, loc=1.0, scale=0.5))
    if layer.center:
        layer.beta.assign(_random(feature_shape, seed + 2))
    return layer


def _params(layer, rank):
    axes = layer.axis
    gamma = np.asarray(layer.gamma) if layer.scale else 1.0
    beta = np.asarray(layer.beta) if layer.center else 0.0
    return (
        references.broadcast_param(gamma, rank, axes) if layer.scale else gamma,
        references.broadcast_param(beta, rank, axes) if layer.center else beta,
    )


# Masks have the inputs' shape without the last axis and broadcast over it,
# whatever the feature axes (Keras' convention).
MASKED_CASES = (
    ("last_axis", (2, 5, 3), -1, 1),
    ("channels_first_sequence", (4, 3, 5), 1, 2),
    ("channels_first_conv", (3, 2, 4, 5), 1, 3),
    ("middle_and_last", (4, 3, 5, 2), [1, 3], 4),
)


def _mask(shape, seed):
    mask = np.random.RandomState(seed + 100).rand(*shape[:-1]) > 0.35
    mask.flat[0] = True  # At least one value per feature stays.
    return mask


def _masked_moments(x, mask, feature_axes):
    """Float64 weighted moments over the non-feature axes (size 1 kept)."""
    x = np.asarray(x, np.float64)
    w = np.broadcast_to(mask[..., None], x.shape).astype(np.float64)
    axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    count = w.sum(axes, keepdims=True)
    mean = (w * x).sum(axes, keepdims=True) / count
    var = (w * (x - mean) ** 2).sum(axes, keepdims=True) / count
    return mean, var


class ForwardTest(parameterized.TestCase):
    @parameterized.named_parameters(*SHAPES)
    def test_training_output_matches_reference(self, shape, axis):
        x = _random(shape, 0, loc=3.0, scale=2.0)
        layer = _layer_with_random_params(shape, axis)
        gamma, beta = _params(layer, len(shape))
        expected = references.reference_batch_norm(x, gamma, beta, layer.axis, layer.epsilon)
        np.testing.assert_allclose(layer(x, training=True), expected, rtol=1e-5, atol=1e-5)

    @parameterized.named_parameters(
        ("no_center", False, True), ("no_scale", True, False), ("neither", False, False)
    )
    def test_center_and_scale_flags(self, center, scale):
        x = _random((8, 4), 1)
        layer = _layer_with_random_params((8, 4), -1, center=center, scale=scale)
        gamma, beta = _params(layer, 2)
        expected = references.reference_batch_norm(x, gamma, beta, (-1,), 1e-3)
        np.testing.assert_allclose(layer(x, training=True), expected, rtol=1e-5, atol=1e-5)
        self.assertLen(layer.trainable_weights, int(center) + int(scale))

    @parameterized.named_parameters(*SHAPES)
    def test_inference_uses_moving_statistics(self, shape, axis):
        layer = _layer_with_random_params(shape, axis)
        feature_shape = _feature_shape(shape, axis)
        layer.moving_mean.assign(_random(feature_shape, 3))
        layer.moving_variance.assign(np.abs(_random(feature_shape, 4)) + 0.5)
        x = _random(shape, 5)
        rank = len(shape)
        gamma, beta = _params(layer, rank)
        mean = references.broadcast_param(np.asarray(layer.moving_mean), rank, layer.axis)
        var = references.broadcast_param(np.asarray(layer.moving_variance), rank, layer.axis)
        expected = gamma * (x - mean) / np.sqrt(var + layer.epsilon) + beta
        np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(layer(x, training=False), expected, rtol=1e-5, atol=1e-5)

    def test_inference_is_independent_of_batch_companions(self):
        layer = _layer_with_random_params((8, 3), -1)
        layer(_random((8, 3), 0, loc=2.0), training=True)
        x = _random((8, 3), 1)
        alone = layer(x[:1])
        together = layer(np.concatenate([x[:1], 100 * x[1:]]))
        np.testing.assert_array_equal(alone, together[:1])

    def test_trainable_false_runs_in_inference_mode(self):
        layer = _layer_with_random_params((8, 3), -1)
        layer.trainable = False
        x = _random((8, 3), 2, loc=5.0)
        np.testing.assert_allclose(layer(x, training=True), layer(x, training=False))
        np.testing.assert_array_equal(layer.moving_mean, np.zeros(3))

    @parameterized.named_parameters(*MASKED_CASES)
    def test_masked_statistics_ignore_masked_positions(self, shape, axis, seed):
        x = _random(shape, seed, loc=1.0)
        mask = _mask(shape, seed)
        layer = BatchNormalization(axis=axis, momentum=0.0, dtype="float64")
        y = layer(x.astype(np.float64), training=True, mask=mask)
        mean, var = _masked_moments(x, mask, layer.feature_axes)
        np.testing.assert_allclose(
            np.ravel(layer.moving_mean), mean.ravel(), rtol=1e-12, atol=1e-12
        )
        np.testing.assert_allclose(np.ravel(layer.moving_variance), var.ravel(), rtol=1e-12)
        np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-3), rtol=1e-10, atol=1e-10)

    def test_fully_masked_feature_keeps_its_moving_statistics(self):
        x = _random((4, 3, 5), 7, loc=2.0)
        mask = np.ones((4, 3), bool)
        mask[:, 1] = False  # Channel 1 (axis=1) has no unmasked value.
        layer = BatchNormalization(axis=1, momentum=0.5)
        y = layer(x, training=True, mask=mask)
        self.assertTrue(np.all(np.isfinite(y)))
        np.testing.assert_array_equal(np.asarray(layer.moving_mean)[1], 0.0)
        np.testing.assert_array_equal(np.asarray(layer.moving_variance)[1], 1.0)
        self.assertTrue(np.all(np.asarray(layer.moving_mean)[[0, 2]] != 0.0))


class MovingStatisticsTest(parameterized.TestCase):
    @parameterized.product(
        case=[(s[1], s[2]) for s in SHAPES],
        unbiased=[False, True],
    )
    def test_momentum_update_matches_reference(self, case, unbiased):
        shape, axis = case
        layer = BatchNormalization(axis=axis, momentum=0.8, unbiased_variance=unbiased)
        feature_shape = _feature_shape(shape, axis)
        moving_mean = np.zeros(feature_shape)
        moving_var = np.ones(feature_shape)
        for step in range(3):
            x = _random(shape, 10 + step, loc=step, scale=1 + step)
            layer(x, training=True)
            mean, var = references.reference_moments(x, layer.axis)
            m = x.size / mean.size
            if unbiased:
                var = var * m / (m - 1)
            moving_mean = 0.8 * moving_mean + 0.2 * mean.reshape(feature_shape)
            moving_var = 0.8 * moving_var + 0.2 * var.reshape(feature_shape)
        np.testing.assert_allclose(layer.moving_mean, moving_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.moving_variance, moving_var, rtol=1e-5, atol=1e-6)

    @parameterized.named_parameters(("biased", False), ("unbiased", True))
    def test_momentum_none_is_exact_cumulative_average(self, unbiased):
        shape = (6, 4, 4, 2)
        layer = BatchNormalization(momentum=None, unbiased_variance=unbiased)
        means, variances = [], []
        for step in range(5):
            x = _random(shape, 20 + step, loc=2 * step, scale=1 + step)
            layer(x, training=True)
            mean, var = references.reference_moments(x, (-1,))
            m = 6 * 4 * 4
            means.append(mean.ravel())
            variances.append(var.ravel() * (m / (m - 1) if unbiased else 1))
        np.testing.assert_allclose(layer.moving_mean, np.mean(means, 0), rtol=1e-5)
        np.testing.assert_allclose(layer.moving_variance, np.mean(variances, 0), rtol=1e-5)
        self.assertEqual(float(layer.moving_batches), 5.0)

    def test_agrees_with_keras_batch_normalization(self):
        shape = (8, 5, 5, 4)
        ours = BatchNormalization(momentum=0.9, epsilon=1e-3)
        theirs = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-3)
        for step in range(4):
            x = tf.constant(_random(shape, 30 + step, loc=1.0, scale=3.0))
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                y_ours = ours(x, training=True)
                y_theirs = theirs(x, training=True)
                weights = tf.constant(_random(shape, 40 + step))
                loss_ours = tf.reduce_sum(y_ours * weights)
                loss_theirs = tf.reduce_sum(y_theirs * weights)
            np.testing.assert_allclose(y_ours, y_theirs, rtol=1e-5, atol=1e-5)
            for a, b in zip(
                tape.gradient(loss_ours, [x, ours.gamma, ours.beta]),
                tape.gradient(loss_theirs, [x, theirs.gamma, theirs.beta]),
            ):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(ours.moving_mean, theirs.moving_mean, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ours.moving_variance, theirs.moving_variance, rtol=1e-6)
        x = _random(shape, 50)
        np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)

    def test_dynamic_single_value_and_empty_batch_stay_finite(self):
        layer = BatchNormalization(unbiased_variance=True, momentum=None)
        layer.build((None, 3))
        step = tf.function(
            lambda x: layer(x, training=True),
            input_signature=[tf.TensorSpec((None, 3), tf.float32)],
        )
        self.assertTrue(np.all(np.isfinite(step(_random((1, 3), 0)))))
        self.assertEqual(step(np.zeros((0, 3), np.float32)).shape, (0, 3))
        # Neither a single value per feature nor none moves the average.
        self.assertEqual(float(layer.moving_batches), 0.0)
        for v in layer.non_trainable_variables:
            self.assertTrue(np.all(np.isfinite(v.numpy())))


def _loss_reference(x, gamma, beta, weights, feature_axes, epsilon):
    return np.sum(weights * references.reference_batch_norm(x, gamma, beta, feature_axes, epsilon))


class GradientTest(parameterized.TestCase):
    """Analytic gradients against central differences of the whole batch."""

    @parameterized.named_parameters(*SHAPES)
    def test_gradients_match_finite_differences(self, shape, axis):
        x = _random(shape, 60, loc=1.0, scale=2.0).astype(np.float64)
        layer = _layer_with_random_params(shape, axis, seed=61)
        rank = len(shape)
        gamma, beta = _params(layer, rank)
        weights = _random(shape, 62)
        xt = tf.constant(x, tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            loss = tf.reduce_sum(layer(xt, training=True) * weights)
        dx, dgamma, dbeta = tape.gradient(loss, [xt, layer.gamma, layer.beta])

        f = lambda x_, g_, b_: _loss_reference(x_, g_, b_, weights, layer.axis, layer.epsilon)
        h = 1e-4
        rng = np.random.RandomState(63)
        for flat in rng.choice(x.size, size=6, replace=False):
            idx = np.unravel_index(flat, shape)
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            numeric = (f(plus, gamma, beta) - f(minus, gamma, beta)) / (2 * h)
            self.assertAlmostEqual(float(dx.numpy()[idx]), numeric, delta=2e-4 * (1 + abs(numeric)))
        for param, analytic, name in ((gamma, dgamma, "gamma"), (beta, dbeta, "beta")):
            flat_param = np.asarray(param, np.float64).ravel()
            for k in range(min(3, flat_param.size)):
                plus, minus = flat_param.copy(), flat_param.copy()
                plus[k] += h
                minus[k] -= h
                if name == "gamma":
                    numeric = (
                        f(x, plus.reshape(param.shape), beta)
                        - f(x, minus.reshape(param.shape), beta)
                    ) / (2 * h)
                else:
                    numeric = (
                        f(x, gamma, plus.reshape(param.shape))
                        - f(x, gamma, minus.reshape(param.shape))
                    ) / (2 * h)
                self.assertAlmostEqual(
                    float(analytic.numpy().ravel()[k]), numeric, delta=2e-4 * (1 + abs(numeric))
                )

    def test_check_rejects_gradient_with_constant_statistics(self):
        # The finite-difference check above must fail for the naive gradient
        # that treats μ_B and σ²_B as constants: γ·w/√(σ²+ε) per element.
        shape = (16, 5)
        x = _random(shape, 70).astype(np.float64)
        weights = _random(shape, 71)
        _, var = references.reference_moments(x, (-1,))
        naive = weights / np.sqrt(var + 1e-3)
        h = 1e-4
        plus, minus = x.copy(), x.copy()
        plus[0, 0] += h
        minus[0, 0] -= h
        f = lambda x_: _loss_reference(x_, 1.0, 0.0, weights, (-1,), 1e-3)
        numeric = (f(plus) - f(minus)) / (2 * h)
        self.assertGreater(abs(naive[0, 0] - numeric), 1e-2)

    @parameterized.named_parameters(*MASKED_CASES)
    def test_masked_gradient_matches_finite_differences(self, shape, axis, seed):
        # A float64 layer: the analytic gradient is checked to 1e-6.
        x = _random(shape, 80 + seed, loc=0.5).astype(np.float64)
        mask = _mask(shape, seed)
        weights = _random(shape, 81 + seed).astype(np.float64)
        layer = BatchNormalization(axis=axis, dtype="float64")
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            loss = tf.reduce_sum(layer(xt, training=True, mask=mask) * weights)
        dx = tape.gradient(loss, xt).numpy()

        def f(x_):
            mean, var = _masked_moments(x_, mask, layer.feature_axes)
            return np.sum(weights * (x_ - mean) / np.sqrt(var + 1e-3))

        h = 1e-6
        rng = np.random.RandomState(seed)
        for _ in range(6):
            idx = tuple(rng.randint(0, n) for n in shape)
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            numeric = (f(plus) - f(minus)) / (2 * h)
            self.assertAlmostEqual(float(dx[idx]), numeric, delta=1e-6 * (1 + abs(numeric)))


class PrecisionTest(parameterized.TestCase):
    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_float64_layer_computes_in_float64(self):
        x = (
            _random((64, 6), 30, loc=1e3, scale=0.5).astype(np.float64)
            + np.random.RandomState(31).rand(64, 6) * 1e-6
        )
        layer = BatchNormalization(dtype="float64", momentum=0.0)
        y = layer(x, training=True)
        self.assertEqual(y.dtype, tf.float64)
        for weight in layer.weights:
            self.assertEqual(keras.backend.standardize_dtype(weight.dtype), "float64", weight.name)
        expected = references.reference_batch_norm(x, 1.0, 0.0, (-1,), 1e-3)
        self.assertLess(np.abs(y.numpy() - expected).max(), 1e-9)
        np.testing.assert_allclose(layer.moving_variance, x.var(0), rtol=1e-10)

    @parameterized.named_parameters(
        ("float16", "mixed_float16", "float16"),
        ("bfloat16", "mixed_bfloat16", "bfloat16"),
    )
    def test_mixed_precision_keeps_float32_statistics(self, policy, dtype):
        keras.mixed_precision.set_global_policy(policy)
        layer = BatchNormalization(momentum=0.0)
        x = _random((32, 4), 90, loc=3e4, scale=3e4).clip(-6e4, 6e4)
        x_low = tf.cast(x, dtype)
        y = layer(x_low, training=True)
        self.assertEqual(y.dtype, dtype)
        for weight in layer.weights:
            self.assertEqual(weight.dtype, "float32")
        y32 = tf.cast(y, tf.float32).numpy()
        self.assertTrue(np.all(np.isfinite(y32)))
        x_exact = tf.cast(x_low, tf.float32).numpy().astype(np.float64)
        np.testing.assert_allclose(layer.moving_mean, x_exact.mean(0), rtol=1e-5)
        np.testing.assert_allclose(layer.moving_variance, x_exact.var(0), rtol=1e-5)
        expected = (x_exact - x_exact.mean(0)) / np.sqrt(x_exact.var(0) + 1e-3)
        np.testing.assert_allclose(y32, expected, atol=0.02, rtol=0.02)
        self.assertTrue(np.all(np.isfinite(tf.cast(layer(x_low), tf.float32))))

    def test_float16_gradient_is_finite(self):
        x = tf.constant(_random((16, 4), 91, loc=1e4, scale=5e3), tf.float16)
        layer = BatchNormalization(dtype="float16")
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(layer(x, training=True), tf.float32) ** 2)
        dx = tape.gradient(loss, x)
        self.assertEqual(dx.dtype, tf.float16)
        self.assertTrue(np.all(np.isfinite(tf.cast(dx, tf.float32))))


def _small_model(**bn_kwargs):
    return keras.Sequential(
        [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(4, 3, use_bias=False),
            BatchNormalization(**bn_kwargs),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dense(5),
            BatchNormalization(axis=-1, momentum=None, unbiased_variance=True),
        ]
    )


class SerializationTest(parameterized.TestCase):
    def test_config_round_trip(self):
        layer = BatchNormalization(
            axis=[1, 3],
            momentum=None,
            epsilon=1e-5,
            center=False,
            unbiased_variance=True,
            synchronized=True,
            sync_group_size=8,
            gamma_regularizer="l2",
            beta_constraint="non_neg",
            name="bn",
        )
        config = layer.get_config()
        clone = BatchNormalization.from_config(config)
        self.assertEqual(clone.get_config(), config)
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
        self.assertIsInstance(restored, BatchNormalization)
        self.assertEqual(restored.axis, (1, 3))
        self.assertIsNone(restored.momentum)
        self.assertEqual(restored.sync_group_size, 8)

    def _trained_model(self):
        model = _small_model(momentum=0.5)
        for step in range(3):
            model(_random((8, 6, 6, 3), 100 + step, loc=1.0), training=True)
        return model

    def test_keras_file_round_trip(self):
        model = self._trained_model()
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        x = _random((4, 6, 6, 3), 110)
        np.testing.assert_array_equal(model(x), loaded(x))
        for a, b in zip(model.weights, loaded.weights):
            self.assertEqual(a.name, b.name)
            np.testing.assert_array_equal(a, b)

    @pytest.mark.integration
    def test_a_saved_file_names_the_package_and_needs_it_imported_to_load(self):
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        self._trained_model().save(path)
        with zipfile.ZipFile(path) as archive:
            saved = json.loads(archive.read("config.json"))["config"]["layers"][-1]
        self.assertEqual(saved["module"], "keras_bn.batch_normalization")
        self.assertEqual(saved["registered_name"], "keras_bn>BatchNormalization")
        # A fresh process that never imports keras_bn: Keras' error names the layer's package.
        load = f"import keras; keras.saving.load_model({path!r})"
        done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("TypeError", done.stderr)
        self.assertIn("keras_bn>BatchNormalization", done.stderr)

    def test_saved_model_export(self):
        model = self._trained_model()
        path = os.path.join(tempfile.mkdtemp(), "export")
        tf.saved_model.save(model, path)
        loaded = tf.saved_model.load(path)
        x = _random((4, 6, 6, 3), 111)
        serve = loaded.signatures["serving_default"]
        (output,) = serve(tf.constant(x)).values()
        np.testing.assert_allclose(model(x), output, rtol=1e-6, atol=1e-6)


class CompileTest(parameterized.TestCase):
    def test_train_step_compiles_with_xla(self):
        def run(jit):
            keras.utils.set_random_seed(0)
            model = _small_model(momentum=0.9)
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)

            @tf.function(jit_compile=jit)
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            for i in range(3):
                loss = step(
                    tf.constant(_random((8, 6, 6, 3), 120 + i)),
                    tf.constant(_random((8, 5), 130 + i)),
                )
            return loss, [v.numpy() for v in model.weights]

        loss_xla, weights_xla = run(True)
        loss_graph, weights_graph = run(False)
        np.testing.assert_allclose(loss_xla, loss_graph, rtol=1e-4)
        for a, b in zip(weights_xla, weights_graph):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class ValidationTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("momentum_one", {"momentum": 1.0}, ValueError, r"momentum.*Received: momentum=1.0"),
        ("momentum_negative", {"momentum": -0.1}, ValueError, r"Received: momentum=-0.1"),
        ("momentum_type", {"momentum": "0.9"}, TypeError, r"Received: momentum='0.9'"),
        ("epsilon_negative", {"epsilon": -1e-3}, ValueError, r"Received: epsilon=-0.001"),
        ("epsilon_nan", {"epsilon": float("nan")}, ValueError, r"Received: epsilon=nan"),
        ("axis_type", {"axis": 1.5}, TypeError, r"Received: axis=1.5"),
        ("axis_empty", {"axis": []}, TypeError, r"Received: axis=\[\]"),
        ("flag_type", {"center": "yes"}, TypeError, r"Received: center='yes'"),
        ("synchronized_type", {"synchronized": 1}, TypeError, r"Received: synchronized=1"),
        (
            "group_size_type",
            {"synchronized": True, "sync_group_size": 2.0},
            TypeError,
            r"Received: sync_group_size=2.0",
        ),
        (
            "group_size_bool",
            {"synchronized": True, "sync_group_size": True},
            TypeError,
            r"Received: sync_group_size=True",
        ),
        (
            "group_size_zero",
            {"synchronized": True, "sync_group_size": 0},
            ValueError,
            r">= 1. Received: sync_group_size=0",
        ),
        (
            "group_size_unsynchronized",
            {"sync_group_size": 2},
            ValueError,
            r"needs synchronized=True. Received: sync_group_size=2",
        ),
        (
            "skip_type",
            {"skip_nonfinite_updates": 0},
            TypeError,
            r"Received: skip_nonfinite_updates=0",
        ),
        (
            "count_type",
            {"count_skipped_updates": 1},
            TypeError,
            r"Received: count_skipped_updates=1",
        ),
        (
            "count_without_guard",
            {"count_skipped_updates": True, "skip_nonfinite_updates": False},
            ValueError,
            r"Received: count_skipped_updates=True, skip_nonfinite_updates=False",
        ),
        ("warmup_type", {"momentum_warmup": "on"}, TypeError, r"Received: momentum_warmup='on'"),
        (
            "warmup_cumulative",
            {"momentum_warmup": True, "momentum": None},
            ValueError,
            r"Received: momentum_warmup=True, momentum=None",
        ),
    )
    def test_constructor_rejects(self, kwargs, error, pattern):
        with self.assertRaisesRegex(error, pattern):
            BatchNormalization(**kwargs)

    def test_axis_out_of_range(self):
        with self.assertRaisesRegex(ValueError, r"out of range.*Received: axis=\(3,\)"):
            BatchNormalization(axis=3).build((4, 5, 6))

    def test_duplicate_axes(self):
        with self.assertRaisesRegex(ValueError, r"distinct.*Received: axis=\(1, -2\)"):
            BatchNormalization(axis=[1, -2]).build((4, 5, 6))

    def test_undefined_feature_dimension(self):
        with self.assertRaisesRegex(ValueError, r"defined dimension.*Received: input_shape"):
            BatchNormalization().build((4, None))

    def test_rank_mismatch_with_build(self):
        layer = BatchNormalization()
        layer(np.ones((4, 3), np.float32))
        with self.assertRaisesRegex(ValueError, r"expected ndim=2, found ndim=3"):
            layer(np.ones((4, 2, 3), np.float32))

    def test_feature_size_mismatch_with_build(self):
        layer = BatchNormalization()
        layer(np.ones((4, 3), np.float32))
        with self.assertRaisesRegex(ValueError, r"expected axis -1|expected axis 1"):
            layer(np.ones((4, 5), np.float32))

    def test_non_numeric_input(self):
        with self.assertRaisesRegex(TypeError, r"real numeric inputs.*Received: inputs.dtype=bool"):
            BatchNormalization()(np.ones((4, 3), bool))

    @parameterized.parameters("int32", "int64", "uint8")
    def test_integer_inputs_are_cast(self, dtype):
        x = np.arange(12).reshape(4, 3).astype(dtype)
        layer = BatchNormalization()
        expected = references.reference_batch_norm(x, 1.0, 0.0, (-1,), 1e-3)
        np.testing.assert_allclose(layer(x, training=True), expected, rtol=1e-5, atol=1e-5)
        self.assertEqual(keras.backend.standardize_dtype(layer(x).dtype), "float32")

    @parameterized.named_parameters(("momentum", 0.9), ("cumulative", None))
    def test_single_value_batch_gives_beta_and_moves_nothing(self, momentum):
        layer = BatchNormalization(
            momentum=momentum, count_skipped_updates=True, beta_initializer="ones"
        )
        keras_layer = keras.layers.BatchNormalization(momentum=0.9, beta_initializer="ones")
        x = tf.constant(_random((1, 3), 7) * 5.0)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y, keras_y = layer(x, training=True), keras_layer(x, training=True)
        np.testing.assert_array_equal(y, np.ones((1, 3), np.float32))
        np.testing.assert_array_equal(y, keras_y)
        np.testing.assert_allclose(tape.gradient(y, x), tape.gradient(keras_y, x), atol=1e-6)
        np.testing.assert_array_equal(layer.moving_mean, np.zeros(3, np.float32))
        np.testing.assert_array_equal(layer.moving_variance, np.ones(3, np.float32))
        self.assertEqual(float(layer.skipped_updates), 1.0)

    @parameterized.named_parameters(
        ("rank", (2, 5, 3)),
        ("length", (4, 5)),
    )
    def test_mask_shape(self, mask_shape):
        received = ", ".join(map(str, mask_shape))
        shapes = rf"Received: mask.shape=\({received}\), inputs.shape=\(2, 5, 3\)"
        with self.assertRaisesRegex(ValueError, r"Expected `mask` of shape \(2, 5\).*" + shapes):
            BatchNormalization()(
                np.ones((2, 5, 3), np.float32), training=True, mask=np.ones(mask_shape, bool)
            )


if __name__ == "__main__":
    absltest.main()
