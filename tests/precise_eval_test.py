"""Evaluation with precise BN statistics (--eval_bn_statistics=precise), on either engine.

Runs under TensorFlow (the default suite) and again under `KERAS_BACKEND=jax`
(`.ci/run`), where conftest.py gives JAX 8 host devices.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import keras
import numpy as np
import pytest

from flags import training_flags as training_flags
import keras_bn
from tests import flag_state
from tests import inception_bn_test
from tests import mnist_sigmoid_test
from tests import tensorboard_events
from trainers.run import evaluation
from trainers.run import skeleton

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISE = dict(eval_bn_statistics="precise", precise_bn_batches=3)
MOVING_KEYS = {"moving_test_accuracy", "moving_p15", "moving_p50", "moving_p85"}
# Each engine's multi-replica setting (tests/mnist_sigmoid_test.py's REPLICATED).
REPLICATED = {
    "tensorflow": dict(distribution_strategy="mirrored", num_cpu_devices=2),
    "jax": dict(distribution_strategy="data_parallel", num_cpu_devices=8),
}


def setUpModule():
    flag_state.ensure_parsed()


def _evals(run_dir):
    with open(os.path.join(run_dir, "history.json")) as f:
        return json.load(f)["evals"]


class _ProbeTask(skeleton.Task):
    """Evaluates a model's mean inference output on fixed data; trains on shifted data."""

    def __init__(self, model):
        self.model = model
        self.inputs = np.linspace(-1.0, 1.0, 24, dtype="float32").reshape(8, 3)

    def train_dataset(self, start_step):
        del start_step
        return [(self.inputs * 3.0 + 5.0, np.zeros(8)) for _ in range(4)]

    def evaluate(self, step, interval):
        output = keras.ops.convert_to_numpy(self.model(self.inputs, training=False))
        return {"step": step, "mean": float(np.mean(output))}

    def statistics_metrics(self):
        return ("mean",)


def _bn_model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, kernel_initializer="ones"),
            keras_bn.BatchNormalization(momentum_warmup=True),
            keras.layers.Dropout(0.5),  # Its seed state advances in training-mode passes.
        ]
    )


class EvaluateTest(absltest.TestCase):
    """`evaluation.evaluate` on a small model: both records, and the state put back."""

    def test_precise_record_and_untouched_state(self):
        model = _bn_model()
        task = _ProbeTask(model)
        before = [keras.ops.convert_to_numpy(v) for v in model.variables]
        loop = skeleton.LoopConfig(
            name="t",
            run_dir="unused",
            seed=0,
            train_steps=1,
            eval_every=1,
            batch_size=8,
            steps_per_execution=None,
            max_to_keep=1,
            eval_bn_statistics="precise",
            precise_bn_batches=2,
        )
        record = evaluation.evaluate(task, loop, model, 1, {})
        self.assertEqual(set(record), {"step", "mean", "moving_mean", "precise_bn_seconds"})
        self.assertGreater(record["precise_bn_seconds"], 0.0)
        # Initial moving statistics (0, 1) against those of the shifted data.
        self.assertNotAlmostEqual(record["mean"], record["moving_mean"], places=3)
        for variable, value in zip(model.variables, before):
            np.testing.assert_array_equal(
                keras.ops.convert_to_numpy(variable), value, err_msg=variable.path
            )
        moving = evaluation.evaluate(
            task, dataclasses.replace(loop, eval_bn_statistics="moving"), model, 1, {}
        )
        self.assertEqual(moving, {"step": 1, "mean": record["moving_mean"]})

    def test_model_without_batch_norm_is_a_no_op(self):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
        loop = skeleton.LoopConfig("t", "unused", 0, 1, 1, 8, None, 1, eval_bn_statistics="precise")
        record = evaluation.evaluate(_ProbeTask(model), loop, model, 1, {})
        self.assertEqual(record["mean"], record["moving_mean"])
        self.assertEqual(record["precise_bn_seconds"], 0.0)


