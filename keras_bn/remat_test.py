"""Rematerialisation (`keras.RematScope`): one update of the moving statistics per step.

Gradient checkpointing runs a checkpointed region's forward pass again in the
backward pass. On PyTorch the second run is Python's, so a layer that updates
its statistics in `call` would update them again (Keras 3.15's own layer:
1.9× the single update from zero with the layer in the scope, 2.71× with the
model in it too, momentum 0.9). The test runs one `fit` step from zero
statistics and checks that the moving mean moved once. It runs on every
backend where Keras' remat runs a `fit` step of Keras' own layer; elsewhere
it is skipped with Keras' error (TensorFlow and JAX in Keras 3.15).
"""

import re

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn

_MOMENTUM = 0.9


def _fit_one_step(make_layer, scope_holds_model, mode):
    """The layer `make_layer()` makes, after one `fit` step under a RematScope of `mode`."""
    kwargs = {"output_size_threshold": 1} if mode == "larger_than" else {}
    x = np.random.default_rng(0).normal(3.0, 1.0, (32, 6)).astype("float32")
    with keras.RematScope(mode=mode, **kwargs):
        layer = make_layer()
        if scope_holds_model:  # The model itself rematerialised: its whole forward runs again.
            model = _model(layer)
    if not scope_holds_model:
        model = _model(layer)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(x, np.zeros((32, 1), "float32"), batch_size=32, epochs=1, verbose=0)
    return layer, x


def _model(layer):
    dense = keras.layers.Dense(6, kernel_initializer="identity", use_bias=False)
    return keras.Sequential([keras.Input((6,)), dense, layer, keras.layers.Dense(1)])


class RematTest(parameterized.TestCase):
    @parameterized.product(scope_holds_model=(False, True), mode=("full", "larger_than"))
    def test_one_step_moves_the_statistics_once(self, scope_holds_model, mode):
        try:
            _fit_one_step(
                lambda: keras.layers.BatchNormalization(momentum=_MOMENTUM),
                scope_holds_model,
                mode,
            )
        except Exception as error:  # Keras' own layer does not train so: nothing to match.
            lines = [
                line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
            ]
            cause = next(
                (line for line in lines if line and not line.startswith("Exception encountered")),
                lines[0],
            )
            self.skipTest(f"Keras {keras.__version__}'s RematScope fails in fit here: {cause}")
        layer, x = _fit_one_step(
            lambda: keras_bn.BatchNormalization(momentum=_MOMENTUM), scope_holds_model, mode
        )
        np.testing.assert_allclose(
            layer.moving_mean.numpy(), (1 - _MOMENTUM) * x.mean(0), rtol=1e-6
        )
        variance = _MOMENTUM + (1 - _MOMENTUM) * x.var(0)
        np.testing.assert_allclose(layer.moving_variance.numpy(), variance, rtol=1e-5)


if __name__ == "__main__":
    absltest.main()
