"""Dtype policies: which dtype each weight has, and 16-bit moving statistics that stall.

γ and β have the policy's variable dtype, as every Keras layer's trainable
weights; the moving statistics have `statistics_dtype`: float32, or float64
under a float64 policy, never 16 bits. Runs on every backend (`.ci/run`
runs it on each); weight files, conversion and folding under `bfloat16` are
in their own modules' tests.
"""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn
from tests import moving_averages

# (policy, dtype of γ and β, dtype of the moving statistics)
POLICIES = (
    ("float32", "float32", "float32"),
    ("mixed_bfloat16", "float32", "float32"),
    ("mixed_float16", "float32", "float32"),
    ("bfloat16", "bfloat16", "float32"),
    ("float16", "float16", "float32"),
)


def _numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value), np.float64)


class PolicyTest(parameterized.TestCase):
    @parameterized.named_parameters(*((p, p, a, s) for p, a, s in POLICIES))
    def test_weight_dtypes(self, policy, affine_dtype, statistics_dtype):
        layer = keras_bn.BatchNormalization(dtype=policy, momentum=None, renorm=True)
        x = np.random.RandomState(0).randn(8, 3).astype(np.float32)
        y = layer(keras.ops.cast(x, layer.compute_dtype), training=True)
        self.assertEqual(keras.backend.standardize_dtype(y.dtype), layer.compute_dtype)
        self.assertEqual(layer.statistics_dtype, statistics_dtype)
        # The trainable weights have the policy's variable dtype, as in every Keras layer.
        self.assertEqual(layer.variable_dtype, affine_dtype)
        self.assertEqual([w.name for w in layer.trainable_weights], ["gamma", "beta"])
        for weight in layer.trainable_weights:
            self.assertEqual(weight.dtype, affine_dtype, weight.name)
        # Every statistic and counter (renorm's and momentum=None's included).
        self.assertLen(layer.non_trainable_weights, 6)
        for weight in layer.non_trainable_weights:
            self.assertEqual(weight.dtype, statistics_dtype, weight.name)

    @parameterized.named_parameters(("bfloat16", "bfloat16"), ("float16", "float16"))
    def test_16_bit_weights_learn(self, policy):
        keras.utils.set_random_seed(0)
        x = np.random.RandomState(1).randn(16, 3).astype(np.float32)
        layer = keras_bn.BatchNormalization(dtype=policy)
        model = keras.Sequential([keras.Input((3,)), layer])
        model.compile(keras.optimizers.SGD(0.5), "mse")
        model.fit(x, np.full_like(x, 2.0), batch_size=16, epochs=3, verbose=0)
        # β moves towards the target's mean; both stay in the policy's dtype.
        self.assertTrue(np.all(_numpy(layer.beta) > 0.5), _numpy(layer.beta))
        self.assertEqual(layer.beta.dtype, policy)
        self.assertEqual(layer.gamma.dtype, policy)

    def test_bfloat16_moving_mean_converges_where_keras_one_stalls(self):
        """Keras' layer keeps bfloat16 moving statistics: (1 − 0.99)·(x − moving) rounds away.

        Near 0.8 a bfloat16 step is 2⁻⁸ ≈ 0.0039, so an update of 0.01·(1 −
        0.8) = 0.002 no longer moves the value. keras_bn's float32 moving
        mean follows the exact average μ·(1 − 0.99ⁿ) of n equal batches.
        """
        steps = 300
        x = (np.random.RandomState(2).randn(32, 4) * 0.1 + 1.0).astype(np.float32)
        batch_mean = _numpy(keras.ops.cast(x, "bfloat16")).mean(0)  # The layers' input.
        expected = batch_mean * (1.0 - 0.99**steps)
        ours = moving_averages.moving_mean_after(
            keras_bn.BatchNormalization(momentum=0.99, dtype="bfloat16"), x, steps
        )
        # Within half a bfloat16 step: Keras 3.10 under JAX hands the layer the
        # float32 input uncast (0.04% off); Keras 3.15 the bfloat16 one (exact to 1e-6).
        np.testing.assert_allclose(ours, expected, rtol=2**-9)
        theirs = moving_averages.moving_mean_after(
            keras.layers.BatchNormalization(momentum=0.99, dtype="bfloat16"), x, steps
        )
        # Measured with Keras 3.15.1: about 0.81 on every backend, against 0.95 expected.
        self.assertTrue(np.all(theirs < 0.9 * expected), (theirs, expected))


if __name__ == "__main__":
    absltest.main()
