"""Runs that tell the truth: divergence, changed settings and data, strict JSON (TF and JAX).

The trainer runs use `tfds.testing.mock_data` (the data-identity test, real
MNIST); they run under TensorFlow in the default suite and under
`KERAS_BACKEND=jax` in `.ci/run`.
"""

import json
import math
import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow_datasets as tfds

import keras_bn
from tests import data_dirs
from tests import flag_state
from tests import run_outputs
from trainers import mnist_sigmoid
from trainers.run import divergence
from trainers.run import json_files


def setUpModule():
    flag_state.ensure_parsed()


def _run(model_dir, **overrides):
    """The BN network on mock MNIST; returns `main`'s exit message (None when it returns)."""
    settings = dict(
        model_dir=model_dir,
        norm="batch_norm",
        train_steps=8,
        eval_every=4,
        batch_size=20,
        probe_size=30,
        seed=1,
    )
    settings.update(overrides)
    with tfds.testing.mock_data(num_examples=100):
        return _exit_message(settings)


def _exit_message(settings):
    """`mnist_sigmoid.main` under the flags `settings`: its exit message, None when it returns."""
    with flag_state.trainer_flags(mnist_sigmoid, **settings):
        try:
            mnist_sigmoid.main(["mnist_sigmoid"])
        except SystemExit as exit_:
            return str(exit_.code)
    return None


def _history(model_dir):
    return run_outputs.read_strict_json(os.path.join(model_dir, "batch_norm", "history.json"))


