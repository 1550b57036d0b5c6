"""Which statistics normalise (`statistics=`): batch statistics always, or frozen moving ones.

Runs on every backend (`.ci/run` runs it on each); the training call of both
settings is also a path of the conformance matrix (`conformance_test.py`).
"""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn

EPSILON = 1e-3


def _batch_norm(x, gamma, beta, mean, variance):
    """The float64 normalisation of `x` (N, C) with given per-feature statistics."""
    return gamma * (x - mean) / np.sqrt(variance + EPSILON) + beta


def _data(shape, seed, loc=3.0, scale=2.0):
    return (np.random.RandomState(seed).randn(*shape) * scale + loc).astype(np.float32)


def _moving(layer):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in layer.non_trainable_weights]


class ValidationTest(absltest.TestCase):
    def test_non_string_is_refused(self):
        with self.assertRaisesRegex(TypeError, r"must be a string\. Received: statistics=True"):
            keras_bn.BatchNormalization(statistics=True)

    def test_unknown_value_is_refused(self):
        with self.assertRaisesRegex(
            ValueError, r"one of \('batch_in_training', 'batch', 'moving'\).*statistics='frozen'"
        ):
            keras_bn.BatchNormalization(statistics="frozen")

    def test_renorm_needs_the_default(self):
        with self.assertRaisesRegex(ValueError, r"Received: statistics='moving', renorm=True"):
            keras_bn.BatchNormalization(statistics="moving", renorm=True)


class BatchStatisticsAtInferenceTest(parameterized.TestCase):
    @parameterized.parameters(False, None)
    def test_inference_normalises_each_batch_with_its_own_statistics(self, training):
        x = _data((16, 3), 0)
        layer = keras_bn.BatchNormalization(statistics="batch", epsilon=EPSILON)
        y = keras.ops.convert_to_numpy(layer(x, training=training))
        x64 = x.astype(np.float64)
        expected = _batch_norm(x64, 1.0, 0.0, x64.mean(0), x64.var(0))  # σ²_B, as in training.
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        # Inference moves nothing: the statistics are still their initial values.
        for value, initial in zip(_moving(layer), (0.0, 1.0)):
            np.testing.assert_array_equal(value, np.full(3, initial, np.float32))

    def test_training_moves_the_statistics_as_the_default_layer_does(self):
        x = _data((16, 3), 1)
        ours = keras_bn.BatchNormalization(statistics="batch", momentum=0.5)
        default = keras_bn.BatchNormalization(momentum=0.5)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(ours(x, training=True)),
            keras.ops.convert_to_numpy(default(x, training=True)),
            rtol=1e-6,
            atol=1e-6,
        )
        for a, b in zip(_moving(ours), _moving(default)):
            np.testing.assert_allclose(a, b, rtol=1e-6)

    def test_predict_batches_are_normalised_on_their_own(self):
        x = _data((12, 2), 2)
        x[6:] += 10.0  # The second batch's statistics differ from the first's.
        model = keras.Sequential(
            [keras.Input((2,)), keras_bn.BatchNormalization(statistics="batch", epsilon=EPSILON)]
        )
        y = model.predict(x, batch_size=6, verbose=0)
        for rows in (slice(0, 6), slice(6, 12)):
            part = x[rows].astype(np.float64)
            expected = _batch_norm(part, 1.0, 0.0, part.mean(0), part.var(0))
            np.testing.assert_allclose(y[rows], expected, rtol=1e-5, atol=1e-5)

    def test_masked_values_do_not_count_at_inference(self):
        x = _data((2, 5, 3), 3)
        mask = np.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], bool)
        layer = keras_bn.BatchNormalization(statistics="batch", epsilon=EPSILON)
        y = keras.ops.convert_to_numpy(layer(x, mask=mask))
        kept = x[mask].astype(np.float64)
        expected = _batch_norm(kept, 1.0, 0.0, kept.mean(0), kept.var(0))
        np.testing.assert_allclose(y[mask], expected, rtol=1e-5, atol=1e-5)


