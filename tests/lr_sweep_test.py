"""Tests of the learning-rate sweep (--lr_sweep): its summary, flags, and MNIST sweeps."""

import json
import math
import os
import tempfile

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow_datasets as tfds

from flags import training_flags as training_flags
from tests import data_dirs
from tests import flag_state
from tests import inception_bn_test
from tests import run_outputs
from tests import tensorboard_events
from trainers import inception_bn
from trainers import mnist_sigmoid
from trainers.inception import sweep as inception_sweep
from trainers.reporting import lr_sweep

LN10 = math.log(10)


def setUpModule():
    flag_state.ensure_parsed()


def _history(accuracies, final_loss, every=10):
    evals = [
        {"step": every * (i + 1), "test_accuracy": a, "train_loss": 1.0}
        for i, a in enumerate(accuracies)
    ]
    evals[-1]["train_loss"] = final_loss
    return {"evals": evals, "steps": every * len(evals), "wall_time_s": 3.0}


def _point(accuracies, final_loss, rate):
    return lr_sweep.point(_history(accuracies, final_loss), rate, 10, "test_accuracy")


class SummaryTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("nan", float("nan"), True),
        ("inf", float("inf"), True),
        ("minus_inf", float("-inf"), True),
        ("above_uniform", LN10 + 0.01, True),
        ("uniform", LN10, True),  # No better than a uniform prediction: ≥ counts.
        ("learning", LN10 - 0.01, False),
        ("low", 0.1, False),
    )
    def test_divergence_rule(self, loss, expected):
        self.assertEqual(lr_sweep.diverged(loss, 10), expected)

    def test_point_reads_final_and_best(self):
        point = _point([0.5, 0.9, 0.8], 0.3, 0.25)
        self.assertEqual(
            point,
            {
                "learning_rate": 0.25,
                "final_accuracy": 0.8,
                "max_accuracy": 0.9,
                "final_train_loss": 0.3,
                "diverged": False,
                "steps": 30,
                "wall_time_s": 3.0,
            },
        )

    def test_best_and_largest_stable_rates(self):
        points = {
            "baseline": {
                1.0: _point([0.9], 0.5, 0.5),
                5.0: _point([0.95], 0.3, 2.5),
                30.0: _point([0.99], float("nan"), 15.0),  # Diverged: not the best.
                100.0: _point([0.5], 1.5, 50.0),
            },
            "batch_norm": {1.0: _point([0.1], 3.0, 0.5), 5.0: _point([0.1], float("inf"), 2.5)},
        }
        summary = lr_sweep.summarize(points)
        baseline = summary["baseline"]
        self.assertEqual(list(baseline["runs"]), ["1", "5", "30", "100"])
        self.assertEqual((baseline["best_multiplier"], baseline["best_learning_rate"]), (5.0, 2.5))
        self.assertEqual(
            (baseline["largest_stable_multiplier"], baseline["largest_stable_learning_rate"]),
            (100.0, 50.0),
        )
        self.assertTrue(baseline["runs"]["30"]["diverged"])
        for key in ("best_multiplier", "largest_stable_multiplier", "best_learning_rate"):
            self.assertIsNone(summary["batch_norm"][key], key)  # Every run diverged.
        lines = lr_sweep.markdown(summary, LN10).splitlines()
        self.assertIn("| baseline | 30 | 15 | 99.0% | 99.0% | nan | yes |", lines)
        self.assertIn("| baseline | 5 | 100 |", lines)
        self.assertIn("| batch_norm | — | — |", lines)

    def test_run_rewrites_the_results_after_each_run(self):
        model_dir = tempfile.mkdtemp()
        sweep = lr_sweep.Sweep(
            model_dir=model_dir,
            networks=("a", "b"),
            multipliers=(1.0, 10.0),
            base_learning_rates={"a": 0.1, "b": 0.2},
            num_classes=10,
            accuracy_key="test_accuracy",
            config={"seed": 0},
        )
        seen = []

        def train_one(network, multiplier):
            if seen:  # The previous runs are on disk before this one trains.
                with open(os.path.join(model_dir, "lr_sweep.json")) as f:
                    runs = json.load(f)["networks"][seen[0][0]]["runs"]
                self.assertIn("1", runs)
            seen.append((network, multiplier))
            loss = float("nan") if multiplier == 10.0 and network == "b" else 0.5
            return _history([0.3, 0.6 if network == "a" else 0.7], loss)

        summary = lr_sweep.run(sweep, train_one, writes=True)
        self.assertEqual(seen, [("a", 1.0), ("b", 1.0), ("a", 10.0), ("b", 10.0)])
        self.assertEqual(summary["b"]["largest_stable_multiplier"], 1.0)
        self.assertAlmostEqual(summary["b"]["runs"]["1"]["learning_rate"], 0.2)
        self.assertAlmostEqual(summary["b"]["runs"]["10"]["learning_rate"], 2.0)
        _check_outputs(self, model_dir)