@pytest.mark.integration
class MnistPreciseTest(parameterized.TestCase):
    def test_records_and_tensorboard_hold_both_statistics(self):
        model_dir = tempfile.mkdtemp()
        summary = mnist_sigmoid_test._run(model_dir, **PRECISE)
        self.assertEqual(summary["config"]["eval_bn_statistics"], "precise")
        self.assertEqual(summary["config"]["precise_bn_batches"], 3)
        for name in ("baseline", "batch_norm"):
            run_dir = os.path.join(model_dir, name)
            evals = _evals(run_dir)
            self.assertEqual([e["step"] for e in evals], [4, 8])
            for record in evals:
                self.assertLessEqual(MOVING_KEYS | {"precise_bn_seconds"}, set(record), name)
                self.assertTrue(0.0 <= record["moving_test_accuracy"] <= 1.0)
                if name == "baseline":  # No BN layer: nothing to re-estimate.
                    self.assertEqual(record["precise_bn_seconds"], 0.0)
                    self.assertEqual(record["moving_test_accuracy"], record["test_accuracy"])
                else:
                    self.assertGreater(record["precise_bn_seconds"], 0.0)
            tags = tensorboard_events.read_events(run_dir)
            for tag in (
                "eval/test_accuracy",
                "eval/moving_test_accuracy",
                "eval/precise_bn_seconds",
            ):
                self.assertEqual([s for s, _ in tags[tag]], [4, 8], (name, tag))
            self.assertEqual(
                [v for _, v in tags["eval/moving_test_accuracy"]],
                [np.float32(e["moving_test_accuracy"]) for e in evals],
            )
            plugins = tensorboard_events.read_plugins(run_dir)
            self.assertEqual(plugins["custom_scalars__config__"], "custom_scalars")
        # The percentiles differ with the statistics: precise ones are evaluated.
        evals = _evals(os.path.join(model_dir, "batch_norm"))
        self.assertNotEqual(
            [e["p50"] for e in evals], [e["moving_p50"] for e in evals], "precise = moving"
        )

    def test_precise_evaluation_leaves_training_and_checkpoints_alone(self):
        moving_dir, precise_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
        mnist_sigmoid_test._run(moving_dir, norm="batch_norm")
        mnist_sigmoid_test._run(precise_dir, norm="batch_norm", **PRECISE)
        moving = _evals(os.path.join(moving_dir, "batch_norm"))
        precise = _evals(os.path.join(precise_dir, "batch_norm"))
        for a, b in zip(moving, precise):
            self.assertEqual(a["train_loss"], b["train_loss"], a["step"])
            for key in ("test_accuracy", "p15", "p50", "p85"):
                self.assertEqual(a[key], b[f"moving_{key}"], (a["step"], key))
        # The checkpoint (moving statistics, counters, weights) is the moving run's.
        a = mnist_sigmoid_test._weights(os.path.join(moving_dir, "batch_norm"))
        b = mnist_sigmoid_test._weights(os.path.join(precise_dir, "batch_norm"))
        self.assertEqual(sorted(a), sorted(b))
        self.assertTrue(any("moving" in n for n in a) or keras.backend.backend() == "jax")
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        # And a resumed precise run continues as the uninterrupted one.
        resumed_dir = tempfile.mkdtemp()
        mnist_sigmoid_test._run(resumed_dir, norm="batch_norm", train_steps=4, **PRECISE)
        mnist_sigmoid_test._run(resumed_dir, norm="batch_norm", **PRECISE)
        resumed = _evals(os.path.join(resumed_dir, "batch_norm"))
        for a, b in zip(resumed, precise):
            self.assertEqual(set(a), set(b))
            for key in a:
                if key != "precise_bn_seconds":
                    self.assertAlmostEqual(a[key], b[key], delta=1e-6, msg=(a["step"], key))

    def test_moving_default_records_no_new_keys(self):
        model_dir = tempfile.mkdtemp()
        summary = mnist_sigmoid_test._run(model_dir, norm="batch_norm")
        self.assertEqual(summary["config"]["eval_bn_statistics"], "moving")
        run_dir = os.path.join(model_dir, "batch_norm")
        for record in _evals(run_dir):
            self.assertEqual(
                set(record), {"step", "test_accuracy", "train_loss", "p15", "p50", "p85"}
            )
        tags = tensorboard_events.read_events(run_dir)
        self.assertNotIn("eval/moving_test_accuracy", tags)
        self.assertNotIn("eval/precise_bn_seconds", tags)
        self.assertNotIn("custom_scalars__config__", tags)

    @parameterized.named_parameters(("local", False), ("synchronized", True))
    def test_replicated(self, sync_batch_norm):
        moving_dir, precise_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
        settings = dict(
            norm="batch_norm",
            batch_size=16 if keras.backend.backend() == "jax" else 20,
            sync_batch_norm=sync_batch_norm,
            **REPLICATED[keras.backend.backend()],
        )
        _run_in_subprocess([(moving_dir, settings), (precise_dir, {**settings, **PRECISE})])
        moving = _evals(os.path.join(moving_dir, "batch_norm"))
        precise = _evals(os.path.join(precise_dir, "batch_norm"))
        for a, b in zip(moving, precise):
            self.assertAlmostEqual(a["train_loss"], b["train_loss"], places=5)
            self.assertAlmostEqual(a["test_accuracy"], b["moving_test_accuracy"], places=5)
            self.assertGreater(b["precise_bn_seconds"], 0.0)
            self.assertTrue(0.0 <= b["test_accuracy"] <= 1.0)
        a = mnist_sigmoid_test._weights(os.path.join(moving_dir, "batch_norm"))
        b = mnist_sigmoid_test._weights(os.path.join(precise_dir, "batch_norm"))
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


