"""Tests of keras_bn.fold_batch_norm."""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn
from keras_bn import folding
from keras_bn import population


def _randomize_statistics(model, seed):
    """Random γ, β and moving statistics for every keras_bn layer, nested ones too."""
    rng = np.random.RandomState(seed)
    for layer in population.batch_norm_layers(model):
        for weight in layer.weights:
            shape, dtype = weight.shape, weight.dtype
            if weight.name == "moving_variance":
                weight.assign(rng.uniform(0.2, 3.0, shape).astype(dtype))
            elif weight.name not in ("moving_batches", "skipped_updates", "num_updates"):
                weight.assign(rng.randn(*shape).astype(dtype))


def _cpu_runs_nchw_conv():
    """Whether this machine's TensorFlow can run a channels-first Conv2D."""
    import tensorflow as tf

    try:
        with tf.device("/cpu:0"):
            tf.nn.conv2d(
                tf.zeros((1, 1, 2, 2)), tf.zeros((1, 1, 1, 1)), 1, "VALID", data_format="NCHW"
            )
    except tf.errors.UnimplementedError:
        return False
    return True


class FoldTest(parameterized.TestCase):
    def _check(self, model, x, expected_identity, rtol=1e-5):
        _randomize_statistics(model, 0)
        folded = keras_bn.fold_batch_norm(model)
        expected = model(x, training=False).numpy()
        np.testing.assert_allclose(
            folded(x), expected, rtol=rtol, atol=rtol * np.abs(expected).max()
        )
        identities = [x.name for x in folded.layers if isinstance(x, folding.FoldedBatchNorm)]
        self.assertCountEqual(identities, expected_identity)
        self.assertFalse(
            any(
                isinstance(x, keras_bn.BatchNormalization)
                for x in folded.layers
                if x.name in expected_identity
            )
        )
        original = {id(v) for v in model.weights}
        self.assertFalse(any(id(v) in original for v in folded.weights))
        return folded

    def test_sequential_dense_and_conv(self):
        model = keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(4, 3, use_bias=False, name="conv"),
                keras_bn.BatchNormalization(name="bn1"),
                keras.layers.ReLU(),
                keras.layers.Flatten(),
                keras.layers.Dense(6, name="dense"),
                keras_bn.BatchNormalization(center=False, name="bn2"),
                keras.layers.Activation("sigmoid"),
            ]
        )
        x = np.random.RandomState(1).randn(5, 8, 8, 3).astype(np.float32)
        self._check(model, x, ["bn1", "bn2"])

    def _channels_first_model(self):
        # Spatial sizes differ from the channel count: Keras 3.15's own
        # channels-first Conv2D adds its bias on the last axis when the two
        # coincide, which would make the unfolded reference itself wrong.
        inputs = keras.Input((3, 9, 7))
        h = keras.layers.Conv2D(4, 3, data_format="channels_first", name="conv")(inputs)
        h = keras_bn.BatchNormalization(axis=1, name="bn_cf")(h)
        h = keras.layers.Conv2D(
            4, 1, activation="relu", data_format="channels_first", name="conv_relu"
        )(h)
        h = keras_bn.BatchNormalization(axis=1, name="bn_after_relu")(h)
        branch = keras.layers.Conv2D(4, 1, data_format="channels_first", name="shared")(h)
        a = keras_bn.BatchNormalization(axis=1, name="bn_shared")(branch)
        outputs = keras.layers.Add()([a, branch])
        return keras.Model(inputs, outputs)

    def test_channels_first_folds_kernel_and_bias_by_formula(self):
        # Runs on every CPU: building and folding never execute the NCHW
        # convolution, so the folded weights are checked against the formula
        # W' = W·s, b' = (b − μ)·s + β with s = γ / √(σ² + ε), per channel.
        model = self._channels_first_model()
        _randomize_statistics(model, 0)
        folded = keras_bn.fold_batch_norm(model)
        conv, bn = model.get_layer("conv"), model.get_layer("bn_cf")
        gamma, beta, mean, variance = (
            np.asarray(v, np.float64)
            for v in (bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance)
        )
        scale = gamma / np.sqrt(variance + bn.epsilon)
        target = folded.get_layer("conv")
        np.testing.assert_allclose(
            target.kernel, np.asarray(conv.kernel, np.float64) * scale, rtol=1e-6
        )
        np.testing.assert_allclose(
            target.bias,
            (np.asarray(conv.bias, np.float64) - mean) * scale + beta,
            rtol=1e-6,
            atol=1e-6,
        )
        self.assertIsInstance(folded.get_layer("bn_cf"), folding.FoldedBatchNorm)
        # A BN after a ReLU, or after a layer with a second consumer, stays.
        for name in ("bn_after_relu", "bn_shared"):
            self.assertIsInstance(folded.get_layer(name), keras_bn.BatchNormalization)
            np.testing.assert_array_equal(
                folded.get_layer(name).moving_mean, model.get_layer(name).moving_mean
            )

    def test_channels_first_conv_outputs_match(self):
        if not _cpu_runs_nchw_conv():
            self.skipTest(
                "TensorFlow runs an NCHW Conv2D on the CPU only with its oneDNN kernels, which "
                "are off on this machine (TF_ENABLE_ONEDNN_OPTS=0 or a CPU it does not "
                "enable them on)"
            )
        x = np.random.RandomState(2).randn(2, 3, 9, 7).astype(np.float32)
        folded = self._check(self._channels_first_model(), x, ["bn_cf"])
        self.assertIsInstance(folded.get_layer("bn_after_relu"), keras_bn.BatchNormalization)

    def test_float64_model_stays_float64(self):
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(7, dtype="float64", name="dense"),
                keras_bn.BatchNormalization(dtype="float64", name="bn"),
            ]
        )
        x = np.random.RandomState(3).randn(4, 5)
        folded = self._check(model, x, ["bn"], rtol=1e-12)
        self.assertEqual(folded.get_layer("dense").kernel.dtype, "float64")
        self.assertEqual(folded.get_layer("dense").bias.dtype, "float64")

    def test_nested_sequential_is_folded(self):
        inner = keras.Sequential(
            [
                keras.Input((6, 6, 3)),
                keras.layers.Conv2D(4, 3, name="inner_conv"),
                keras_bn.BatchNormalization(name="inner_bn"),
                keras.layers.ReLU(),
                keras.layers.Flatten(),
            ],
            name="inner",
        )
        inputs = keras.Input((6, 6, 3))
        h = keras.layers.Dense(3, name="outer_dense")(inner(inputs))
        model = keras.Model(inputs, keras_bn.BatchNormalization(name="outer_bn")(h))
        x = np.random.RandomState(4).randn(3, 6, 6, 3).astype(np.float32)
        folded = self._check(model, x, ["outer_bn"])
        nested = folded.get_layer("inner")
        self.assertIsInstance(nested.get_layer("inner_bn"), folding.FoldedBatchNorm)
        self.assertTrue(nested.get_layer("inner_conv").use_bias)

    def test_keras_application_in_float64(self):
        keras.config.set_dtype_policy("float64")
        try:
            keras.utils.set_random_seed(0)
            application = keras.applications.MobileNetV2(
                input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3
            )
            model = keras_bn.convert_batch_norm(application)
        finally:
            keras.config.set_dtype_policy("float32")
        x = np.random.RandomState(5).rand(2, 32, 32, 3)
        _randomize_statistics(model, 1)
        folded = keras_bn.fold_batch_norm(model)
        expected = model(x, training=False).numpy()
        np.testing.assert_allclose(folded(x), expected, rtol=1e-10, atol=1e-12)
        kinds = [type(layer) for layer in folded.layers]
        # Every Conv2D's BN folds (stem, 16 expansions, 17 projections, the
        # last conv); the 17 depthwise convolutions' BNs stay.
        self.assertEqual(kinds.count(folding.FoldedBatchNorm), 35)
        self.assertEqual(kinds.count(keras_bn.BatchNormalization), 17)
        self.assertEqual(folded.get_layer("Conv1").kernel.dtype, "float64")

    def test_rejects_subclassed_model(self):
        class Net(keras.Model):
            def call(self, x):
                return x

        with self.assertRaisesRegex(ValueError, r"Sequential or functional.*Received: model=Net"):
            keras_bn.fold_batch_norm(Net())


if __name__ == "__main__":
    absltest.main()