def _checkpoint_steps(model_dir):
    directory = os.path.join(model_dir, "batch_norm", "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if keras.backend.backend() == "jax":
        return sorted(int(n) for n in names if n.isdigit())
    return sorted({int(n.split("-")[1].split(".")[0]) for n in names if n.endswith(".index")})


class StrictJsonTest(absltest.TestCase):
    def test_non_finite_numbers_are_null_with_a_field_saying_why_and_come_back(self):
        path = os.path.join(tempfile.mkdtemp(), "out.json")
        payload = {"evals": [{"loss": math.nan, "a/b": math.inf}], "x": -math.inf, "ok": 1.5}
        json_files.write_json(path, payload)
        with open(path) as f:
            text = f.read()
        strict = json.loads(text, parse_constant=run_outputs.reject_constant)
        self.assertIsNone(strict["evals"][0]["loss"])
        self.assertEqual(
            strict["non_finite_values"],
            {"/evals/0/loss": "nan", "/evals/0/a~1b": "inf", "/x": "-inf"},
        )
        back = json_files.read_json(path, None)
        self.assertTrue(math.isnan(back["evals"][0]["loss"]))
        self.assertEqual(
            (back["evals"][0]["a/b"], back["x"], back["ok"]), (math.inf, -math.inf, 1.5)
        )
        self.assertNotIn("non_finite_values", back)

    def test_a_non_finite_number_outside_a_dict_is_refused(self):
        path = os.path.join(tempfile.mkdtemp(), "out.json")
        with self.assertRaisesRegex(ValueError, r"Non-finite numbers in a JSON list"):
            json_files.write_json(path, [1.0, math.nan])


class WatchTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        inputs = keras.Input((3,))
        self.bn = keras_bn.BatchNormalization(count_skipped_updates=True)
        self.model = keras.Model(inputs, self.bn(keras.layers.Dense(3)(inputs)))
        host = lambda variables: [keras.ops.convert_to_numpy(v) for v in variables]
        self.watch = divergence.Watch(self.model, host, 0)

    def test_a_finite_record_and_state_is_no_divergence(self):
        self.assertIsNone(self.watch.check({"train_loss": 0.5, "accuracy": 0.9}, 4))

    def test_the_train_loss_is_named_first_then_the_record_order(self):
        record = {"step": 4, "p15": math.nan, "train_loss": math.inf}
        self.assertEqual(self.watch.check(record, 4), "train_loss is inf")
        self.assertEqual(self.watch.check({"p15": math.nan}, 4), "p15 is nan")

    def test_a_non_finite_weight_is_named(self):
        kernel = self.model.layers[1].kernel
        kernel.assign(np.full(kernel.shape, np.nan, "float32"))
        self.assertRegex(
            self.watch.check({"train_loss": 0.5}, 4), r"^weight .*kernel is not finite$"
        )

    def test_a_layer_that_skipped_every_update_of_the_interval_is_named(self):
        self.model(np.full((4, 3), np.nan, "float32"), training=True)
        self.model(np.full((4, 3), np.nan, "float32"), training=True)
        problem = self.watch.check({"train_loss": 0.5}, 2)  # Steps 1 and 2 since step 0.
        self.assertRegex(problem, rf"^BN layer {self.bn.name} skipped all 2 updates")
        self.model(np.full((4, 3), np.nan, "float32"), training=True)
        self.assertIsNone(self.watch.check({"train_loss": 0.5}, 4))  # 1 of steps 3 and 4.


@pytest.mark.integration
class DivergenceTest(parameterized.TestCase):
    def test_a_diverged_run_stops_unsaved_is_recorded_and_stays_over(self):
        model_dir = tempfile.mkdtemp()
        message = _run(model_dir, learning_rate=1e30)
        self.assertRegex(
            message,
            r"^mnist_sigmoid: error: 1 of 1 runs diverged \(batch_norm seed 1 at step 4: "
            r"\S+ is nan\); their results are recorded as diverged\.$",
        )
        history = _history(model_dir)
        self.assertEqual(history["steps"], 4)
        self.assertTrue(history["finished"])
        self.assertEqual(history["diverged"]["step"], 4)
        self.assertEqual(history["diverged"]["last_checkpoint"], 0)
        self.assertEqual(_checkpoint_steps(model_dir), [])  # Never the non-finite state.
        summary = run_outputs.read_strict_json(os.path.join(model_dir, "summary.json"))
        self.assertEqual(summary["runs"]["batch_norm"]["diverged"]["step"], 4)
        with open(os.path.join(model_dir, "batch_norm", "history.json")) as f:
            written = f.read()
        # A relaunch finds the run over: it trains nothing and says the same.
        self.assertEqual(_run(model_dir, learning_rate=1e30), message)
        with open(os.path.join(model_dir, "batch_norm", "history.json")) as f:
            self.assertEqual(f.read(), written)

    def test_continue_trains_on_and_checkpoints_no_non_finite_state(self):
        model_dir = tempfile.mkdtemp()
        message = _run(model_dir, learning_rate=1e30, on_divergence="continue")
        self.assertRegex(message, r"1 of 1 runs diverged \(batch_norm seed 1 at step 4: ")
        history = _history(model_dir)
        self.assertEqual([e["step"] for e in history["evals"]], [4, 8])
        self.assertEqual(history["diverged"]["step"], 4)
        self.assertEqual(_checkpoint_steps(model_dir), [])

    def test_a_changed_rate_takes_effect_and_finite_checkpoints_are_kept(self):
        model_dir = tempfile.mkdtemp()
        self.assertIsNone(_run(model_dir))
        self.assertEqual(_checkpoint_steps(model_dir), [4, 8])
        message = _run(model_dir, train_steps=16, learning_rate=1e30, allow_config_change=True)
        self.assertRegex(message, r"batch_norm seed 1 at step 12: ")
        history = _history(model_dir)
        self.assertEqual(history["diverged"]["last_checkpoint"], 8)
        self.assertEqual(history["config_changes"][0]["changed"], {"learning_rate": [0.5, 1e30]})
        self.assertEqual(_checkpoint_steps(model_dir), [4, 8])  # Not rotated out.

    def test_a_changed_batch_takes_effect(self):
        runs = {}
        for name, batch in (("same", 20), ("changed", 10)):
            model_dir = tempfile.mkdtemp()
            self.assertIsNone(_run(model_dir))
            self.assertIsNone(
                _run(model_dir, train_steps=12, batch_size=batch, allow_config_change=True)
            )
            runs[name] = _history(model_dir)
        self.assertEqual(runs["same"]["evals"][:2], runs["changed"]["evals"][:2])
        self.assertNotEqual(runs["same"]["evals"][2], runs["changed"]["evals"][2])
        self.assertEqual(runs["changed"]["config_changes"][0]["changed"], {"batch_size": [20, 10]})

    def test_a_setting_that_cannot_take_effect_is_refused_in_one_line(self):
        model_dir = tempfile.mkdtemp()
        self.assertIsNone(_run(model_dir))
        message = _run(model_dir, train_steps=12, init_std=0.2, allow_config_change=True)
        self.assertRegex(
            message,
            r"^mnist_sigmoid: error: .* holds a run at step 8 whose init_std cannot change "
            r"\(init_std=0\.1 → 0\.2\)",
        )
        self.assertNotIn("\n", message)


@pytest.mark.integration
class DataIdentityTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "fashion_mnist")):
            self.skipTest(f"real MNIST and Fashion-MNIST not present at {data_dirs.SHARED_DATA}")

    def _run(self, model_dir, data_dir, **overrides):
        settings = dict(
            model_dir=model_dir,
            data_dir=data_dir,
            norm="batch_norm",
            eval_every=4,
            batch_size=20,
            train_subset=200,
            probe_size=30,
        )
        return _exit_message({**settings, **overrides})

    def test_other_data_under_the_same_name_is_refused_unless_allowed(self):
        # Fashion-MNIST's files and info, named mnist.
        other = tempfile.mkdtemp()
        version_dir = os.path.join(other, "mnist", "3.0.1")
        shutil.copytree(os.path.join(data_dirs.SHARED_DATA, "fashion_mnist", "3.0.1"), version_dir)
        for name in os.listdir(version_dir):
            if name.startswith("fashion_mnist-"):
                os.rename(
                    os.path.join(version_dir, name),
                    os.path.join(version_dir, name.replace("fashion_mnist-", "mnist-")),
                )
        info_path = os.path.join(version_dir, "dataset_info.json")
        with open(info_path) as f:
            info = json.load(f)
        with open(info_path, "w") as f:
            json.dump({**info, "name": "mnist"}, f)

        model_dir = tempfile.mkdtemp()
        self.assertIsNone(self._run(model_dir, data_dirs.SHARED_DATA, train_steps=4))
        message = self._run(model_dir, other, train_steps=8)
        self.assertRegex(
            message,
            r"holds a run at step 4 with other settings \(data\.splits\.test\.bytes=\d+ → \d+, "
            r"data\.splits\.test\.digest='[0-9a-f]{64}' → '[0-9a-f]{64}', "
            r"data\.splits\.train\.bytes=\d+ → \d+, "
            r"data\.splits\.train\.digest='[0-9a-f]{64}' → '[0-9a-f]{64}'\): "
            r".*--allow_config_change",
        )
        self.assertIsNone(self._run(model_dir, other, train_steps=8, allow_config_change=True))
        history = _history(model_dir)
        self.assertEqual(history["steps"], 8)
        self.assertEqual(
            sorted(history["config_changes"][0]["changed"]),
            [
                "data.splits.test.bytes",
                "data.splits.test.digest",
                "data.splits.train.bytes",
                "data.splits.train.digest",
            ],
        )


if __name__ == "__main__":
    absltest.main()