# Runs `mnist_sigmoid_test._run(model_dir, **settings)` for each pair of argv[1]
# (JSON), in order, in one process.
_RUNS = """
import json, sys
from tests import flag_state, mnist_sigmoid_test
flag_state.ensure_parsed()
for model_dir, settings in json.loads(sys.argv[1]):
    mnist_sigmoid_test._run(model_dir, **settings)
"""


def _run_in_subprocess(runs):
    """The MNIST `runs` (`[(model_dir, flag settings)]`) in a fresh process.

    TensorFlow's collectives of a MirroredStrategy can collide with those of
    strategies earlier in the same process, so replicated runs get their own.
    """
    result = subprocess.run(
        [sys.executable, "-c", _RUNS, json.dumps(runs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


# Slow: BN-Inception compiles for each run (over 3 minutes on JAX on 2 cores).
@pytest.mark.slow
class InceptionPreciseTest(absltest.TestCase):
    def test_fake_data_smoke(self):
        model_dir = tempfile.mkdtemp()
        summary = inception_bn_test._smoke(model_dir, variant="bn_x5", **PRECISE)
        final = summary["final"]
        for key in ("top1", "top5", "moving_top1", "moving_top5"):
            self.assertTrue(0.0 <= final[key] <= 1.0, key)
        self.assertGreater(final["precise_bn_seconds"], 0.0)
        tags = tensorboard_events.read_events(model_dir)
        for tag in ("eval/top1", "eval/moving_top1", "eval/moving_top5", "eval/precise_bn_seconds"):
            self.assertEqual([s for s, _ in tags[tag]], [2, 4], tag)


class FlagsTest(parameterized.TestCase):
    def test_defaults(self):
        with flagsaver.flagsaver():
            FLAGS(["prog"])
            self.assertEqual(training_flags.EVAL_BN_STATISTICS.value, "moving")
            self.assertEqual(training_flags.PRECISE_BN_BATCHES.value, 100)

    @parameterized.named_parameters(
        ("unknown_statistics", "--eval_bn_statistics=exact", r"eval_bn_statistics.*one of"),
        ("zero_batches", "--precise_bn_batches=0", r"--precise_bn_batches=0: 0 is not a positive"),
    )
    def test_rejects(self, argument, pattern):
        with flagsaver.flagsaver():
            with self.assertRaisesRegex(flags.IllegalFlagValueError, pattern):
                FLAGS(["prog", argument])

    def test_multi_process_jax_is_refused_in_one_line(self):
        argv = ["prog", "--eval_bn_statistics=precise"]
        with (
            flagsaver.flagsaver(),
            mock.patch.dict(os.environ, {"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}),
        ):
            if keras.backend.backend() != "jax":
                FLAGS(argv)  # tf.distribute workers run the passes alike.
                self.assertEqual(training_flags.EVAL_BN_STATISTICS.value, "precise")
                return
            with self.assertRaisesRegex(
                flags.IllegalFlagValueError, r"^[^\n]*multi-process JAX job cannot[^\n]*$"
            ):
                FLAGS(argv)


if __name__ == "__main__":
    absltest.main()
