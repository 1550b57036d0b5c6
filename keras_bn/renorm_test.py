"""Batch Renormalization (Ioffe 2017) against a float64 NumPy reference."""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from keras_bn import batch_normalization

BatchNormalization = batch_normalization.BatchNormalization
EPSILON = 1e-3


class Reference:
    """Keras' renorm semantics in float64, one training step at a time."""

    def __init__(self, channels, momentum, renorm_momentum, clipping):
        self.momentum, self.renorm_momentum, self.clipping = momentum, renorm_momentum, clipping
        self.moving_mean = np.zeros(channels)
        self.moving_stddev = np.ones(channels)
        self.renorm_mean = np.zeros(channels)
        self.renorm_stddev = np.ones(channels)

    def step(self, x, w, upstream, gamma, beta, axes):
        """Returns (y, d loss/dx) of loss = Σ y·w, r and d held constant."""
        count = w.sum(axes)
        mean = (w * x).sum(axes) / count
        variance = (w * (x - mean) ** 2).sum(axes) / count
        stddev = np.sqrt(variance + EPSILON)
        r = stddev / np.maximum(self.renorm_stddev, np.sqrt(EPSILON))
        d = (mean - self.renorm_mean) / np.maximum(self.renorm_stddev, np.sqrt(EPSILON))
        r = np.clip(r, self.clipping.get("rmin", 0.0), self.clipping.get("rmax", np.inf))
        d = np.clip(d, -self.clipping.get("dmax", np.inf), self.clipping.get("dmax", np.inf))
        x_hat = (x - mean) / stddev
        y = gamma * (x_hat * r + d) + beta
        # Gradient of Σ y·g (g = `upstream`) through x̂ only (r, d constant):
        # every output, masked or not, depends on the unmasked values through
        # μ and σ, so the sums run over all positions and the correction
        # reaches the unmasked values only.
        g = upstream * gamma * r
        dx = (g - w * (g.sum(axes) + x_hat * (g * x_hat).sum(axes)) / count) / stddev
        self.renorm_mean += (mean - self.renorm_mean) * (1 - self.renorm_momentum)
        self.renorm_stddev += (stddev - self.renorm_stddev) * (1 - self.renorm_momentum)
        self.moving_mean += (mean - self.moving_mean) * (1 - self.momentum)
        self.moving_stddev += (stddev - self.moving_stddev) * (1 - self.momentum)
        return y, dx

    @property
    def moving_variance(self):
        return np.maximum(self.moving_stddev**2 - EPSILON, 0.0)


def _run_layer(layer, x, upstream, mask):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt, training=True, mask=mask)
        loss = tf.reduce_sum(y * upstream)
    return y.numpy(), tape.gradient(loss, xt).numpy()


class RenormTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("no_clipping", {}, False),
        ("clipping_engaged", {"rmax": 1.5, "rmin": 0.8, "dmax": 0.3}, False),
        ("clipping_with_mask", {"rmax": 1.5, "rmin": 0.8, "dmax": 0.3}, True),
    )
    def test_matches_reference_over_steps(self, clipping, masked):
        rng = np.random.RandomState(0)
        layer = BatchNormalization(
            momentum=0.8,
            renorm=True,
            renorm_momentum=0.6,
            renorm_clipping=clipping or None,
            epsilon=EPSILON,
            dtype="float64",
        )
        layer.build((None, 5, 3))
        gamma, beta = rng.rand(3) + 0.5, rng.randn(3)
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
        reference = Reference(3, 0.8, 0.6, clipping)
        engaged = False
        for step in range(4):
            # Batches far from N(0, 1) so r and d leave the clipping range.
            x = rng.randn(6, 5, 3) * (3.0 + step) + 2.0 * step
            mask = rng.rand(6, 5) > 0.3 if masked else None
            w = (
                np.ones_like(x)
                if mask is None
                else np.broadcast_to(mask[..., None], x.shape).astype(float)
            )
            upstream = rng.randn(*x.shape)
            expected_y, expected_dx = reference.step(x, w, upstream, gamma, beta, (0, 1))
            y, dx = _run_layer(layer, x, upstream, mask)
            if mask is not None:  # Masked positions are normalised but not compared.
                y, expected_y = y * w, expected_y * w
            np.testing.assert_allclose(
                y, expected_y, rtol=1e-9, atol=1e-9, err_msg=f"y step {step}"
            )
            np.testing.assert_allclose(
                dx, expected_dx, rtol=1e-8, atol=1e-9, err_msg=f"dx step {step}"
            )
            for name in (
                "moving_mean",
                "moving_stddev",
                "moving_variance",
                "renorm_mean",
                "renorm_stddev",
            ):
                np.testing.assert_allclose(
                    np.asarray(getattr(layer, name)),
                    getattr(reference, name),
                    rtol=1e-9,
                    atol=1e-12,
                    err_msg=f"{name} step {step}",
                )
            stddev = np.sqrt(x.var((0, 1)) + EPSILON)
            engaged |= bool(clipping) and np.any(stddev / reference.renorm_stddev > 1.5)
        self.assertEqual(engaged, bool(clipping))

    def test_gamma_and_beta_gradients_hold_r_and_d_constant(self):
        x = np.random.RandomState(1).randn(8, 3) * 4 + 1
        layer = BatchNormalization(renorm=True, dtype="float64")
        layer.build((None, 3))
        layer.renorm_mean.assign([0.5, -0.5, 1.0])
        layer.renorm_stddev.assign([2.0, 3.0, 1.5])
        with tf.GradientTape() as tape:
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * x)
        dgamma, dbeta = tape.gradient(loss, [layer.gamma, layer.beta])
        mean, stddev = x.mean(0), np.sqrt(x.var(0) + EPSILON)
        r = stddev / np.array([2.0, 3.0, 1.5])
        d = (mean - np.array([0.5, -0.5, 1.0])) / np.array([2.0, 3.0, 1.5])
        np.testing.assert_allclose(dgamma, (x * ((x - mean) / stddev * r + d)).sum(0), rtol=1e-10)
        np.testing.assert_allclose(dbeta, x.sum(0), rtol=1e-10)

    def test_inference_is_unchanged_by_renorm(self):
        x = np.random.RandomState(2).randn(4, 3)
        plain, renorm = BatchNormalization(), BatchNormalization(renorm=True)
        for layer in (plain, renorm):
            layer.build((None, 3))
            layer.moving_mean.assign([1.0, 2.0, 3.0])
            layer.moving_variance.assign([0.5, 2.0, 4.0])
        np.testing.assert_array_equal(plain(x, training=False), renorm(x, training=False))

    @parameterized.named_parameters(
        (
            "keys",
            {"renorm": True, "renorm_clipping": {"rmx": 1.0}},
            ValueError,
            r"invalid keys.*Received: renorm_clipping=",
        ),
        (
            "order",
            {"renorm": True, "renorm_clipping": {"rmax": 0.5, "rmin": 1.0}},
            ValueError,
            r"rmax should be.*Received: renorm_clipping=",
        ),
        (
            "dmax",
            {"renorm": True, "renorm_clipping": {"dmax": -1.0}},
            ValueError,
            r"dmax should be non-negative.*Received: renorm_clipping=",
        ),
        (
            "value_type",
            {"renorm": True, "renorm_clipping": {"rmax": "2"}},
            TypeError,
            r"renorm_clipping\['rmax'\].*Received: renorm_clipping=",
        ),
        (
            "dict_type",
            {"renorm": True, "renorm_clipping": [1.0]},
            TypeError,
            r"to be a dict.*Received: renorm_clipping=\[1.0\]",
        ),
        (
            "without_renorm",
            {"renorm_clipping": {"rmax": 2.0}},
            ValueError,
            r"only applies with renorm=True",
        ),
        (
            "momentum_range",
            {"renorm": True, "renorm_momentum": 1.0},
            ValueError,
            r"Received: renorm_momentum=1.0",
        ),
        (
            "momentum_none",
            {"renorm": True, "renorm_momentum": None},
            TypeError,
            r"Received: renorm_momentum=None",
        ),
        ("renorm_type", {"renorm": 1}, TypeError, r"Received: renorm=1"),
    )
    def test_constructor_rejects(self, kwargs, error, pattern):
        with self.assertRaisesRegex(error, pattern):
            BatchNormalization(**kwargs)


if __name__ == "__main__":
    absltest.main()
