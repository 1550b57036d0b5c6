"""The update rule as a layer applies it: `moving_statistics.assign` on every backend.

`assign` writes `update`'s values; on PyTorch its common case runs in native
torch operations, which must give the same values, skips and counts. Runs on
every backend (`.ci/run` runs it on each).
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn
from keras_bn import moving_statistics

C = 5


def _numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value), np.float64)


def _variables(seed, dtype="float32"):
    rng = np.random.RandomState(seed)
    values = {
        "moving_mean": rng.randn(C),
        "moving_variance": rng.uniform(0.5, 2.0, C),
        "skipped_updates": np.array(2.0),
    }
    return {
        name: keras.Variable(value.astype(dtype), trainable=False, name=name)
        for name, value in values.items()
    }


def _skip_without_float64(test, dtype):
    if dtype == "float64" and keras.backend.backend() == "jax":
        import jax

        if not jax.config.read("jax_enable_x64"):
            test.skipTest("JAX computes float64 only with JAX_ENABLE_X64=1")


class AssignTest(parameterized.TestCase):
    @parameterized.product(
        momentum=(0.9, 0.3),
        unbiased_variance=(False, True),
        batch=("finite", "nan_mean", "inf_variance"),
        dtype=("float32", "float64"),
    )
    def test_assign_writes_the_rule_values(self, momentum, unbiased_variance, batch, dtype):
        _skip_without_float64(self, dtype)
        rule = moving_statistics.Rule(
            momentum=momentum,
            unbiased_variance=unbiased_variance,
            epsilon=1e-3,
            skip_nonfinite=True,
            count_skipped=True,
        )
        rng = np.random.RandomState(1)
        mean, variance = rng.randn(C), rng.uniform(0.1, 3.0, C)
        if batch == "nan_mean":
            mean[2] = np.nan
        elif batch == "inf_variance":
            variance[0] = np.inf
        mean, variance = (keras.ops.convert_to_tensor(v.astype(dtype)) for v in (mean, variance))
        variables = _variables(0, dtype)
        before = {name: _numpy(v) for name, v in variables.items()}
        expected = moving_statistics.update(
            rule, {n: v.value for n, v in variables.items()}, mean, variance, 16
        )
        moving_statistics.assign(rule, variables, mean, variance, 16)
        # Rounding of O(1) operands (PyTorch's `lerp` rounds s + (b − s)·r as
        # b − (b − s)·(1 − r) for r ≥ 0.5): absolute as well as relative.
        tolerance = 1e-6 if dtype == "float32" else 1e-14
        for name, variable in variables.items():
            np.testing.assert_allclose(
                _numpy(variable),
                _numpy(expected[name]),
                rtol=tolerance,
                atol=tolerance,
                err_msg=name,
            )
            self.assertEqual(variable.dtype, dtype)
        if batch != "finite":  # Skipped: the statistics exactly as they were, one more skip.
            for name in ("moving_mean", "moving_variance"):
                np.testing.assert_array_equal(_numpy(variables[name]), before[name])
            self.assertEqual(_numpy(variables["skipped_updates"]), 3.0)
        else:
            self.assertEqual(_numpy(variables["skipped_updates"]), 2.0)

    def test_a_stateless_call_leaves_the_variables_alone(self):
        layer = keras_bn.BatchNormalization(momentum=0.5)
        x = np.random.RandomState(2).randn(8, C).astype(np.float32) + 3.0
        layer.build(x.shape)
        before = [_numpy(v) for v in layer.non_trainable_variables]
        with keras.StatelessScope() as scope:
            layer(x, training=True)
        for variable, value in zip(layer.non_trainable_variables, before):
            np.testing.assert_array_equal(_numpy(variable), value)
        new_mean = _numpy(scope.get_current_value(layer.moving_mean))
        np.testing.assert_allclose(new_mean, 0.5 * x.mean(0), rtol=1e-5)

    def test_stateless_call_leaves_the_state_it_was_given_alone(self):
        # On PyTorch the update writes the variables' tensors in place outside
        # a scope; in `stateless_call` those are the caller's, returned anew.
        layer = keras_bn.BatchNormalization(momentum=0.5)
        x = np.random.RandomState(4).randn(8, C).astype(np.float32) + 3.0
        layer.build(x.shape)
        trainable = [v.value for v in layer.trainable_variables]
        given = [keras.ops.copy(v.value) for v in layer.non_trainable_variables]
        before = [_numpy(v) for v in given]
        _, returned = layer.stateless_call(trainable, given, x, training=True)
        for value, expected in zip(given, before):
            np.testing.assert_array_equal(_numpy(value), expected)
        for variable, expected in zip(layer.non_trainable_variables, before):
            np.testing.assert_array_equal(_numpy(variable), expected)
        names = [v.name for v in layer.non_trainable_variables]
        new_mean = _numpy(returned[names.index("moving_mean")])
        np.testing.assert_allclose(new_mean, 0.5 * x.mean(0), rtol=1e-5)

    def test_pytorch_moves_the_statistics_in_place_outside_a_scope(self):
        # The fast path: no `Variable.assign` (its per-call conversions), the same tensors.
        if keras.backend.backend() != "torch":
            self.skipTest("the in-place update is PyTorch's")
        layer = keras_bn.BatchNormalization(momentum=0.5)
        x = np.random.RandomState(5).randn(8, C).astype(np.float32) + 3.0
        layer.build(x.shape)
        tensors = [layer.moving_mean.value, layer.moving_variance.value]
        with mock.patch.object(keras.Variable, "assign", side_effect=AssertionError("assigned")):
            layer(x, training=True)
        self.assertIs(layer.moving_mean.value, tensors[0])
        self.assertIs(layer.moving_variance.value, tensors[1])
        np.testing.assert_allclose(_numpy(layer.moving_mean), 0.5 * x.mean(0), rtol=1e-5)

    def test_a_layer_skips_a_non_finite_batch_and_counts_it(self):
        layer = keras_bn.BatchNormalization(momentum=0.5, count_skipped_updates=True)
        x = np.random.RandomState(3).randn(8, C).astype(np.float32)
        layer(x, training=True)
        before = [_numpy(layer.moving_mean), _numpy(layer.moving_variance)]
        x[1, 3] = np.nan
        layer(x, training=True)
        np.testing.assert_array_equal(_numpy(layer.moving_mean), before[0])
        np.testing.assert_array_equal(_numpy(layer.moving_variance), before[1])
        self.assertEqual(_numpy(layer.skipped_updates), 1.0)


if __name__ == "__main__":
    absltest.main()
