"""The layer with local statistics on the current Keras backend.

Runs under whichever backend `KERAS_BACKEND` selects (`.ci/run` runs it under
TensorFlow with the rest of the suite, and again under JAX and, when torch is
installed, PyTorch, each in its own process): `fit` trains with renorm,
masks, `momentum=None` and `unbiased_variance`; the training output and the
moving statistics match float64 NumPy references; gradients match finite
differences; TensorFlow is not imported unless the backend is TensorFlow;
ghost batches match the float64 reference; `synchronized=True` on PyTorch
is refused at construction, naming the backend (JAX's is tested in
`jax_distribution_test.py`); on PyTorch, `torch.compile` traces a call
without graph breaks.
"""

import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

import keras_bn
from tests import references

BACKEND = keras.backend.backend()


def _data(shape, seed, loc=2.0, scale=3.0):
    return (np.random.RandomState(seed).randn(*shape) * scale + loc).astype(np.float32)


class BackendTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("plain", {}),
        ("unbiased_cumulative", {"momentum": None, "unbiased_variance": True}),
        ("renorm", {"renorm": True, "renorm_clipping": {"rmax": 2.0, "rmin": 0.5, "dmax": 1.0}}),
    )
    def test_training_output_and_moving_statistics(self, kwargs):
        x = _data((8, 3, 4), 0)
        layer = keras_bn.BatchNormalization(epsilon=1e-3, **kwargs)
        y = keras.ops.convert_to_numpy(layer(x, training=True))
        mean, variance = references.reference_moments(x, (-1,))
        x_hat = (x - mean) / np.sqrt(variance + 1e-3)
        if kwargs.get("renorm"):
            # Initial renorm statistics (0, 1): r = σ_B clipped, d = μ_B clipped.
            r = np.clip(np.sqrt(variance + 1e-3), 0.5, 2.0)
            d = np.clip(mean, -1.0, 1.0)
            x_hat = x_hat * r + d
        np.testing.assert_allclose(y, x_hat, rtol=1e-5, atol=1e-5)
        m = 24
        batch_variance = variance.ravel() * (
            m / (m - 1) if kwargs.get("unbiased_variance") else 1.0
        )
        rate = 1.0 if kwargs.get("momentum", 0.99) is None else 0.01
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(layer.moving_mean), rate * mean.ravel(), rtol=1e-5
        )
        if kwargs.get("renorm"):
            stddev = 0.99 + 0.01 * np.sqrt(batch_variance + 1e-3)
            expected_variance = stddev**2 - 1e-3
        else:
            expected_variance = 1 - rate + rate * batch_variance
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(layer.moving_variance), expected_variance, rtol=1e-5
        )

    def test_masked_statistics_with_channels_first(self):
        x = _data((4, 3, 5), 1)
        mask = np.random.RandomState(2).rand(4, 3) > 0.3
        mask[0] = True
        layer = keras_bn.BatchNormalization(axis=1, momentum=0.0)
        layer(x, training=True, mask=mask)
        w = np.broadcast_to(mask[..., None], x.shape)
        mean = (w * x).sum((0, 2)) / w.sum((0, 2))
        np.testing.assert_allclose(keras.ops.convert_to_numpy(layer.moving_mean), mean, rtol=1e-5)

    def test_input_gradient_matches_finite_differences(self):
        x = _data((6, 4), 3).astype(np.float64)
        weights = np.random.RandomState(4).randn(6, 4)
        layer = keras_bn.BatchNormalization(dtype="float64")
        layer.build(x.shape)
        w = keras.ops.convert_to_tensor(weights)
        dx = _input_gradient(lambda v: keras.ops.sum(layer(v, training=True) * w), x)

        def f(v):
            mean, variance = v.mean(0), v.var(0)
            return np.sum(weights * (v - mean) / np.sqrt(variance + 1e-3))

        # JAX without x64 computes a float64 layer in float32.
        exact = keras.ops.convert_to_numpy(keras.ops.ones((1,), "float64")).dtype == np.float64
        tolerance = 1e-6 if exact else 1e-3
        h = 1e-6
        for idx in [(0, 0), (3, 2), (5, 3)]:
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            numeric = (f(plus) - f(minus)) / (2 * h)
            self.assertAlmostEqual(float(dx[idx]), numeric, delta=tolerance * (1 + abs(numeric)))

    @parameterized.named_parameters(
        ("plain", {}),
        ("renorm", {"renorm": True}),
        ("unbiased", {"unbiased_variance": True}),
    )
    def test_fit_trains_with_masks(self, kwargs):
        keras.utils.set_random_seed(0)
        x = _data((64, 5, 3), 5)
        x[:, 3:] = 0.0  # Padding, masked out by the Masking layer.
        y = (x[:, :3].sum((1, 2)) > 6.0).astype(np.float32)
        model = keras.Sequential(
            [
                keras.Input((5, 3)),
                keras.layers.Masking(0.0),
                # The exact cumulative average, so the moving mean is checkable.
                keras_bn.BatchNormalization(momentum=None, **kwargs),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        model.compile(keras.optimizers.SGD(0.5), "binary_crossentropy")
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
        losses = history.history["loss"]
        self.assertTrue(np.all(np.isfinite(losses)))
        self.assertLess(losses[-1], losses[0])
        moving_mean = keras.ops.convert_to_numpy(model.layers[1].moving_mean)
        # Only the unmasked steps count (the padded mean would be 3/5 of it).
        np.testing.assert_allclose(moving_mean, x[:, :3].mean((0, 1)), rtol=1e-4)

    @pytest.mark.integration
    def test_tensorflow_is_imported_only_by_the_tensorflow_backend(self):
        script = (
            "import sys, numpy as np, keras, keras_bn\n"
            "layer = keras_bn.BatchNormalization(renorm=True)\n"
            "layer(np.ones((4, 3), 'float32'), training=True, mask=np.ones((4,), bool))\n"
            "print('tensorflow' in sys.modules)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        )
        self.assertEqual(out.stdout.strip().splitlines()[-1], str(BACKEND == "tensorflow"))

    def test_ghost_batches(self):
        x, upstream = _data((16, 3), 7), _data((16, 3), 8, loc=0.0, scale=1.0)
        layer = keras_bn.BatchNormalization(virtual_batch_size=4, momentum=0.0)
        y = keras.ops.convert_to_numpy(layer(x, training=True))
        expected = references.reference_sliced_batch_norm(x, upstream, 1.0, 0.0, 4, 1e-3)
        np.testing.assert_allclose(y, expected["y"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(layer.moving_mean), expected["mean"], rtol=1e-5
        )
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(layer.moving_variance), expected["variance"], rtol=1e-5
        )
        dx = _input_gradient(
            lambda v: keras.ops.sum(keras.ops.multiply(layer(v, training=True), upstream)), x
        )
        np.testing.assert_allclose(dx, expected["dx"], rtol=1e-4, atol=1e-5)
        # Inference ignores the ghost batch size.
        self.assertEqual(tuple(layer(x[:3], training=False).shape), (3, 3))

    def test_converted_model_trains_after_its_original(self):
        x, y = _data((32, 6), 5), _data((32, 1), 6)
        original = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(1),
            ]
        )
        converted = keras_bn.convert_batch_norm(original)
        for model in (original, converted):  # The original first: its buffers are donated.
            model.compile(keras.optimizers.SGD(0.01), "mse")
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
            self.assertTrue(np.all(np.isfinite(history.history["loss"])))
        self.assertFalse(
            np.array_equal(
                keras.ops.convert_to_numpy(original.layers[1].moving_mean),
                keras.ops.convert_to_numpy(converted.layers[1].moving_mean),
            )
        )

    def test_monitor_logs_health_on_this_backend(self):
        from tests import tensorboard_events  # Reads events with TensorFlow: import it here.

        x, y = _data((64, 6), 7), _data((64, 1), 8)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(5),
                keras_bn.BatchNormalization(name="bn", count_skipped_updates=True),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.SGD(0.01), "mse")
        log_dir = tempfile.mkdtemp()
        monitor = keras_bn.BatchNormMonitor(log_dir, x[:32], every_n_steps=4)
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)  # 8 steps.
        tags = tensorboard_events.read_events(log_dir)
        self.assertEqual([s for s, _ in tags["bn/train_inference_gap"]], [4, 8])
        self.assertEqual({v for _, v in tags["bn/skipped_updates"]}, {0.0})
        layer, health = monitor.health(model)[0]
        self.assertIs(layer, model.get_layer("bn"))
        self.assertAlmostEqual(
            tags["bn/train_inference_gap"][-1][1], health["train_inference_gap"], places=4
        )
        self.assertTrue(all(np.isfinite(v) for v in health.values()))

    def test_masked_out_nan_reaches_no_other_output_nor_statistic(self):
        x, mask = _data((4, 8, 3), 11), np.ones((4, 8), bool)
        mask[1, 5:] = False
        clean = keras_bn.BatchNormalization(momentum=0.0)
        expected = keras.ops.convert_to_numpy(clean(x, training=True, mask=mask))
        dirty_x = x.copy()
        dirty_x[1, 6, 0] = np.nan  # A masked-out value.
        dirty_x[1, 7, 2] = np.inf
        layer = keras_bn.BatchNormalization(momentum=0.0, count_skipped_updates=True)
        y = keras.ops.convert_to_numpy(layer(dirty_x, training=True, mask=mask))
        self.assertEqual(int(np.sum(~np.isfinite(y))), 2)  # Their own outputs, as in Keras.
        finite = np.isfinite(y)
        np.testing.assert_allclose(y[finite], expected[finite], rtol=1e-6, atol=1e-6)
        for name in ("moving_mean", "moving_variance"):
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(getattr(layer, name)),
                keras.ops.convert_to_numpy(getattr(clean, name)),
                rtol=1e-6,
            )
        self.assertEqual(float(keras.ops.convert_to_numpy(layer.skipped_updates)), 0.0)
        # The other values' gradients stay finite and equal the clean ones.
        weights = np.where(mask[..., None], 1.0, 0.0).astype(np.float32) * _data(x.shape, 12)

        def loss(layer, inputs):
            y = layer(inputs, training=True, mask=mask)
            return keras.ops.sum(keras.ops.where(weights != 0, keras.ops.multiply(y, weights), 0.0))

        dx = _input_gradient(lambda v: loss(layer, v), dirty_x)
        dx_clean = _input_gradient(lambda v: loss(clean, v), x)
        np.testing.assert_allclose(dx[mask], dx_clean[mask], rtol=1e-4, atol=1e-5)

    def test_empty_batch_with_ghost_batches(self):
        x = np.zeros((0, 3), np.float32)
        plain = keras_bn.BatchNormalization()
        ghost = keras_bn.BatchNormalization(virtual_batch_size=4)
        for layer in (plain, ghost):
            y = keras.ops.convert_to_numpy(layer(x, training=True))
            self.assertEqual(y.shape, (0, 3))
        for name in ("moving_mean", "moving_variance"):
            a = keras.ops.convert_to_numpy(getattr(ghost, name))
            np.testing.assert_array_equal(a, keras.ops.convert_to_numpy(getattr(plain, name)))
            self.assertTrue(np.all(np.isfinite(a)))

    @parameterized.named_parameters(
        ("halves", [0.0, 0.5, 1.0], "float32"),
        ("signs", [-1.0, 1.0], "float32"),
        ("integers", [0, 3], "int32"),
    )
    def test_a_mask_counts_where_it_is_not_zero(self, values, dtype):
        # Keras' meaning: a value counts where mask != 0, whatever its dtype.
        rng = np.random.RandomState(5)
        x = _data((6, 4, 3), 9)
        mask = rng.choice(values, size=(6, 4)).astype(dtype)
        mask[0, 0] = values[-1]  # At least one value counts.
        outputs = []
        for given in (mask, mask != 0):
            layer = keras_bn.BatchNormalization(momentum=0.5)
            y = keras.ops.convert_to_numpy(layer(x, training=True, mask=given))
            outputs.append((y, keras.ops.convert_to_numpy(layer.moving_mean)))
        np.testing.assert_array_equal(outputs[0][0], outputs[1][0])
        np.testing.assert_array_equal(outputs[0][1], outputs[1][1])
        self.assertTrue(np.all(np.isfinite(outputs[0][0])))

    @parameterized.named_parameters(
        ("fused_maps", {}, (8, 4, 4, 3), True, False),
        ("fused_features", {}, (8, 3), True, False),
        ("channels_first", {"axis": 1}, (8, 3, 4, 4), True, False),
        ("inference", {}, (8, 4, 4, 3), False, False),
        ("general", {"fused": False}, (8, 4, 4, 3), True, False),
        ("mask", {}, (8, 5, 3), True, True),
        ("cumulative", {"momentum": None}, (8, 3), True, False),
        ("accumulation", {"accumulation_steps": 2}, (8, 3), True, False),
        ("ghost_batches", {"virtual_batch_size": 4}, (8, 3), True, False),
        ("counted_skips", {"count_skipped_updates": True}, (8, 3), True, False),
        ("counted_skips_mask", {"count_skipped_updates": True}, (8, 5, 3), True, True),
        ("warmup_mask", {"momentum_warmup": True}, (8, 5, 3), True, True),
    )
    def test_pytorch_compiles_a_call_without_graph_breaks(self, kwargs, shape, training, masked):
        # A graph break inside Keras' name scope makes `torch.compile` run the
        # whole call eagerly (docs/benchmarks.md: the compiled MNIST network).
        if BACKEND != "torch":
            self.skipTest("torch.compile is PyTorch's")
        import torch

        layer = keras_bn.BatchNormalization(**kwargs)
        x = torch.tensor(_data(shape, 2))
        layer.build(x.shape)
        mask = torch.ones(shape[:-1], dtype=torch.bool) if masked else None
        report = torch._dynamo.explain(lambda x: layer(x, training=training, mask=mask))(x)
        where = [[f"{f.filename}:{f.lineno}" for f in r.user_stack] for r in report.break_reasons]
        self.assertEqual(report.break_reasons, [], where)
        self.assertEqual(report.graph_count, 1)  # One graph: no frame fell back to eager.

    def test_synchronized_needs_a_distribution_engine(self):
        if BACKEND in ("tensorflow", "jax", "torch"):
            self.skipTest(f"synchronized=True is supported on {BACKEND} (its own tests)")
        # Refused at construction, as Keras' layer refuses it, and so by the conversion.
        message = f"not supported on the {BACKEND} backend. Received: synchronized=True"
        with self.assertRaisesRegex(ValueError, message):
            keras_bn.BatchNormalization(synchronized=True)
        model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
        with self.assertRaisesRegex(ValueError, message):
            keras_bn.convert_batch_norm(model, synchronized=True)


def _input_gradient(loss_fn, x):
    """d loss / d x on the current backend, as a NumPy array."""
    if BACKEND == "jax":
        import jax

        return np.asarray(jax.grad(lambda v: loss_fn(v))(x))
    if BACKEND == "torch":
        import torch

        v = torch.tensor(x, requires_grad=True)
        loss_fn(v).backward()
        return v.grad.numpy()
    import tensorflow as tf

    v = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(v)
        loss = loss_fn(v)
    return tape.gradient(loss, v).numpy()


if __name__ == "__main__":
    absltest.main()