def _check_outputs(test, model_dir):
    """Asserts the sweep's files and root image; returns lr_sweep.json."""
    results = run_outputs.read_strict_json(os.path.join(model_dir, "lr_sweep.json"))
    with open(os.path.join(model_dir, "lr_sweep.md")) as f:
        test.assertTrue(f.read().startswith("| network | × | learning rate |"))
    with open(os.path.join(model_dir, "lr_sweep.png"), "rb") as f:
        test.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    test.assertEqual(tensorboard_events.read_plugins(model_dir)["lr_sweep"], "images")
    return results


class FlagsTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("zero", ["--lr_sweep=1,0"], r"finite multipliers > 0.*Received: lr_sweep=1,0"),
        ("negative", ["--lr_sweep=-1"], r"finite multipliers > 0"),
        ("not_a_number", ["--lr_sweep=1,fast"], r"finite multipliers > 0.*lr_sweep=1,fast"),
        ("infinite", ["--lr_sweep=inf"], r"finite multipliers > 0"),
        ("twice", ["--lr_sweep=1,5,1"], r"names a multiplier twice"),
        ("seeds", ["--lr_sweep=1,5", "--num_seeds=2"], r"--lr_sweep trains one seed"),
    )
    def test_refused(self, args, pattern):
        with flag_state.trainer_flags(mnist_sigmoid):
            with self.assertRaisesRegex(flags.IllegalFlagValueError, pattern):
                flags.FLAGS(["prog", *args])

    def test_multipliers_parse_in_order(self):
        with flag_state.trainer_flags(mnist_sigmoid):
            flags.FLAGS(["prog", "--lr_sweep=30,1,0.5"])
            self.assertEqual(training_flags.lr_multipliers(), (30.0, 1.0, 0.5))
            flags.FLAGS(["prog", "--lr_sweep="])
            self.assertIsNone(training_flags.lr_multipliers())

    @parameterized.named_parameters(
        ("variant", {"variant": "bn_x30"}, r"Received: variant=bn_x30"),
        ("learning_rate", {"learning_rate": 0.1}, r"Received: learning_rate=0.1"),
        ("two", {"variant": "bn_x30", "dropout": 0.1}, r"Received: variant=bn_x30, dropout=0.1"),
    )
    def test_inception_sweep_keeps_the_recipes(self, values, received):
        with flag_state.trainer_flags(inception_bn, lr_sweep=["1", "5"], **values):
            with self.assertRaisesRegex(
                flags.ValidationError,
                rf"--lr_sweep trains the inception and bn_baseline.*{received}",
            ):
                inception_bn.config_from_flags()

    def test_inception_sweep_refused_on_jax(self):
        if keras.backend.backend() != "jax":
            self.skipTest("The sweep's LRN builds on TensorFlow")
        with flag_state.trainer_flags(inception_bn, lr_sweep=["1"]):
            with self.assertRaisesRegex(flags.ValidationError, r"TensorFlow only.*engine=jax"):
                inception_bn.config_from_flags()

    @parameterized.parameters("bn_x5", "all")
    def test_inception_sweep_configs(self, variant):
        if keras.backend.backend() != "tensorflow":
            self.skipTest("The sweep's LRN builds on TensorFlow")
        with flag_state.trainer_flags(inception_bn, lr_sweep=["1", "5"], variant=variant):
            config = inception_bn.config_from_flags()
        self.assertEqual(config.lr_sweep, (1.0, 5.0))
        self.assertIsNone(config.recipe)
        one = inception_sweep.sweep_config(config, "bn_baseline", 5.0)
        self.assertAlmostEqual(one.recipe.learning_rate, 5 * 0.0015)
        self.assertTrue(one.recipe.batch_norm)
        self.assertEqual(one.model_dir, os.path.join(config.model_dir, "bn_baseline", "lr_x5"))
        # The decay interval is scaled to the run as with --variant=all.
        self.assertEqual(one.recipe.decay_steps, round(240_000 * config.train_steps / 3e6))


