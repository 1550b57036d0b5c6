"""The layer under Keras 3's `keras.distribution` on JAX, over 8 host devices.

Runs only under `KERAS_BACKEND=jax` in its own process (`.ci/run`), where
`conftest.py` sets `XLA_FLAGS=--xla_force_host_platform_device_count=8`
before JAX starts, so `DataParallel` runs real XLA collectives over 8 CPU
devices. Every step here is jitted with the input laid out over the batch
axis, as `fit` does. Under SPMD every replica holds the same number of
examples, so unequal slices cannot be tested here (the tf.distribute tests
cover them).
"""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

import keras_bn
from tests import jax_programs
from tests import references

if keras.backend.backend() != "jax":
    pytest.skip(
        "keras.distribution tests run under KERAS_BACKEND=jax in their own process (.ci/run)",
        allow_module_level=True,
    )

import jax  # noqa: E402

REPLICAS, BATCH, CHANNELS = 8, 64, 5
EPSILON = 1e-3

# Each of the 8 replicas' 8-example slice has its own mean, so local, grouped
# and global statistics all differ.
_RNG = np.random.RandomState(0)
X = (
    _RNG.randn(BATCH, CHANNELS) * 2.0
    + np.repeat(np.arange(REPLICAS) * 3.0 - 10.0, BATCH // REPLICAS)[:, None]
).astype(np.float32)
UPSTREAM = _RNG.randn(BATCH, CHANNELS).astype(np.float32)
GAMMA = np.linspace(0.5, 1.5, CHANNELS).astype(np.float32)
BETA = np.linspace(-1.0, 1.0, CHANNELS).astype(np.float32)

SETTINGS = (
    ("local", {}, REPLICAS),
    ("global", {"synchronized": True}, 1),
    ("group2", {"synchronized": True, "sync_group_size": 2}, 4),
    ("group4", {"synchronized": True, "sync_group_size": 4}, 2),
    ("ghost", {"virtual_batch_size": 4}, BATCH // 4),
)


def _data_parallel():
    return keras.distribution.DataParallel(devices=jax.devices()[:REPLICAS])


def _distribute(distribution, array):
    return keras.distribution.distribute_tensor(array, distribution.get_data_layout(array.shape))


def _layer(momentum=0.5, **kwargs):
    layer = keras_bn.BatchNormalization(momentum=momentum, epsilon=EPSILON, **kwargs)
    layer.build((BATCH, CHANNELS))
    layer.gamma.assign(GAMMA)
    layer.beta.assign(BETA)
    return layer


def _training_step(x, upstream=UPSTREAM, **layer_kwargs):
    """One jitted training step of a fresh layer on `x` laid out over the batch axis.

    Returns `(layer, y, ((dgamma, dbeta), dx), updated_non_trainable)`.
    """
    distribution = _data_parallel()
    with distribution.scope():
        layer = _layer(**layer_kwargs)
        step, trainable, non_trainable = jax_programs.make_jax_training_step(layer)
        outputs = step(
            trainable,
            non_trainable,
            _distribute(distribution, x),
            _distribute(distribution, upstream),
        )
    return (layer, *outputs)


def _moving(layer, updated, name):
    names = [v.name for v in layer.non_trainable_variables]
    return np.asarray(updated[names.index(name)], np.float64)


class JaxDistributionTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        # Fewer devices means the XLA flag came too late: fail, do not skip.
        self.assertGreaterEqual(
            jax.device_count(), REPLICAS, "set XLA_FLAGS before JAX starts (conftest.py)"
        )

    @parameterized.named_parameters(*SETTINGS)
    def test_matches_float64_reference_on_regrouped_batch(self, kwargs, slices):
        self._check_step(X, UPSTREAM, kwargs, slices)

    @parameterized.named_parameters(("groups_of_4", 2), ("each_replica", 8), ("ghost", 32))
    def test_normalisation_batch_in_examples(self, per_replica):
        """synchronized=True, virtual_batch_size=8: every 8 consecutive examples, any b."""
        batch = REPLICAS * per_replica
        rng = np.random.RandomState(per_replica)
        # Every 4 examples their own offset: each choice of 8 gives other statistics.
        offsets = np.repeat(np.arange(batch // 4) * 1.5, 4)[:, None]
        x = (rng.randn(batch, CHANNELS) * 2.0 + offsets).astype(np.float32)
        upstream = rng.randn(batch, CHANNELS).astype(np.float32)
        kwargs = {"synchronized": True, "virtual_batch_size": 8}
        self._check_step(x, upstream, kwargs, batch // 8)

    @parameterized.named_parameters(
        ("not_a_divisor_nor_multiple", 12, r"virtual_batch_size=12 must tile the global batch"),
        ("groups_not_dividing_replicas", 48, r"per-replica batch=8, replicas=8"),
    )
    def test_normalisation_batch_that_does_not_tile_is_refused(self, size, pattern):
        with self.assertRaisesRegex(ValueError, pattern):
            _training_step(X, synchronized=True, virtual_batch_size=size)

    def _check_step(self, x, upstream, kwargs, slices):
        layer, y, ((dgamma, dbeta), dx), updated = _training_step(x, upstream, **kwargs)
        expected = references.reference_sliced_batch_norm(x, upstream, GAMMA, BETA, slices, EPSILON)
        for name, value in (("y", y), ("dx", dx), ("dgamma", dgamma), ("dbeta", dbeta)):
            np.testing.assert_allclose(
                np.asarray(value, np.float64), expected[name], rtol=1e-5, atol=1e-5, err_msg=name
            )
        np.testing.assert_allclose(
            _moving(layer, updated, "moving_mean"), 0.5 * expected["mean"], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            _moving(layer, updated, "moving_variance"), 0.5 + 0.5 * expected["variance"], rtol=1e-5
        )

    @parameterized.named_parameters(*SETTINGS)
    def test_one_replica_non_finite_skips_the_update(self, kwargs, slices):
        del slices
        x = X.copy()
        x[BATCH - 1, 2] = np.nan  # Only the last replica's slice is non-finite.
        layer, _, _, updated = _training_step(x, count_skipped_updates=True, **kwargs)
        np.testing.assert_array_equal(_moving(layer, updated, "moving_mean"), np.zeros(CHANNELS))
        np.testing.assert_array_equal(_moving(layer, updated, "moving_variance"), np.ones(CHANNELS))
        self.assertEqual(float(_moving(layer, updated, "skipped_updates")), 1.0)

    @parameterized.named_parameters(("global", None), ("group2", 2))
    def test_large_offset_variance_at_first_step(self, group_size):
        x = (1e4 + np.random.RandomState(1).randn(BATCH, CHANNELS)).astype(np.float32)
        layer, _, _, updated = _training_step(
            x, momentum=0.0, synchronized=True, sync_group_size=group_size
        )
        slices = 1 if group_size is None else REPLICAS // group_size
        expected = references.reference_sliced_batch_norm(x, UPSTREAM, GAMMA, BETA, slices, EPSILON)
        np.testing.assert_allclose(
            _moving(layer, updated, "moving_variance"), expected["variance"], rtol=1e-3
        )

    @parameterized.named_parameters(("local", False), ("synchronized", True))
    def test_accumulation_in_fit_follows_the_optimizer(self, synchronized):
        """`gradient_accumulation_steps=2` over 8 devices: one update per optimizer step."""
        per_replica = 2
        batch = REPLICAS * per_replica
        rng = np.random.RandomState(3)
        offsets = np.repeat(np.arange(4 * REPLICAS) * 1.5, per_replica)[:, None]
        x = (rng.randn(4 * batch, CHANNELS) * 2.0 + offsets).astype(np.float32)
        with _data_parallel().scope():
            model = keras.Sequential(
                [
                    keras.Input((CHANNELS,)),
                    keras_bn.BatchNormalization(
                        accumulation_steps=2, momentum=None, synchronized=synchronized, name="bn"
                    ),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), "mse")
            model.fit(x, np.zeros((len(x), 1)), batch_size=batch, shuffle=False, verbose=0)
        bn = model.get_layer("bn")
        self.assertEqual(float(bn.moving_batches.numpy()), 2.0)  # 4 without accumulation.
        # Each replica's 2 examples (or the global batch) are a slice; the two merges average.
        size = batch if synchronized else per_replica
        slices = np.asarray(x, np.float64).reshape(-1, size, CHANNELS)
        np.testing.assert_allclose(bn.moving_mean.numpy(), slices.mean(1).mean(0), rtol=1e-5)
        np.testing.assert_allclose(bn.moving_variance.numpy(), slices.var(1).mean(0), rtol=1e-5)

    def test_fit_with_synchronized_layer_matches_single_device(self):
        rng = np.random.RandomState(2)
        # Per-replica offsets, so that local statistics differ from global ones.
        offsets = np.tile(np.repeat(np.arange(REPLICAS) * 2.0, BATCH // REPLICAS), 4)[:, None]
        x = (rng.randn(4 * BATCH, 12) * 3 + 2 + offsets).astype(np.float32)
        # Labels follow the offsets: only statistics across replicas keep them.
        y = np.tile(np.repeat(np.arange(REPLICAS) % 3, BATCH // REPLICAS), 4)

        def build(synchronized=True):
            model = keras.Sequential(
                [
                    keras.Input((12,)),
                    keras.layers.Dense(16, use_bias=False),
                    keras_bn.BatchNormalization(synchronized=synchronized),
                    keras.layers.Activation("sigmoid"),
                    keras.layers.Dense(3),
                ]
            )
            model.compile(
                keras.optimizers.SGD(0.5),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            return model

        def fit(model):
            # One step in flight: 8 emulated devices on 2 cores (tests/jax_programs.py).
            callbacks = [jax_programs.OneStepInFlight()]
            history = model.fit(
                x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0, callbacks=callbacks
            )
            return history.history["loss"]

        keras.utils.set_random_seed(0)
        single = build()
        weights = single.get_weights()
        single_losses = fit(single)
        distribution = _data_parallel()
        with distribution.scope():
            parallel = build()
            parallel.set_weights(weights)
            parallel_losses = fit(parallel)
        np.testing.assert_allclose(parallel_losses, single_losses, rtol=1e-5)
        # With each replica's own statistics the run differs (so the check
        # above can fail).
        with distribution.scope():
            local = build(synchronized=False)
            local.set_weights(weights)
            local_losses = fit(local)
        self.assertGreater(abs(local_losses[-1] - single_losses[-1]), 1e-2 * single_losses[-1])

    def test_keras_layer_normalises_with_the_global_batch(self):
        # The fact behind README's engine table: Keras' own layer, under
        # DataParallel, takes the global batch's statistics.
        distribution = _data_parallel()
        with distribution.scope():
            layer = keras.layers.BatchNormalization(momentum=0.0)
            layer.build((BATCH, CHANNELS))
            step, trainable, non_trainable = jax_programs.make_jax_training_step(layer)
            _, _, updated = step(
                trainable,
                non_trainable,
                _distribute(distribution, X),
                _distribute(distribution, UPSTREAM),
            )
        np.testing.assert_allclose(
            _moving(layer, updated, "moving_mean"), X.astype(np.float64).mean(0), rtol=1e-5
        )

    def test_synchronized_without_distribution_is_the_whole_batch(self):
        layer = _layer(synchronized=True, sync_group_size=2)
        y = keras.ops.convert_to_numpy(layer(X, training=True))
        expected = references.reference_sliced_batch_norm(X, UPSTREAM, GAMMA, BETA, 1, EPSILON)
        np.testing.assert_allclose(y, expected["y"], rtol=1e-5, atol=1e-5)

    def test_hlo_traffic(self):
        # Local and ghost statistics need no collective: what the step
        # all-reduces is the γ/β gradients and the moving statistics'
        # average over replicas (4 floats per channel); global carries fewer
        # floats than Keras' layer.
        traffic = {}
        distribution = _data_parallel()
        x, upstream = _distribute(distribution, X), _distribute(distribution, UPSTREAM)
        with distribution.scope():
            traffic["keras"] = jax_programs.hlo_all_reduces(_keras_hlo(x, upstream))
            for name, kwargs, _ in SETTINGS:
                traffic[name] = jax_programs.hlo_all_reduces(
                    jax_programs.jax_training_step_hlo(_layer(**kwargs), x, upstream)
                )
        # (How many ops XLA's combiner makes of them may vary by version;
        # the floats may not.)
        for name in ("local", "ghost"):
            self.assertEqual(traffic[name][1], 4 * CHANNELS, name)
        self.assertEqual(traffic["global"][1], 4 * CHANNELS)
        self.assertLess(traffic["global"][1], traffic["keras"][1])
        # Groups add the cross-group sums of the γ/β gradients and moving
        # statistics (4C) to their within-group statistics (4C).
        for name in ("group2", "group4"):
            self.assertEqual(traffic[name][1], 8 * CHANNELS, name)

    @parameterized.named_parameters(
        ("uneven_batch", {}, 60, r"must split evenly over the 8 replicas.*batch_size=60"),
        (
            "group_size",
            {"synchronized": True, "sync_group_size": 3},
            BATCH,
            r"sync_group_size=3 must divide the 8 replicas",
        ),
        (
            "ghost",
            {"virtual_batch_size": 3},
            BATCH,
            r"virtual_batch_size=3 must divide each replica's batch of 8",
        ),
    )
    def test_rejects(self, kwargs, batch, pattern):
        with _data_parallel().scope():
            layer = _layer(**kwargs)
            with self.assertRaisesRegex(ValueError, pattern):
                layer(X[:batch], training=True)


def _keras_hlo(x, upstream):
    layer = keras.layers.BatchNormalization()
    layer.build((BATCH, CHANNELS))
    return jax_programs.jax_training_step_hlo(layer, x, upstream)


if __name__ == "__main__":
    absltest.main()
