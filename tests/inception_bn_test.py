"""Tests of the BN-Inception model, recipes and trainer (fake data)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_bn
from tests import flag_state
from tests import run_outputs
from tests import tensorboard_events
from trainers import inception_bn
from trainers.inception import data as image_data
from trainers.inception import model as inception_model
from trainers.inception import recipes as inception_recipes
from trainers.inception import task as inception_task
from trainers.run import program
from trainers.run import skeleton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setUpModule():
    flag_state.ensure_parsed()


SMOKE = dict(
    use_fake_data=True, image_size=32, train_steps=4, eval_every=2, eval_steps=1, batch_size=4
)
# For tests that train many runs (seeds, sweeps): one evaluation each, a 5%-wide network.
MANY_RUNS_SMOKE = dict(SMOKE, train_steps=2, width_multiplier=0.05)


def _smoke(model_dir, **overrides):
    with flag_state.trainer_flags(inception_bn, model_dir=model_dir, **{**SMOKE, **overrides}):
        inception_bn.main(["inception_bn"])
    with open(os.path.join(model_dir, "summary.json")) as f:
        return json.load(f)


def check_run(test, model_dir, summary, steps):
    """Asserts a finished run's steps, finite metrics, event tags, checkpoint."""
    test.assertEqual(summary["steps"], steps)
    test.assertTrue(np.isfinite(summary["final"]["train_loss"]))
    tags = tensorboard_events.read_events(model_dir)
    for tag in (
        "train/loss",
        "train/learning_rate",
        "eval/top1",
        "eval/top5",
        "train/images_per_sec",
    ):
        test.assertIn(tag, tags)
        test.assertTrue(all(np.isfinite(v) for _, v in tags[tag]), tag)
    test.assertIn("config", tags)
    if summary["config"]["recipe.batch_norm"]:
        plugins = tensorboard_events.read_plugins(model_dir)
        for tag in (
            "batch_norm/worst_train_inference_gap",
            "batch_norm/median_train_inference_gap",
            "bn_stage_stem/worst_train_inference_gap",
            "bn_stage_5/worst_train_inference_gap",
        ):
            test.assertEqual(len(tags[tag]), len(tags["eval/top1"]), tag)
            test.assertTrue(all(np.isfinite(v) for _, v in tags[tag]), tag)
        for stage in ("stem", "3", "4", "5"):
            test.assertEqual(plugins[f"bn_stage_{stage}/moving_variance"], "histograms", stage)
    test.assertIsNotNone(tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints")))
    return tags


class ModelTest(parameterized.TestCase):
    # With BN, each of the 69 layers also holds its one skipped_updates counter.
    @parameterized.named_parameters(
        ("bn", True, False, 11_298_629), ("inception", False, True, 11_268_512)
    )
    def test_builds_at_224_with_expected_parameters(self, batch_norm, lrn, params):
        model = inception_model.build_inception(batch_norm=batch_norm, lrn=lrn)
        self.assertEqual(tuple(model.output.shape), (None, 1000))
        self.assertEqual(model.count_params(), params)
        concat = {
            x.name: tuple(x.output.shape[1:]) for x in model.layers if x.name.endswith("_concat")
        }
        self.assertEqual(concat["inception_3a_concat"], (28, 28, 256))
        self.assertEqual(concat["inception_3c_concat"], (14, 14, 576))
        self.assertEqual(concat["inception_4d_concat"], (14, 14, 608))
        self.assertEqual(concat["inception_4e_concat"], (7, 7, 1056))
        self.assertEqual(concat["inception_5b_concat"], (7, 7, 1024))
        bns = [x for x in model.layers if isinstance(x, keras_bn.BatchNormalization)]
        self.assertLen(bns, 69 if batch_norm else 0)

    def test_bn_precedes_every_nonlinearity_without_bias(self):
        model = inception_model.build_inception(image_size=32, activation="sigmoid")
        for layer in model.layers:
            if layer.name.endswith("_act"):
                self.assertEqual(layer.get_config()["activation"], "sigmoid")
                bn = layer._inbound_nodes[0].parent_nodes[0].operation
                self.assertIsInstance(bn, keras_bn.BatchNormalization)
                conv = bn._inbound_nodes[0].parent_nodes[0].operation
                self.assertFalse(conv.use_bias, conv.name)

    def test_small_image_size_runs(self):
        model = inception_model.build_inception(
            image_size=32, num_classes=10, dropout=0.4, lrn=True, batch_norm=False
        )
        out = model(np.zeros((2, 32, 32, 3), np.float32), training=True)
        self.assertEqual(out.shape, (2, 10))


class WidthMultiplierTest(parameterized.TestCase):
    def test_scales_every_convolution(self):
        full = inception_model.build_inception(image_size=32, num_classes=10)
        half = inception_model.build_inception(image_size=32, num_classes=10, width_multiplier=0.5)
        convs = [x for x in full.layers if isinstance(x, keras.layers.Conv2D)]
        self.assertLen(convs, 68)  # With the separable stem, 69 convolutions.
        for layer in convs:
            self.assertEqual(
                half.get_layer(layer.name).filters, round(layer.filters / 2), layer.name
            )
        stem = half.get_layer("conv1_7x7")
        self.assertEqual((stem.filters, stem.depth_multiplier), (32, 8))
        concat = half.get_layer("inception_3a_concat").output.shape
        self.assertEqual(tuple(concat[1:]), (4, 4, 128))  # 256 channels at 1.0.
        self.assertLess(half.count_params(), full.count_params() / 3)

    def test_rounds_to_at_least_one_filter(self):
        model = inception_model.build_inception(
            image_size=32, num_classes=10, width_multiplier=0.01
        )
        filters = [x.filters for x in model.layers if hasattr(x, "filters")]
        self.assertEqual(min(filters), 1)  # 32 × 0.01 rounds to 0.
        self.assertEqual(model.get_layer("conv2_3x3").filters, 2)  # 192 × 0.01

    def test_one_is_the_paper_network(self):
        model = inception_model.build_inception(image_size=32, width_multiplier=1.0)
        self.assertEqual(model.count_params(), 11_298_629)  # As at 224: a global pool.

    @parameterized.parameters(0, -0.5, float("nan"), float("inf"), "0.5", None)
    def test_bad_values_are_refused(self, value):
        with self.assertRaisesRegex(
            ValueError, rf"finite number > 0. Received: width_multiplier={value!r}$"
        ):
            inception_model.build_inception(image_size=32, width_multiplier=value)

    @parameterized.parameters("0", "-1", "nan", "inf")
    def test_bad_flag_values_are_refused(self, value):
        with flag_state.trainer_flags(inception_bn):
            with self.assertRaisesRegex(
                flags.IllegalFlagValueError, r"--width_multiplier must be a finite number > 0"
            ):
                flags.FLAGS(["prog", f"--width_multiplier={value}"])

    def test_recorded_in_the_config_and_identity(self):
        run = inception_task.InceptionRun(_config(width_multiplier=0.25))
        self.assertEqual(run.config.flat_values()["width_multiplier"], 0.25)
        self.assertEqual(run.config.identity()["width_multiplier"], 0.25)
        run.build()
        self.assertEqual(run.model.get_layer("conv2_3x3").filters, 48)


class RecipeTest(parameterized.TestCase):
    def test_accelerated_recipe_bundle(self):
        base, x5 = inception_recipes.RECIPES["inception"], inception_recipes.RECIPES["bn_x5"]
        self.assertAlmostEqual(x5.learning_rate, 5 * 0.0015)
        self.assertAlmostEqual(inception_recipes.RECIPES["bn_x30"].learning_rate, 30 * 0.0015)
        self.assertEqual((base.dropout, x5.dropout), (0.4, 0.0))
        self.assertAlmostEqual(x5.weight_decay, base.weight_decay / 5)
        self.assertEqual(x5.decay_steps, base.decay_steps // 6)
        self.assertEqual((base.lrn, x5.lrn), (True, False))
        self.assertLess(x5.distortion, base.distortion)
        self.assertTrue(x5.thorough_shuffle and not base.thorough_shuffle)
        self.assertEqual(inception_recipes.RECIPES["bn_x5_sigmoid"].activation, "sigmoid")
        self.assertEqual(inception_recipes.RECIPES["bn_baseline"].learning_rate, base.learning_rate)

    def test_flags_override_recipe(self):
        recipe = inception_recipes.resolve("bn_x30", learning_rate=0.1, dropout=None)
        self.assertEqual(recipe.learning_rate, 0.1)
        self.assertEqual(recipe.dropout, 0.0)


class TrainerTest(parameterized.TestCase):
    @pytest.mark.integration
    def test_bn_baseline_smoke_and_resume(self):
        model_dir = tempfile.mkdtemp()
        summary = _smoke(model_dir, variant="bn_baseline", train_steps=2)
        check_run(self, model_dir, summary, 2)
        summary = _smoke(model_dir, variant="bn_baseline", train_steps=4, target_accuracy=0.0)
        tags = check_run(self, model_dir, summary, 4)
        self.assertEqual([s for s, _ in tags["eval/top1"]], [2, 4])  # continued, not restarted
        # Derived from all kept evaluations: step 2 already had top-1 >= 0.0.
        self.assertEqual(summary["steps_to_target"], 2)

    def test_steps_to_target_is_the_first_evaluation_reaching_it(self):
        evals = [{"step": 2, "top1": 0.5}, {"step": 4, "top1": 0.73}, {"step": 6, "top1": 0.71}]
        self.assertEqual(inception_task.steps_to_target(evals, 0.722), 4)
        self.assertEqual(inception_task.steps_to_target(evals, 0.5), 2)
        self.assertIsNone(inception_task.steps_to_target(evals, 0.9))
        self.assertIsNone(inception_task.steps_to_target(evals[:1], 0.722))

    def test_uneven_global_batch_is_rejected(self):
        with self.assertRaisesRegex(ValueError, r"split evenly.*Received: batch_size=5"):
            program.check_replicas(_config(batch_size=5).loop(), 2)

    def test_group_size_not_dividing_the_replicas_is_rejected(self):
        with self.assertRaisesRegex(
            ValueError, r"--sync_group_size=3 must divide the number of replicas, 2,"
        ):
            program.check_replicas(_config(sync_batch_norm=True, sync_group_size=3).loop(), 2)

    def test_config_records_every_flag(self):
        config = _config(learning_rate=0.01, dropout=0.2, sync_batch_norm=True, sync_group_size=2)
        values = config.flat_values()
        self.assertEqual(values["recipe.learning_rate"], 0.01)
        self.assertEqual(values["recipe.dropout"], 0.2)
        self.assertEqual(values["sync_group_size"], 2)
        # Every flag the trainer reads is in the config, directly or as the
        # recipe field it overrides.
        in_recipe = {
            "learning_rate": "recipe.learning_rate",
            "dropout": "recipe.dropout",
            "weight_decay": "recipe.weight_decay",
            "lr_decay_steps": "recipe.decay_steps",
        }
        for name in _trainer_flag_names():
            self.assertIn(in_recipe.get(name, name), values, name)

    @parameterized.parameters("mirrored", "multi_worker_mirrored")
    def test_jit_compile_with_sync_batch_norm_is_refused_before_building(self, strategy):
        with flagsaver.flagsaver():
            with self.assertRaisesRegex(
                flags.IllegalFlagValueError,
                r"--jit_compile cannot be combined with --sync_batch_norm"
                r".*tf.distribute cannot run",
            ):
                flags.FLAGS(
                    [
                        "prog",
                        "--jit_compile",
                        "--sync_batch_norm",
                        f"--distribution_strategy={strategy}",
                    ]
                )

    def test_missing_imagenet_names_the_flags(self):
        with self.assertRaisesRegex(FileNotFoundError, r"--data_dir='.*'.*--use_fake_data"):
            image_data.make_dataset(
                split="train",
                data_dir=tempfile.mkdtemp(),
                batch_size=2,
                image_size=32,
                distortion=1.0,
                thorough_shuffle=False,
                seed=0,
                use_fake_data=False,
            )


# A class-level mark: a mark above `@parameterized` does not reach absl's copies (CONTRIBUTING.md).
@pytest.mark.slow
class SlowTrainerTest(absltest.TestCase):
    """A 2-device mirrored run (inception_table2_test.py's SeedsSmokeTest runs every variant)."""

    def test_mirrored_two_devices_with_sync_batch_norm(self):
        model_dir = tempfile.mkdtemp()
        args = [f"--{k}={v}" for k, v in SMOKE.items() if k != "use_fake_data"] + [
            "--use_fake_data",
            "--distribution_strategy=mirrored",
            "--num_cpu_devices=2",
            "--sync_batch_norm",
            f"--model_dir={model_dir}",
            "--variant=bn_x5",
        ]
        result = subprocess.run(
            [sys.executable, "-m", "trainers.inception_bn", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("Global batch 4 = 2 replicas × 2 per replica", result.stderr)
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
        check_run(self, model_dir, summary, 4)


@pytest.mark.integration
# One pytest-xdist worker runs the class (--dist loadgroup): setUpClass trains once.
@pytest.mark.xdist_group("RecipeChangeTest")
class RecipeChangeTest(absltest.TestCase):
    """--allow_config_change with the recipe's learning rate or decay interval: applied."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # The run each test relaunches with a change, trained once: a test
        # relaunches a copy of it (a run directory holds no absolute path).
        cls.first_run = tempfile.mkdtemp()
        _smoke(cls.first_run, width_multiplier=0.05)

    def _first_run(self):
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        shutil.copytree(self.first_run, model_dir)
        return model_dir

    def _resumed(self, **change):
        model_dir = self._first_run()
        _smoke(model_dir, width_multiplier=0.05, train_steps=6, allow_config_change=True, **change)
        return run_outputs.read_json(os.path.join(model_dir, "history.json"))  # Times left out.

    def test_a_changed_rate_or_decay_takes_effect_from_the_restored_step(self):
        rate = self._resumed(learning_rate=0.5)
        decay = self._resumed(lr_decay_steps=1)
        self.assertEqual(
            rate["config_changes"][0]["changed"], {"recipe.learning_rate": [0.0075, 0.5]}
        )
        self.assertEqual(decay["config_changes"][0]["changed"], {"recipe.decay_steps": [40000, 1]})
        self.assertEqual(rate["evals"][:2], decay["evals"][:2])  # Before the change: the same.
        self.assertNotEqual(rate["evals"][2]["train_loss"], decay["evals"][2]["train_loss"])
        # The recipe's own rate, 0.0075, with its decay every 40,000 steps, until step 4.
        self.assertAlmostEqual(rate["evals"][1]["learning_rate"], 0.0075, places=6)
        self.assertAlmostEqual(rate["evals"][2]["learning_rate"], 0.5, places=6)
        # Decayed ×0.94 per step: at least 5 decays by step 6.
        self.assertLess(decay["evals"][2]["learning_rate"], 0.0075 * 0.94**5 * 1.0001)

    def test_a_changed_dropout_is_refused_in_one_line(self):
        model_dir = self._first_run()
        with self.assertRaisesRegex(SystemExit, r"whose recipe\.dropout cannot change \("):
            _smoke(
                model_dir,
                width_multiplier=0.05,
                train_steps=6,
                dropout=0.5,
                allow_config_change=True,
            )


def _config(**overrides):
    with flag_state.trainer_flags(
        inception_bn, model_dir=tempfile.mkdtemp(), **{**SMOKE, **overrides}
    ):
        return inception_bn.config_from_flags()


def _trainer_flag_names():
    """The flags defined by the trainer and the shared flag modules."""
    modules = (
        "trainers.inception_bn",
        "flags.run_flags",
        "flags.training_flags",
        "flags.distribution_flags",
    )
    by_module = flags.FLAGS.flags_by_module_dict()
    return {flag.name for module in modules for flag in by_module.get(module, [])}


def _train_and_evaluate(config, runner):
    return skeleton.train_and_evaluate(inception_task.InceptionRun(config), config.loop(), runner)


if __name__ == "__main__":
    absltest.main()