@pytest.mark.integration
class InceptionSweepTest(absltest.TestCase):
    def test_fake_data_sweep(self):
        if keras.backend.backend() != "tensorflow":
            self.skipTest("The sweep's LRN builds on TensorFlow")
        model_dir = tempfile.mkdtemp()
        with flag_state.trainer_flags(
            inception_bn,
            lr_sweep=["2"],
            model_dir=model_dir,
            **inception_bn_test.MANY_RUNS_SMOKE,
        ):
            inception_bn.main(["inception_bn"])
        results = _check_outputs(self, model_dir)
        self.assertEqual(results["accuracy"], "top1")
        self.assertAlmostEqual(results["divergence_loss"], math.log(1000))
        for variant in ("inception", "bn_baseline"):
            self.assertAlmostEqual(
                results["networks"][variant]["runs"]["2"]["learning_rate"], 2 * 0.0015
            )
            with open(os.path.join(model_dir, variant, "lr_x2", "summary.json")) as f:
                run = json.load(f)
            self.assertEqual((run["variant"], run["steps"]), (variant, 2))
            self.assertAlmostEqual(run["config"]["recipe.learning_rate"], 2 * 0.0015)


@pytest.mark.integration
class MnistSweepTest(absltest.TestCase):
    def test_mock_data_sweep_writes_every_run_and_the_results(self):
        model_dir = tempfile.mkdtemp()
        settings = dict(
            model_dir=model_dir, train_steps=4, eval_every=2, batch_size=20, probe_size=30
        )
        with (
            tfds.testing.mock_data(num_examples=100),
            flag_state.trainer_flags(mnist_sigmoid, lr_sweep=["1", "0.5"], **settings),
        ):
            mnist_sigmoid.main(["mnist_sigmoid"])
        results = _check_outputs(self, model_dir)
        self.assertEqual(results["multipliers"], [1.0, 0.5])
        self.assertEqual(results["config"]["lr_sweep"], [1.0, 0.5])
        for network in ("baseline", "batch_norm"):
            runs = results["networks"][network]["runs"]
            self.assertEqual(runs["0.5"]["learning_rate"], 0.25)
            for name in ("lr_x1", "lr_x0.5"):
                with open(os.path.join(model_dir, network, name, "history.json")) as f:
                    history = json.load(f)
                self.assertEqual(history["steps"], 4)
                norm = {"baseline": "none", "batch_norm": "batch_norm"}[network]
                self.assertEqual(history["identity"]["norm"], norm)
            self.assertEqual(history["identity"]["learning_rate"], 0.25)

    def test_huge_rate_diverges_stops_unsaved_and_the_sweep_goes_on(self):
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not present at {data_dirs.SHARED_DATA}")
        model_dir = tempfile.mkdtemp()
        with flag_state.trainer_flags(
            mnist_sigmoid,
            model_dir=model_dir,
            data_dir=data_dirs.SHARED_DATA,
            norm="batch_norm",
            lr_sweep=["1", "1e30"],
            train_steps=20,
            eval_every=10,
            train_subset=1200,
            probe_size=100,
        ):
            mnist_sigmoid.main(["mnist_sigmoid"])
        entry = _check_outputs(self, model_dir)["networks"]["batch_norm"]
        self.assertFalse(entry["runs"]["1"]["diverged"], entry["runs"]["1"])
        huge = entry["runs"]["1e+30"]
        self.assertTrue(huge["diverged"])
        self.assertFalse(np.isfinite(huge["final_train_loss"]), huge)
        self.assertEqual(huge["steps"], 10)  # Stopped at its first evaluation (--on_divergence).
        run_dir = os.path.join(model_dir, "batch_norm", "lr_x1e+30")
        history = run_outputs.read_strict_json(os.path.join(run_dir, "history.json"))
        self.assertTrue(history["finished"])
        self.assertEqual(history["diverged"]["step"], 10)
        self.assertFalse(os.path.isdir(os.path.join(run_dir, "checkpoints")))  # Never non-finite.
        losses = [v for _, v in tensorboard_events.read_events(run_dir)["train/loss"]]
        self.assertFalse(np.isfinite(losses[-1]))
        self.assertEqual((entry["best_multiplier"], entry["largest_stable_multiplier"]), (1, 1))


if __name__ == "__main__":
    absltest.main()
