"""The fused kernels against the general path, on the current Keras backend.

With `fused=True` (TensorFlow's FusedBatchNormV3, PyTorch's native kernel)
the layer's outputs, its three gradients and its moving statistics equal
those of `fused=False` (the general path) to float32 rounding, in training
and inference, with the guard, warm-up, `unbiased_variance` and `momentum=None`;
under JAX, which has no fused kernel, and for calls no kernel can express,
`fused=True` raises and `fused=None` takes the general path. `.ci/run` runs
this module under TensorFlow (with oneDNN off and on), JAX and PyTorch.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn
from keras_bn import kernels
from tests import references

BACKEND = keras.backend.backend()
HAS_KERNEL = BACKEND in ("tensorflow", "torch")


def _data(shape, seed):
    return (np.random.RandomState(seed).randn(*shape) * 3.0 + 2.0).astype(np.float32)


def _gradients(layer, x, upstream):
    """`(y, dx, dγ, dβ)` of Σ upstream·layer(x, training=True), as NumPy."""
    if BACKEND == "torch":
        import torch

        v = torch.tensor(x, requires_grad=True)
        y = layer(v, training=True)
        (y * torch.tensor(upstream)).sum().backward()
        grads = [v.grad, layer.gamma.value.grad, layer.beta.value.grad]
        return [y.detach().numpy()] + [g.numpy() for g in grads]
    if BACKEND == "jax":
        import jax

        trainable = [w.value for w in layer.trainable_variables]
        non_trainable = [w.value for w in layer.non_trainable_variables]

        def loss(trainable, x):
            y, _ = layer.stateless_call(trainable, non_trainable, x, training=True)
            return (y * upstream).sum(), y

        (_, y), (dw, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(trainable, x)
        return [np.asarray(a) for a in (y, dx, *dw)]
    import tensorflow as tf

    v = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(v)
        y = layer(v, training=True)
        loss = tf.reduce_sum(y * upstream)
    dx, dgamma, dbeta = tape.gradient(loss, [v, layer.gamma, layer.beta])
    return [a.numpy() for a in (y, dx, dgamma, dbeta)]


def _numpy(variable):
    return keras.ops.convert_to_numpy(variable)


class FusedKernelTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("conv_map", (8, 5, 5, 6), {}),
        ("dense", (32, 7), {}),
        ("sequence", (4, 9, 5), {}),
        ("unbiased_cumulative", (8, 4, 4, 3), {"momentum": None, "unbiased_variance": True}),
        ("warmup", (8, 4, 4, 3), {"momentum_warmup": True, "count_skipped_updates": True}),
        ("no_scale_no_center", (8, 4, 4, 3), {"scale": False, "center": False}),
    )
    def test_fused_matches_the_general_path(self, shape, kwargs):
        if not HAS_KERNEL:
            self.skipTest(f"{BACKEND} has no fused kernel (XLA fuses the general path)")
        x, upstream = _data(shape, 0), _data(shape, 1)
        settings = {"momentum": 0.9, **kwargs}
        layers = {f: keras_bn.BatchNormalization(fused=f, **settings) for f in (True, False)}
        results = {}
        for fused, layer in layers.items():
            layer.build(shape)
            if layer.scale:
                layer.gamma.assign(np.linspace(0.5, 2.0, shape[-1]).astype(np.float32))
            if layer.center:
                layer.beta.assign(np.linspace(-1.0, 1.0, shape[-1]).astype(np.float32))
            if layer.scale and layer.center:
                outputs = _gradients(layer, x, upstream)
            else:
                outputs = [_numpy(layer(x, training=True))]
            layer(x * 0.5 + 1.0, training=True)  # A second update.
            outputs += [_numpy(v) for v in layer.non_trainable_variables]
            outputs.append(_numpy(layer(x, training=False)))
            results[fused] = outputs
        self.assertLen(results[True], len(results[False]))
        for i, (fused, general) in enumerate(zip(results[True], results[False])):
            np.testing.assert_allclose(fused, general, rtol=2e-5, atol=2e-5, err_msg=str(i))

    def test_fused_inference_matches_without_training(self):
        if not HAS_KERNEL:
            self.skipTest(f"{BACKEND} has no fused kernel")
        x = _data((6, 3, 3, 4), 2)
        outputs = []
        for fused in (True, False):
            layer = keras_bn.BatchNormalization(fused=fused)
            layer.build(x.shape)
            layer.moving_mean.assign(np.array([1.0, -2.0, 0.5, 3.0], np.float32))
            layer.moving_variance.assign(np.array([4.0, 0.25, 1.0, 9.0], np.float32))
            outputs.append(_numpy(layer(x, training=False)))
        np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6, atol=1e-6)

    def test_nonfinite_batch_is_skipped_on_the_fused_path(self):
        if not HAS_KERNEL:
            self.skipTest(f"{BACKEND} has no fused kernel")
        layer = keras_bn.BatchNormalization(fused=True, count_skipped_updates=True)
        x = _data((8, 3), 3)
        layer(x, training=True)
        before = _numpy(layer.moving_mean)
        x[0, 1] = np.nan
        layer(x, training=True)
        np.testing.assert_array_equal(_numpy(layer.moving_mean), before)
        self.assertEqual(float(_numpy(layer.skipped_updates)), 1.0)

    def test_under_xla_training_takes_the_general_path(self):
        if BACKEND != "tensorflow":
            self.skipTest("TensorFlow's XLA lowering of the fused op")
        import tensorflow as tf

        # XLA expands the fused training op with Var = E[x²] − E[x]², which
        # loses every digit at |mean|/std = 1e4; the general path does not.
        x = tf.constant((1e4 + np.random.RandomState(7).randn(64, 4, 4, 3)).astype(np.float32))
        layer = keras_bn.BatchNormalization(momentum=0.0)
        layer.build(x.shape)

        @tf.function(jit_compile=True)
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * y * x)
            return y, tape.gradient(loss, x)

        y, dx = step(x)
        np.testing.assert_allclose(np.std(y.numpy(), axis=(0, 1, 2)), 1.0, rtol=2e-3)
        np.testing.assert_allclose(
            layer.moving_variance.numpy(), np.var(x.numpy(), axis=(0, 1, 2)), rtol=1e-3
        )
        self.assertTrue(np.all(np.isfinite(dx.numpy())))
        with self.assertRaisesRegex(ValueError, r"under XLA its training op.*E\[x²\]"):
            tf.function(jit_compile=True)(
                lambda x: keras_bn.BatchNormalization(fused=True)(x, training=True)
            )(x)

    def test_empty_batch_at_run_time_keeps_the_statistics(self):
        if BACKEND != "tensorflow":
            self.skipTest("only TensorFlow traces a batch size unknown until run time")
        import tensorflow as tf

        layer = keras_bn.BatchNormalization(fused=True, skip_nonfinite_updates=False)
        layer.build((None, 2, 2, 3))
        step = tf.function(
            lambda x: layer(x, training=True),
            input_signature=[tf.TensorSpec((None, 2, 2, 3), tf.float32)],
        )
        step(tf.zeros((0, 2, 2, 3)))
        np.testing.assert_array_equal(layer.moving_mean.numpy(), np.zeros(3))
        np.testing.assert_array_equal(layer.moving_variance.numpy(), np.ones(3))

    def test_under_op_determinism_inference_takes_the_general_path(self):
        if BACKEND != "tensorflow":
            self.skipTest("TensorFlow's op determinism")
        x = keras.ops.convert_to_tensor(_data((256, 256), 8))
        with mock.patch.object(kernels, "_op_determinism_enabled", return_value=True):
            self.assertIsNone(kernels.choose(x, (0,), 1e-3, fused=None, training=False))

    @parameterized.named_parameters(
        ("mask", {}, {"mask": np.ones((4, 5), bool)}, r"masks, renorm"),
        ("renorm", {"renorm": True}, {}, r"masks, renorm"),
        ("ghost", {"virtual_batch_size": 2}, {}, r"masks, renorm"),
        ("axis_list", {"axis": [1, 2]}, {}, r"must be one axis, the last"),
        ("small_epsilon", {"epsilon": 1e-6}, {}, r"epsilon=1e-06 is below"),
    )
    def test_fused_true_refuses_what_no_kernel_runs(self, kwargs, call_kwargs, reason):
        if not HAS_KERNEL:
            reason = rf"the {BACKEND} backend has none"
        layer = keras_bn.BatchNormalization(fused=True, **kwargs)
        with self.assertRaisesRegex(ValueError, reason + r".*Received: fused=True"):
            layer(_data((4, 5, 3), 4), training=True, **call_kwargs)
        # The rule (fused=None) takes the general path for the same call.
        keras_bn.BatchNormalization(**kwargs)(_data((4, 5, 3), 4), training=True, **call_kwargs)

    def test_float64_takes_the_general_path(self):
        layer = keras_bn.BatchNormalization(fused=True, dtype="float64")
        reason = r"inputs, not float64" if HAS_KERNEL else r"backend has none"
        with self.assertRaisesRegex(ValueError, reason):
            layer(_data((4, 3), 5).astype(np.float64), training=True)

    def test_a_float64_layer_casts_other_floats_rather_than_take_a_kernel(self):
        # Without autocasting a float32 input reaches the layer as it is: the
        # kernels keep float32 statistics, so it runs the float64 general path.
        if keras.backend.standardize_dtype(keras.ops.ones(1, dtype="float64").dtype) != "float64":
            self.skipTest("JAX holds float64 only with JAX_ENABLE_X64=1")
        layer = keras_bn.BatchNormalization(dtype="float64", autocast=False)
        x = _data((64, 16, 16, 8), 2)
        y = keras.ops.convert_to_numpy(layer(x, training=True))
        self.assertEqual(y.dtype, np.float64)
        want = references.reference_batch_norm(x, 1.0, 0.0, (-1,), 1e-3)
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)

    def test_fused_argument_is_validated_and_serialised(self):
        with self.assertRaisesRegex(TypeError, r"Received: fused='yes'"):
            keras_bn.BatchNormalization(fused="yes")
        config = keras_bn.BatchNormalization(fused=False).get_config()
        self.assertIs(config["fused"], False)
        self.assertIs(keras_bn.BatchNormalization.from_config(config).fused, False)

    def test_the_rule_is_one_function_of_the_platform(self):
        large = keras.ops.convert_to_tensor(_data((256, 256), 6))
        small = keras.ops.convert_to_tensor(_data((256, 100), 6))
        picked = {
            name: kernels.choose(x, (0,), 1e-3, fused=None, training=True) is not None
            for name, x in (("large", large), ("small", small))
        }
        if BACKEND == "torch":
            self.assertEqual(picked, {"large": True, "small": True})
        elif BACKEND == "jax":
            self.assertEqual(picked, {"large": False, "small": False})
        else:
            import tensorflow as tf

            gpu = bool(tf.config.list_logical_devices("GPU"))
            onednn = kernels.tensorflow_onednn_enabled()
            # On a oneDNN CPU only inputs of 2^16 values or more.
            self.assertEqual(picked, {"large": gpu or onednn, "small": gpu})
        self.assertIsNone(kernels.choose(large, (0,), 1e-3, fused=False, training=True))

    @parameterized.named_parameters(
        # (oneDNN, dtype, channels first, training): whether the rule picks the kernel.
        ("onednn_bfloat16", True, "bfloat16", False, True, True),
        ("onednn_float16", True, "float16", False, False, True),
        ("onednn_nchw_training", True, "float32", True, True, True),
        ("onednn_nchw_inference", True, "float32", True, False, False),
        ("onednn_nchw_float16", True, "float16", True, True, False),
        ("plain_cpu_float32", False, "float32", False, True, False),
        ("plain_cpu_bfloat16", False, "bfloat16", False, True, True),
        ("plain_cpu_nchw", False, "float32", True, True, False),
    )
    def test_tensorflow_cpu_rule_per_dtype_and_layout(
        self, onednn, dtype, channels_first, training, picked
    ):
        if BACKEND != "tensorflow":
            self.skipTest("TensorFlow's CPU rule")
        shape, axes = (
            ((64, 16, 16, 16), (0, 2, 3)) if channels_first else ((64, 16, 16, 16), (0, 1, 2))
        )
        x = keras.ops.cast(_data(shape, 3), dtype)
        with (
            mock.patch.object(kernels, "tensorflow_onednn_enabled", return_value=onednn),
            mock.patch.object(kernels, "_tensorflow_has_gpu", return_value=False),
        ):
            kernel = kernels.choose(x, axes, 1e-3, fused=None, training=training)
        self.assertEqual(kernel is not None, picked)


class MergedMomentsKernelTest(parameterized.TestCase):
    """`kernels.choose_for_merged_moments`: the ops a synchronised call takes after its merge.

    Their numbers against the general path under MirroredStrategy are in
    `synchronized_test.py`; the conformance matrix runs them (`sync_fused`).
    """

    @parameterized.named_parameters(
        ("float64", (64, 4, 4, 8), "float64", (0, 1, 2), 1e-3, r"float32 statistics, not float64"),
        ("channels_first", (64, 8, 4, 4), "float32", (0, 2, 3), 1e-3, r"must be the last axis"),
        ("small_epsilon", (64, 4, 4, 8), "float32", (0, 1, 2), 1e-6, r"epsilon=1e-06 is below"),
    )
    def test_fused_true_refuses_what_the_ops_cannot_run(self, shape, dtype, axes, epsilon, reason):
        if BACKEND != "tensorflow":
            reason = r"its merged-moments ops are TensorFlow's"
        x = keras.ops.convert_to_tensor(_data(shape, 9).astype(dtype))
        with self.assertRaisesRegex(ValueError, reason + r".*Received: fused=True"):
            kernels.choose_for_merged_moments(x, axes, epsilon, fused=True)
        self.assertIsNone(kernels.choose_for_merged_moments(x, axes, epsilon, fused=None))

    def test_fused_true_refuses_under_xla(self):
        if BACKEND != "tensorflow":
            self.skipTest("TensorFlow's XLA")
        import tensorflow as tf

        x = tf.constant(_data((64, 4, 4, 8), 10))
        with self.assertRaisesRegex(ValueError, r"under XLA, which fuses the general path"):
            tf.function(jit_compile=True)(
                lambda x: kernels.choose_for_merged_moments(x, (0, 1, 2), 1e-3, fused=True)
            )(x)

    def test_fused_true_refuses_under_op_determinism(self):
        if BACKEND != "tensorflow":
            self.skipTest("TensorFlow's op determinism")
        x = keras.ops.convert_to_tensor(_data((64, 4, 4, 8), 11))
        with mock.patch.object(kernels, "_op_determinism_enabled", return_value=True):
            with self.assertRaisesRegex(ValueError, r"under op determinism its gradient op"):
                kernels.choose_for_merged_moments(x, (0, 1, 2), 1e-3, fused=True)

    def test_the_rule_takes_them_where_the_fused_kernel_is_faster(self):
        large = keras.ops.convert_to_tensor(_data((64, 16, 16, 16), 12))
        small = keras.ops.convert_to_tensor(_data((8, 4, 4, 16), 12))
        picked = {
            name: kernels.choose_for_merged_moments(x, (0, 1, 2), 1e-3, fused=None) is not None
            for name, x in (("large", large), ("small", small))
        }
        if BACKEND != "tensorflow":
            self.assertEqual(picked, {"large": False, "small": False})
        else:
            import tensorflow as tf

            gpu = bool(tf.config.list_logical_devices("GPU"))
            onednn = kernels.tensorflow_onednn_enabled()
            self.assertEqual(picked, {"large": gpu or onednn, "small": gpu})
        self.assertIsNone(kernels.choose_for_merged_moments(large, (0, 1, 2), 1e-3, fused=False))


if __name__ == "__main__":
    absltest.main()
