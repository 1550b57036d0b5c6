"""Tests of keras_bn.BatchNormMonitor."""

import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np

import keras_bn
from tests import sync_fixtures
from tests import tensorboard_events


def _model(synchronized=False):
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, use_bias=False, name="hidden"),
            keras_bn.BatchNormalization(
                synchronized=synchronized, count_skipped_updates=True, name="bn_a"
            ),
            keras.layers.ReLU(),
            keras.layers.Dense(4, use_bias=False),
            keras_bn.BatchNormalization(
                axis=-1,
                momentum=0.5,
                synchronized=synchronized,
                count_skipped_updates=True,
                name="bn_b",
            ),
            keras.layers.Dense(1),
        ]
    )


def _compiled_model(steps_per_execution=1, synchronized=False):
    model = _model(synchronized=synchronized)
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    return model


def _data(n=64, seed=0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(n, 6) * 3 + 5).astype(np.float32)
    return x, (x.sum(1) > 30).astype(np.float32)


class MonitorTest(parameterized.TestCase):
    def test_fit_logs_every_layer_every_n_steps(self):
        log_dir, (x, y), model = tempfile.mkdtemp(), _data(), _compiled_model()
        monitor = keras_bn.BatchNormMonitor(log_dir, x[:32], every_n_steps=2)
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)  # 8 steps.
        tags = tensorboard_events.read_events(log_dir)
        for layer in ("bn_a", "bn_b"):
            for name in ("train_inference_gap", "mean_drift", "variance_drift"):
                self.assertEqual(
                    [s for s, _ in tags[f"{layer}/{name}"]], [2, 4, 6, 8], (layer, name)
                )
                self.assertTrue(all(np.isfinite(v) and v >= 0 for _, v in tags[f"{layer}/{name}"]))
            for name in ("moving_mean", "moving_variance", "gamma", "beta"):
                self.assertLen(tags[f"{layer}/{name}"], 4, (layer, name))
        # The last log saw the final state: it equals a fresh health check.
        for layer, metrics in monitor.health(model):
            for name, value in metrics.items():
                self.assertAlmostEqual(tags[f"{layer.name}/{name}"][-1][1], value, places=4)

    def test_steps_per_execution_still_logs_on_schedule(self):
        log_dir, (x, y) = tempfile.mkdtemp(), _data()
        model = _compiled_model(steps_per_execution=3)
        monitor = keras_bn.BatchNormMonitor(log_dir, x[:16], every_n_steps=4)
        model.fit(
            x, y, batch_size=4, epochs=1, callbacks=[monitor], verbose=0
        )  # 16 steps, hooks at 3, 6, ...
        tags = tensorboard_events.read_events(log_dir)
        self.assertEqual([s for s, _ in tags["bn_a/train_inference_gap"]], [6, 9, 12, 16])

    def test_a_fit_shorter_than_every_n_steps_logs_its_end(self):
        log_dir, (x, y), model = tempfile.mkdtemp(), _data(40), _compiled_model()
        monitor = keras_bn.BatchNormMonitor(log_dir, x[:16])  # every_n_steps=100
        model.fit(x, y, batch_size=4, epochs=1, callbacks=[monitor], verbose=0)  # 10 steps.
        tags = tensorboard_events.read_events(log_dir)
        self.assertEqual([s for s, _ in tags["bn_a/train_inference_gap"]], [10])
        self.assertLen(tags["bn_b/moving_mean"], 1)

    def test_logs_skipped_updates(self):
        log_dir, (x, y), model = tempfile.mkdtemp(), _data(32), _compiled_model()
        monitor = keras_bn.BatchNormMonitor(log_dir, x[:16], every_n_steps=4)
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)  # Steps 1-4.
        bad = np.full((8, 5), np.nan, np.float32)
        model.get_layer("bn_a")(bad, training=True)  # A non-finite batch, skipped.
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)  # Steps 5-8.
        tags = tensorboard_events.read_events(log_dir)
        self.assertEqual(tags["bn_a/skipped_updates"], [(4, 0.0), (8, 1.0)])
        self.assertEqual(tags["bn_b/skipped_updates"], [(4, 0.0), (8, 0.0)])
        grouped_dir = tempfile.mkdtemp()
        grouped = keras_bn.BatchNormMonitor(grouped_dir, x[:16], group_by=lambda name: "all")
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[grouped], verbose=0)
        self.assertEqual(
            tensorboard_events.read_events(grouped_dir)["batch_norm/skipped_updates"], [(12, 1.0)]
        )

    def test_without_tensorflow_names_what_to_install(self):
        with mock.patch.dict(sys.modules, {"tensorflow": None}):
            with self.assertRaisesRegex(ImportError, r'pip install "keras-bn\[tensorflow\]"'):
                keras_bn.BatchNormMonitor(None, np.zeros((2, 6), np.float32))

    def test_gap_and_drifts_match_numpy(self):
        x, _ = _data(32, 1)
        model = _model()
        model(x)
        bn = model.get_layer("bn_a")
        bn.moving_mean.assign([1.0, -1.0, 0.5, 0.0, 2.0])
        bn.moving_variance.assign([4.0, 1.0, 0.25, 9.0, 1.0])
        bn.gamma.assign([1.0, 2.0, 0.5, 1.0, 1.5])
        bn.beta.assign([0.0, 1.0, -1.0, 0.5, 0.0])
        health = dict(keras_bn.BatchNormMonitor(None, x).health(model))[bn]
        h = np.asarray(model.get_layer("hidden")(x), np.float64)
        gamma, beta = np.asarray(bn.gamma), np.asarray(bn.beta)
        mm, mv = np.asarray(bn.moving_mean, np.float64), np.asarray(bn.moving_variance, np.float64)
        mean, var = h.mean(0), h.var(0)
        y_train = gamma * (h - mean) / np.sqrt(var + 1e-3) + beta
        y_infer = gamma * (h - mm) / np.sqrt(mv + 1e-3) + beta
        np.testing.assert_allclose(
            health["train_inference_gap"],
            np.sqrt(np.mean((y_train - y_infer) ** 2)) / y_train.std(),
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            health["mean_drift"],
            np.sqrt(np.mean(((mean - mm) / np.sqrt(var + 1e-3)) ** 2)),
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            health["variance_drift"],
            np.sqrt(np.mean(np.log((mv + 1e-3) / (var + 1e-3)) ** 2)),
            rtol=1e-6,
        )
        # Moving statistics equal to the probe batch's: no gap, no drift.
        bn.moving_mean.assign(mean.astype(np.float32))
        bn.moving_variance.assign(var.astype(np.float32))
        health = dict(keras_bn.BatchNormMonitor(None, x).health(model))[bn]
        for value in health.values():
            self.assertLess(value, 1e-4)

    def test_grouped_aggregates(self):
        log_dir, (x, y), model = tempfile.mkdtemp(), _data(), _compiled_model()
        monitor = keras_bn.BatchNormMonitor(
            log_dir, x[:16], every_n_steps=4, group_by=lambda name: "stage_" + name[-1]
        )
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)
        tags = tensorboard_events.read_events(log_dir)
        for tag in (
            "batch_norm/worst_train_inference_gap",
            "batch_norm/median_train_inference_gap",
            "stage_a/worst_train_inference_gap",
            "stage_b/worst_train_inference_gap",
            "stage_a/moving_mean",
            "stage_b/gamma",
        ):
            self.assertLen(tags[tag], 2, tag)
        worst = tags["batch_norm/worst_train_inference_gap"][-1][1]
        self.assertEqual(
            worst,
            max(
                tags["stage_a/worst_train_inference_gap"][-1][1],
                tags["stage_b/worst_train_inference_gap"][-1][1],
            ),
        )
        self.assertNotIn("bn_a/train_inference_gap", tags)

    def test_multi_steps_epochs_continue_the_count(self):
        log_dir, (x, y), model = tempfile.mkdtemp(), _data(), _compiled_model()
        monitor = keras_bn.BatchNormMonitor(log_dir, x[:16], every_n_steps=3)
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[monitor], verbose=0)  # 2 x 8 steps.
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[monitor], verbose=0)  # Steps 17-20.
        tags = tensorboard_events.read_events(log_dir)
        # Every 3 steps across both fits, plus each fit's last step (16, 20).
        self.assertEqual(
            [s for s, _ in tags["bn_a/train_inference_gap"]], [3, 6, 9, 12, 15, 16, 18, 20]
        )

    def test_mirrored_strategy_probes_the_first_replica(self):
        log_dir, (x, y) = tempfile.mkdtemp(), _data()
        with sync_fixtures.mirrored_cpu_strategy(2).scope():
            model = _compiled_model(synchronized=True)
        monitor = keras_bn.BatchNormMonitor(log_dir, x[:32], every_n_steps=2)
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[monitor], verbose=0)  # 4 steps.
        tags = tensorboard_events.read_events(log_dir)
        self.assertEqual([s for s, _ in tags["bn_a/train_inference_gap"]], [2, 4])
        # With synchronised layers every replica holds the same statistics:
        # the same weights in a model outside the strategy give the same health.
        plain = _model()
        plain.set_weights(model.get_weights())
        expected = {
            layer.name: m for layer, m in keras_bn.BatchNormMonitor(None, x[:32]).health(plain)
        }
        for layer, metrics in monitor.health(model):
            for name, value in metrics.items():
                self.assertAlmostEqual(value, expected[layer.name][name], places=5)
                self.assertAlmostEqual(tags[f"{layer.name}/{name}"][-1][1], value, places=5)

    def test_rejects(self):
        with self.assertRaisesRegex(ValueError, r"Received: every_n_steps=0"):
            keras_bn.BatchNormMonitor(None, np.ones((2, 6)), every_n_steps=0)
        plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        with self.assertRaisesRegex(ValueError, r"no keras_bn.BatchNormalization layer"):
            keras_bn.BatchNormMonitor(None, np.ones((2, 6))).health(plain)

        class Net(keras.Model):
            def __init__(self):
                super().__init__()
                self.bn = keras_bn.BatchNormalization()

            def call(self, x):
                return self.bn(x)

            @property
            def layers(self):
                return [self.bn]

        net = Net()
        net(np.ones((2, 6), np.float32))
        with self.assertRaisesRegex(
            ValueError, r"needs a Sequential or functional model.*Received: model=Net"
        ):
            keras_bn.BatchNormMonitor(None, np.ones((2, 6))).health(net)


if __name__ == "__main__":
    absltest.main()
