"""Tests of keras_bn.fold_batch_norm."""

import os
import tempfile

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


def _numpy(value, dtype=None):
    """`value` (a backend tensor or variable) as a NumPy array, of `dtype` if given."""
    return np.asarray(keras.ops.convert_to_numpy(value), dtype)


def _skip_without_float64(test):
    """Skips `test` under JAX without `JAX_ENABLE_X64`, where float64 arrays are float32."""
    if keras.backend.backend() == "jax":
        import jax

        if not jax.config.read("jax_enable_x64"):
            test.skipTest("JAX computes float64 only with JAX_ENABLE_X64=1")


def _cpu_runs_nchw_conv():
    """Whether this machine's backend can run a channels-first Conv2D on the CPU.

    TensorFlow can with its oneDNN kernels only; JAX and PyTorch always can.
    """
    if keras.backend.backend() != "tensorflow":
        return True
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
        # In float64: NumPy 1.26 cannot compare bfloat16 arrays.
        expected = _numpy(model(x, training=False), np.float64)
        np.testing.assert_allclose(
            _numpy(folded(x), np.float64), expected, rtol=rtol, atol=rtol * np.abs(expected).max()
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

    def test_folded_model_saves_and_loads(self):
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(4, use_bias=False, name="dense"),
                keras_bn.BatchNormalization(name="bn", dtype="mixed_bfloat16"),
                keras.layers.Activation("sigmoid"),
            ]
        )
        x = np.random.RandomState(2).randn(3, 6).astype(np.float32)
        folded = self._check(model, x, ["bn"], rtol=1e-2)
        path = os.path.join(tempfile.mkdtemp(), "folded.keras")
        folded.save(path)
        loaded = keras.saving.load_model(path)
        self.assertIsInstance(loaded.get_layer("bn"), folding.FoldedBatchNorm)
        self.assertEqual(loaded.get_layer("bn").dtype_policy.name, "mixed_bfloat16")
        np.testing.assert_array_equal(_numpy(loaded(x)), _numpy(folded(x)))

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
        outputs = keras.layers.Add(name="add")([a, branch])
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
            _numpy(v, np.float64) for v in (bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance)
        )
        scale = gamma / np.sqrt(variance + bn.epsilon)
        target = folded.get_layer("conv")
        np.testing.assert_allclose(
            _numpy(target.kernel), _numpy(conv.kernel, np.float64) * scale, rtol=1e-6
        )
        np.testing.assert_allclose(
            _numpy(target.bias),
            (_numpy(conv.bias, np.float64) - mean) * scale + beta,
            rtol=1e-6,
            atol=1e-6,
        )
        self.assertIsInstance(folded.get_layer("bn_cf"), folding.FoldedBatchNorm)
        # A BN after a ReLU folds into the 1×1 convolution it alone feeds.
        self.assertIsInstance(folded.get_layer("bn_after_relu"), folding.FoldedBatchNorm)
        # A BN after a layer with a second consumer, feeding an Add, stays.
        self.assertIsInstance(folded.get_layer("bn_shared"), keras_bn.BatchNormalization)
        np.testing.assert_array_equal(
            _numpy(folded.get_layer("bn_shared").moving_mean),
            _numpy(model.get_layer("bn_shared").moving_mean),
        )
        self.assertEqual(
            keras_bn.folding_plan(model),
            {
                "bn_cf": "folded into conv, its input",
                "bn_after_relu": "folded into shared, its consumer",
                "bn_shared": "kept: its input shared is called more than once or has other "
                "consumers; its output goes to add (Add)",
            },
        )

    def test_channels_first_conv_outputs_match(self):
        if not _cpu_runs_nchw_conv():
            self.skipTest(
                "TensorFlow runs an NCHW Conv2D on the CPU only with its oneDNN kernels, which "
                "are off on this machine (TF_ENABLE_ONEDNN_OPTS=0 or a CPU it does not "
                "enable them on)"
            )
        x = np.random.RandomState(2).randn(2, 3, 9, 7).astype(np.float32)
        folded = self._check(self._channels_first_model(), x, ["bn_cf", "bn_after_relu"])
        self.assertIsInstance(folded.get_layer("bn_shared"), keras_bn.BatchNormalization)

    def test_float64_model_stays_float64(self):
        _skip_without_float64(self)
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(7, dtype="float64", name="dense"),
                keras_bn.BatchNormalization(dtype="float64", name="bn"),
            ]
        )
        x = np.random.RandomState(3).randn(4, 5)
        # Keras' own float64 Dense on PyTorch is off by about 1.5e-7 (measured
        # against NumPy with Keras 3.15.1 and torch 2.13.0 on a CPU).
        rtol = 1e-6 if keras.backend.backend() == "torch" else 1e-12
        folded = self._check(model, x, ["bn"], rtol=rtol)
        self.assertEqual(folded.get_layer("dense").kernel.dtype, "float64")
        self.assertEqual(folded.get_layer("dense").bias.dtype, "float64")

    def test_bfloat16_model_stays_bfloat16(self):
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(7, dtype="bfloat16", name="dense"),
                keras_bn.BatchNormalization(dtype="bfloat16", name="bn"),
            ]
        )
        x = np.random.RandomState(3).randn(4, 5).astype(np.float32)
        # The folded kernel is rounded to bfloat16 (2⁻⁸ relative) where the model's
        # BN computed in float32: outputs agree to bfloat16's precision.
        folded = self._check(model, x, ["bn"], rtol=3e-2)
        dense = folded.get_layer("dense")
        self.assertEqual((dense.kernel.dtype, dense.bias.dtype), ("bfloat16", "bfloat16"))
        bn, original = model.get_layer("bn"), model.get_layer("dense")
        gamma, beta, mean, variance = (
            _numpy(v, np.float64) for v in (bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance)
        )
        scale = gamma / np.sqrt(variance + bn.epsilon)
        kernel = _numpy(original.kernel, np.float64) * scale
        bias = (_numpy(original.bias, np.float64) - mean) * scale + beta
        for variable, exact in ((dense.kernel, kernel), (dense.bias, bias)):
            # Rounded once; compared in float32 (NumPy 1.26 cannot compare bfloat16 arrays).
            np.testing.assert_array_equal(
                _numpy(variable, np.float32), exact.astype("bfloat16").astype(np.float32)
            )

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
        _skip_without_float64(self)
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
        expected = _numpy(model(x, training=False))
        np.testing.assert_allclose(_numpy(folded(x)), expected, rtol=1e-10, atol=1e-12)
        kinds = [type(layer) for layer in folded.layers]
        # Every BN folds: those of the Conv2Ds (stem, 16 expansions, 17
        # projections, the last conv) and of the 17 depthwise convolutions.
        self.assertEqual(kinds.count(folding.FoldedBatchNorm), 52)
        self.assertEqual(kinds.count(keras_bn.BatchNormalization), 0)
        self.assertEqual(folded.get_layer("Conv1").kernel.dtype, "float64")

    def test_keras_application_in_float32(self):
        keras.utils.set_random_seed(0)
        application = keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3
        )
        x = np.random.RandomState(5).rand(2, 32, 32, 3).astype(np.float32)
        model = keras_bn.convert_batch_norm(application)
        names = [x.name for x in model.layers if isinstance(x, keras_bn.BatchNormalization)]
        self.assertLen(names, 52)
        self._check(model, x, names)

    def test_pre_activation_resnet_block(self):
        # He et al. (2016b): BN → ReLU → conv → BN → ReLU → conv, plus the input.
        inputs = keras.Input((8, 8, 4))
        h = keras_bn.BatchNormalization(name="bn_in")(inputs)
        h = keras.layers.ReLU(name="relu_in")(h)
        h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv1")(h)
        h = keras_bn.BatchNormalization(name="bn_mid")(h)
        h = keras.layers.ReLU(name="relu_mid")(h)
        h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv2")(h)
        model = keras.Model(inputs, keras.layers.Add(name="add")([inputs, h]))
        x = np.random.RandomState(6).randn(3, 8, 8, 4).astype(np.float32)
        self._check(model, x, ["bn_mid"])
        self.assertEqual(
            keras_bn.folding_plan(model)["bn_in"],
            "kept: its input is a model input; its output goes to relu_in (ReLU)",
        )

    @parameterized.named_parameters(
        ("conv1d_transpose", keras.layers.Conv1DTranspose(5, 3, strides=2), (9, 3)),
        ("conv2d_transpose", keras.layers.Conv2DTranspose(5, 3, strides=2), (6, 5, 3)),
        ("conv3d_transpose", keras.layers.Conv3DTranspose(5, 2), (4, 3, 5, 3)),
        ("depthwise1d", keras.layers.DepthwiseConv1D(3, depth_multiplier=2), (9, 3)),
        ("depthwise2d", keras.layers.DepthwiseConv2D(3, depth_multiplier=2), (6, 5, 3)),
        ("separable1d", keras.layers.SeparableConv1D(5, 3, depth_multiplier=2), (9, 3)),
        ("separable2d", keras.layers.SeparableConv2D(5, 3, use_bias=False), (6, 5, 3)),
    )
    def test_folds_after_every_linear_layer(self, layer, shape):
        inputs = keras.Input(shape)
        bn = keras_bn.BatchNormalization(name="bn")
        model = keras.Model(inputs, bn(layer(inputs)))
        x = np.random.RandomState(7).randn(2, *shape).astype(np.float32)
        self._check(model, x, ["bn"])
        self.assertEqual(
            keras_bn.folding_plan(model), {"bn": f"folded into {layer.name}, its input"}
        )

    @parameterized.named_parameters(
        ("dense", keras.layers.Dense(5), (6,)),
        ("dense_rank3", keras.layers.Dense(5), (4, 6)),
        ("conv1d_strided", keras.layers.Conv1D(5, 3, strides=2), (9, 3)),
        ("conv2d_dilated", keras.layers.Conv2D(5, 3, dilation_rate=2), (7, 8, 3)),
        ("conv3d", keras.layers.Conv3D(5, 2, use_bias=False), (4, 3, 5, 3)),
    )
    def test_folds_before_a_linear_layer_without_padding(self, layer, shape):
        inputs = keras.Input(shape)
        h = keras.layers.Activation("tanh")(inputs)  # Not foldable: the BN folds forward.
        model = keras.Model(inputs, layer(keras_bn.BatchNormalization(name="bn")(h)))
        x = np.random.RandomState(8).randn(2, *shape).astype(np.float32)
        self._check(model, x, ["bn"])
        self.assertEqual(
            keras_bn.folding_plan(model), {"bn": f"folded into {layer.name}, its consumer"}
        )

    def test_one_layer_takes_a_fold_on_each_side(self):
        inputs = keras.Input((7, 3))
        h = keras_bn.BatchNormalization(name="bn_before")(inputs)
        h = keras.layers.Conv1D(4, 2, name="conv")(h)
        model = keras.Model(inputs, keras_bn.BatchNormalization(name="bn_after")(h))
        x = np.random.RandomState(9).randn(2, 7, 3).astype(np.float32)
        self._check(model, x, ["bn_before", "bn_after"])

    def test_padding_groups_and_activations_keep_the_layer_and_say_why(self):
        inputs = keras.Input((6, 6, 4))
        a = keras_bn.BatchNormalization(name="bn_padded")(inputs)
        a = keras.layers.Conv2D(4, 3, padding="same", name="same")(a)
        b = keras_bn.BatchNormalization(name="bn_grouped")(inputs)
        b = keras.layers.Conv2D(4, 1, groups=2, name="grouped")(b)
        c = keras.layers.Conv2D(4, 1, activation="relu", name="relu_conv")(inputs)
        c = keras_bn.BatchNormalization(name="bn_relu")(c)
        model = keras.Model(inputs, [a, b, c])
        self.assertEqual(
            keras_bn.folding_plan(model),
            {
                "bn_padded": "kept: its input is a model input; its consumer same pads (its "
                "zeros would not be normalised) or groups",
                "bn_grouped": "kept: its input is a model input; its consumer grouped pads (its "
                "zeros would not be normalised) or groups",
                "bn_relu": "kept: its input relu_conv has activation relu; its output has "
                "several consumers or is a model output",
            },
        )
        x = np.random.RandomState(10).randn(2, 6, 6, 4).astype(np.float32)
        folded = keras_bn.fold_batch_norm(model)
        for got, expected in zip(folded(x), model(x, training=False)):
            np.testing.assert_allclose(_numpy(got), _numpy(expected), rtol=1e-6, atol=1e-6)

    def test_batch_statistics_at_inference_keep_the_layer(self):
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, name="dense"),
                keras_bn.BatchNormalization(statistics="batch", name="bn_batch"),
                keras_bn.BatchNormalization(statistics="moving", name="bn_frozen"),
            ]
        )
        plan = keras_bn.folding_plan(model)
        self.assertEqual(
            plan["bn_batch"], "kept: statistics='batch' normalises with batch statistics"
        )
        self.assertIn("kept", plan["bn_frozen"])  # Its input is the kept layer.
        x = np.random.RandomState(11).randn(6, 4).astype(np.float32) * 3.0 + 1.0
        folded = keras_bn.fold_batch_norm(model)
        np.testing.assert_allclose(
            _numpy(folded(x)), _numpy(model(x, training=False)), rtol=1e-5, atol=1e-5
        )

    def test_operations_subclasses_and_quantized_or_lora_layers_keep_their_layers(self):
        class Standardized(keras.layers.Dense):
            """A Dense whose call rescales its kernel: a fold into it would be undone."""

            def call(self, x):
                kernel = self.kernel / keras.ops.std(self.kernel)
                return keras.ops.matmul(x, kernel) + self.bias

        inputs = keras.Input((6,), name="x")
        a = keras_bn.BatchNormalization(name="bn_op")(keras.ops.tanh(inputs))
        a = a + inputs  # Operations of a functional graph are not layers.
        b = Standardized(6, name="standardized")(inputs)
        b = keras_bn.BatchNormalization(name="bn_subclass")(b)
        quantized = keras.layers.Dense(6, name="quantized")
        c = keras_bn.BatchNormalization(name="bn_quantized")(quantized(inputs))
        lora = keras.layers.Dense(6, name="lora")
        d = keras_bn.BatchNormalization(name="bn_lora")(lora(inputs))
        model = keras.Model(inputs, [a, b, c, d])
        quantized.quantize("int8")
        lora.enable_lora(2)
        plan = keras_bn.folding_plan(model)
        self.assertRegex(
            plan["bn_op"],
            r"^kept: its input comes from tanh(_\d+)?, an operation; its output goes to "
            r"add(_\d+)?, an operation$",
        )
        self.assertRegex(
            plan["bn_subclass"],
            r"^kept: its input comes from standardized "
            r"\(Standardized\)",
        )
        self.assertRegex(plan["bn_quantized"], r"^kept: its input quantized is quantized \(int8\)")
        self.assertRegex(plan["bn_lora"], r"^kept: its input lora has LoRA weights")
        _randomize_statistics(model, 2)
        x = np.random.RandomState(11).randn(3, 6).astype(np.float32)
        folded = keras_bn.fold_batch_norm(model)
        self.assertFalse(any(isinstance(x, folding.FoldedBatchNorm) for x in folded.layers))
        for got, expected in zip(folded(x), model(x, training=False)):
            np.testing.assert_allclose(_numpy(got), _numpy(expected), rtol=1e-6, atol=1e-6)

    def test_rejects_subclassed_model(self):
        class Net(keras.Model):
            def call(self, x):
                return x

        with self.assertRaisesRegex(ValueError, r"Sequential or functional.*Received: model=Net"):
            keras_bn.fold_batch_norm(Net())


if __name__ == "__main__":
    absltest.main()