class FrozenStatisticsTest(parameterized.TestCase):
    def _frozen_model(self, mean, variance):
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, name="dense"),
                keras_bn.BatchNormalization(
                    statistics="moving",
                    epsilon=EPSILON,
                    moving_mean_initializer=keras.initializers.Constant(mean),
                    moving_variance_initializer=keras.initializers.Constant(variance),
                    gamma_initializer=keras.initializers.Constant([0.5, 1.0, 2.0]),
                    beta_initializer=keras.initializers.Constant([0.1, -0.2, 0.3]),
                    name="bn",
                ),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    def test_fine_tuning_step_matches_a_float64_reference(self):
        """One SGD step: γ, β and the layer below learn through the inference formula."""
        mean, variance = np.array([0.3, -0.2, 1.0]), np.array([2.0, 0.5, 1.5])
        model = self._frozen_model(mean, variance)
        x, target = _data((8, 4), 4, 0.0, 1.0), _data((8, 3), 5, 0.0, 1.0)
        kernel, bias, gamma, beta = (w.astype(np.float64) for w in model.get_weights()[:4])
        model.train_on_batch(x, target)
        # The reference: h = xW + b, y = γ (h − μ) / √(σ² + ε) + β, L = mean((y − t)²).
        inv = 1.0 / np.sqrt(variance + EPSILON)
        h = x.astype(np.float64) @ kernel + bias
        y = gamma * (h - mean) * inv + beta
        g = 2.0 * (y - target) / y.size
        dh = g * gamma * inv  # No path through the batch: μ and σ² are constants.
        expected = {
            "kernel": kernel - 0.1 * x.T.astype(np.float64) @ dh,
            "bias": bias - 0.1 * dh.sum(0),
            "gamma": gamma - 0.1 * (g * (h - mean) * inv).sum(0),
            "beta": beta - 0.1 * g.sum(0),
        }
        trained = dict(zip(expected, model.get_weights()[:4]))
        for name, want in expected.items():
            np.testing.assert_allclose(trained[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        # The statistics stayed; training and inference now give one output.
        bn = model.get_layer("bn")
        np.testing.assert_allclose(_moving(bn)[0], mean, rtol=1e-7)
        np.testing.assert_allclose(_moving(bn)[1], variance, rtol=1e-7)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(model(x, training=True)),
            keras.ops.convert_to_numpy(model(x, training=False)),
            rtol=1e-6,
        )

    def test_fit_leaves_the_statistics_where_they_were(self):
        model = self._frozen_model([0.0, 1.0, 2.0], [1.0, 2.0, 3.0])
        before = _moving(model.get_layer("bn"))
        x, target = _data((20, 4), 6), _data((20, 3), 7)
        model.fit(x, target, batch_size=6, epochs=2, verbose=0)  # A last batch of two.
        for a, b in zip(_moving(model.get_layer("bn")), before):
            np.testing.assert_array_equal(a, b)

    def test_weight_files_are_keras_own(self):
        """A frozen layer's file loads into Keras' layer and back: the same four weights."""
        model = self._frozen_model([0.5, 1.0, 1.5], [1.0, 2.0, 3.0])
        path = os.path.join(tempfile.mkdtemp(), "frozen.weights.h5")
        model.save_weights(path)
        theirs = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()]
        )
        theirs.load_weights(path)
        for a, b in zip(theirs.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        self.assertLen(model.get_layer("bn").weights, 4)

    def test_conversion_freezes_a_model_and_keeps_its_weights(self):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()]
        )
        model.layers[-1].moving_mean.assign([1.0, 2.0, 3.0])
        frozen = keras_bn.convert_batch_norm(model, statistics="moving")
        self.assertEqual(frozen.layers[-1].statistics, "moving")
        for a, b in zip(frozen.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        x = _data((5, 4), 8)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(frozen(x, training=True)),
            keras.ops.convert_to_numpy(model(x, training=False)),
            rtol=1e-5,
            atol=1e-6,
        )

    @parameterized.parameters("batch_in_training", "batch", "moving")
    def test_config_round_trip(self, statistics):
        layer = keras_bn.BatchNormalization(statistics=statistics)
        self.assertEqual(
            keras_bn.BatchNormalization.from_config(layer.get_config()).statistics, statistics
        )


if __name__ == "__main__":
    absltest.main()
