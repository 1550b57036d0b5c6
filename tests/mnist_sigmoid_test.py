"""End-to-end tests of the sigmoid MNIST trainer on mock and real data, on either engine.

They run under TensorFlow (the default suite) and again under
`KERAS_BACKEND=jax` (`.ci/run`), where conftest.py gives JAX 8 host devices.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tests import data_dirs
from tests import flag_state
from tests import tensorboard_events
from trainers import mnist_sigmoid
from trainers.mnist import data as mnist_data
from trainers.mnist import model as mnist_model

SHARED_DATA = data_dirs.SHARED_DATA


def setUpModule():
    flag_state.ensure_parsed()


def _run(model_dir, **overrides):
    settings = dict(
        model_dir=model_dir, train_steps=8, eval_every=4, batch_size=20, probe_size=30, seed=1
    )
    settings.update(overrides)
    with (
        tfds.testing.mock_data(num_examples=100),
        flag_state.trainer_flags(mnist_sigmoid, **settings),
    ):
        mnist_sigmoid.main(["mnist_sigmoid"])
    with open(os.path.join(model_dir, "summary.json")) as f:
        return json.load(f)


def _text(run_dir, tag):
    """The Markdown table logged as text `tag`, as a dict."""
    for path in tf.io.gfile.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    table = tf.make_ndarray(value.tensor).item().decode()
                    rows = [line.split(" | ") for line in table.splitlines()[2:]]
                    return {row[0].strip("| "): row[1].strip("| ") for row in rows}
    raise KeyError(tag)


def _weights(run_dir):
    """The model's values in the run's latest checkpoint (either engine's format)."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    if keras.backend.backend() == "jax":  # trainers.engines.jax_runner.OrbaxCheckpointer
        import orbax.checkpoint as ocp

        options = ocp.CheckpointManagerOptions(read_only=True)
        handler = ocp.StandardCheckpointHandler()
        with ocp.CheckpointManager(checkpoints, item_handlers=handler, options=options) as saved:
            values = saved.restore(saved.latest_step())["model"]
        return {f"model/{i}": np.asarray(value) for i, value in enumerate(values)}
    reader = tf.train.load_checkpoint(checkpoints)
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if "model" in name
    }


class MnistSigmoidTest(parameterized.TestCase):
    @pytest.mark.integration
    def test_smoke_run_writes_metrics_events_figure_and_summary(self):
        model_dir = tempfile.mkdtemp()
        summary = _run(model_dir)
        self.assertCountEqual(summary["runs"], ["baseline", "batch_norm"])
        for name, run in summary["runs"].items():
            self.assertEqual(run["steps"], 8)
            self.assertTrue(0.0 <= run["final_test_accuracy"] <= 1.0)
            self.assertGreaterEqual(run["best_test_accuracy"], run["final_test_accuracy"])
            tags = tensorboard_events.read_events(os.path.join(model_dir, name))
            for tag in (
                "train/loss",
                "train/learning_rate",
                "eval/test_accuracy",
                f"sigmoid_input/{name}/p15",
                f"sigmoid_input/{name}/p50",
                f"sigmoid_input/{name}/p85",
            ):
                self.assertEqual([s for s, _ in tags[tag]], [4, 8], tag)
                self.assertTrue(all(np.isfinite(v) for _, v in tags[tag]), tag)
            p15, p85 = (
                tags[f"sigmoid_input/{name}/p15"][-1][1],
                tags[f"sigmoid_input/{name}/p85"][-1][1],
            )
            self.assertLessEqual(p15, p85)
            plugins = tensorboard_events.read_plugins(os.path.join(model_dir, name))
            for layer in (1, 2, 3):
                self.assertEqual(plugins[f"pre_activation/layer_{layer}"], "histograms")
            self.assertEqual(plugins["config"], "text")
            norm = {"baseline": "none", "batch_norm": "batch_norm"}[name]
            self.assertEqual(_text(os.path.join(model_dir, name), "config")["norm"], norm)
            # HParams: the run's settings, and its metrics at the end.
            self.assertEqual(plugins["_hparams_/session_start_info"], "hparams")
            for metric in ("final_test_accuracy", "best_test_accuracy", "first_step_97"):
                self.assertEqual([s for s, _ in tags[f"hparams/{metric}"]], [8], metric)
            self.assertAlmostEqual(
                tags["hparams/final_test_accuracy"][0][1],
                summary["runs"][name]["final_test_accuracy"],
                places=6,
            )
            monitor_tags = [t for t in tags if t.startswith("bn_")]
            if name == "batch_norm":
                for layer in (1, 2, 3):
                    self.assertEqual(
                        [s for s, _ in tags[f"bn_{layer}/train_inference_gap"]], [4, 8]
                    )
                    self.assertEqual(plugins[f"bn_{layer}/moving_mean"], "histograms")
            else:
                self.assertEqual(monitor_tags, [])
            with open(os.path.join(model_dir, name, "history.json")) as f:
                self.assertEqual([e["step"] for e in json.load(f)["evals"]], [4, 8])
        root = tensorboard_events.read_plugins(model_dir)
        self.assertEqual(root["custom_scalars__config__"], "custom_scalars")
        self.assertEqual(root["_hparams_/experiment"], "hparams")
        self.assertEqual(root["figure1"], "images")
        with open(os.path.join(model_dir, "figure1.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertEqual(summary["config"]["learning_rate"], 0.5)
        self.assertEqual(summary["config"]["sync_batch_norm"], False)
        self.assertEqual(summary["config"]["engine"], keras.backend.backend())
        # Every flag of the trainer and the shared modules is recorded.
        modules = (
            "trainers.mnist_sigmoid",
            "flags.run_flags",
            "flags.training_flags",
            "flags.distribution_flags",
            "flags.batch_norm_flags",
        )
        by_module = flags.FLAGS.flags_by_module_dict()
        names = {flag.name for module in modules for flag in by_module.get(module, [])}
        self.assertGreater(len(names), 15)
        self.assertLessEqual(names, set(summary["config"]))

    @pytest.mark.integration
    def test_seeds_are_runs_of_their_own_with_mean_and_spread(self):
        model_dir = tempfile.mkdtemp()
        summary = _run(model_dir, num_seeds=2, seed=3)
        for name in ("baseline", "batch_norm"):
            run = summary["runs"][name]
            self.assertEqual(sorted(run["per_seed"]), ["3", "4"])
            finals = [run["per_seed"][s]["final_test_accuracy"] for s in ("3", "4")]
            self.assertAlmostEqual(run["final_test_accuracy"], np.mean(finals), places=9)
            self.assertAlmostEqual(run["final_test_accuracy_std"], np.std(finals), places=9)
            for seed in (3, 4):
                run_dir = os.path.join(model_dir, name, f"seed_{seed}")
                self.assertEqual(_text(run_dir, "config")["seed"], str(seed))
                self.assertIn("eval/test_accuracy", tensorboard_events.read_events(run_dir))
        self.assertEqual(tensorboard_events.read_plugins(model_dir)["figure1"], "images")

    def test_networks_of_a_seed_share_initial_kernels(self):
        baseline, _ = mnist_model.build_model("none", 0.1, 5)
        batch_norm, _ = mnist_model.build_model("batch_norm", 0.1, 5)
        other_seed, _ = mnist_model.build_model("batch_norm", 0.1, 6)
        kernel_of = lambda model, name: keras.ops.convert_to_numpy(model.get_layer(name).kernel)
        for name in ("dense_1", "dense_2", "dense_3", "logits"):
            kernel = kernel_of(baseline, name)
            np.testing.assert_array_equal(kernel, kernel_of(batch_norm, name), err_msg=name)
            self.assertFalse(np.array_equal(kernel, kernel_of(other_seed, name)), name)

    @pytest.mark.integration
    def test_resume_continues_without_repeating_or_skipping(self):
        straight = tempfile.mkdtemp()
        _run(straight, norm="batch_norm")
        interrupted = tempfile.mkdtemp()
        _run(interrupted, norm="batch_norm", train_steps=4)  # "killed" after step 4
        summary = _run(interrupted, norm="batch_norm")
        self.assertEqual(summary["runs"]["batch_norm"]["steps"], 8)
        with open(os.path.join(interrupted, "batch_norm", "history.json")) as f:
            resumed = json.load(f)["evals"]
        with open(os.path.join(straight, "batch_norm", "history.json")) as f:
            expected = json.load(f)["evals"]
        self.assertEqual([e["step"] for e in resumed], [4, 8])
        # Every evaluation (accuracy, loss, percentiles) as without the kill.
        for a, b in zip(resumed, expected):
            self.assertCountEqual(a, b)
            for key in a:
                self.assertAlmostEqual(a[key], b[key], delta=1e-6, msg=(a["step"], key))
        a, b = (
            _weights(os.path.join(interrupted, "batch_norm")),
            _weights(os.path.join(straight, "batch_norm")),
        )
        self.assertEqual(sorted(a), sorted(b))
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)

    @pytest.mark.integration
    def test_completed_run_is_not_retrained(self):
        model_dir = tempfile.mkdtemp()
        first = _run(model_dir, norm="none")
        second = _run(model_dir, norm="none")
        self.assertEqual(
            first["runs"],
            {k: {**v, "wall_time_s": v["wall_time_s"]} for k, v in second["runs"].items()},
        )

    def test_data_order_is_a_function_of_seed_and_step(self):
        full = mnist_data.example_order(100, 20, seed=3, num_steps=12)
        self.assertLen(full, 240)
        for epoch in range(2):
            self.assertCountEqual(full[epoch * 100 : (epoch + 1) * 100], range(100))
        images = np.arange(100, dtype=np.float32)[:, None]
        labels = np.arange(100, dtype=np.int32)
        resumed = list(mnist_data.make_dataset(images, labels, 20, 3, start_step=7, num_steps=12))
        self.assertLen(resumed, 5)
        np.testing.assert_array_equal(resumed[0][1], full[140:160])

    def test_missing_data_names_the_flag(self):
        with self.assertRaisesRegex(
            FileNotFoundError,
            r"--data_dir='.*'.*omit --data_dir and TFDS downloads it.*or pass --data_dir=DIR",
        ):
            mnist_data.load_mnist(tempfile.mkdtemp(), "test")

    def test_reads_real_mnist(self):
        if not os.path.isdir(os.path.join(SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not present at {os.path.normpath(SHARED_DATA)}")
        images, labels = mnist_data.load_mnist(SHARED_DATA, "test")
        self.assertEqual(images.shape, (10000, 784))
        self.assertEqual(images.dtype, np.float32)
        self.assertTrue(0.0 <= images.min() and images.max() <= 1.0)
        self.assertCountEqual(np.unique(labels), range(10))
        # --train_subset's read: the first examples of the whole read, and no more.
        first_images, first_labels = mnist_data.load_mnist(SHARED_DATA, "test", limit=300)
        np.testing.assert_array_equal(first_images, images[:300])
        np.testing.assert_array_equal(first_labels, labels[:300])

    def test_a_limit_below_one_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"at least 1 or None\. Received: limit=0$"):
            mnist_data.load_mnist(SHARED_DATA, "test", limit=0)


def _train_loss_at_500(model_dir, *extra):
    """Runs the BN network for 500 steps on real MNIST in its own process."""
    args = [
        "--norm=batch_norm",
        "--train_steps=500",
        "--eval_every=500",
        "--probe_size=100",
        f"--data_dir={SHARED_DATA}",
        f"--model_dir={model_dir}",
        *extra,
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-m", "trainers.mnist_sigmoid", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(model_dir, "batch_norm", "history.json")) as f:
        return json.load(f)["evals"][-1]["train_loss"]


# Each engine's multi-replica setting: (flags, global batch). TensorFlow mirrors
# over 2 logical CPUs, 30 examples per replica; JAX runs DataParallel over 8
# host devices, 8 examples per replica.
REPLICATED = {
    "tensorflow": (["--distribution_strategy=mirrored", "--num_cpu_devices=2"], 60),
    "jax": (["--distribution_strategy=data_parallel", "--num_cpu_devices=8"], 64),
}


@pytest.mark.slow
class MnistDistributedTest(absltest.TestCase):
    """Replicas with --sync_batch_norm train like one device, on the test's engine."""

    def test_synchronised_replicas_match_one_device(self):
        if not os.path.isdir(os.path.join(SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not present at {os.path.normpath(SHARED_DATA)}")
        replicated, batch = REPLICATED[keras.backend.backend()]
        batch_flag = f"--batch_size={batch}"
        one = _train_loss_at_500(tempfile.mkdtemp(), batch_flag)
        synced = _train_loss_at_500(
            tempfile.mkdtemp(), batch_flag, *replicated, "--sync_batch_norm"
        )
        local = _train_loss_at_500(tempfile.mkdtemp(), batch_flag, *replicated)
        self.assertLess(abs(synced - one) / one, 0.01, (one, synced))
        # Per-replica moments over a few examples train differently.
        self.assertGreater(abs(local - one) / one, abs(synced - one) / one, (one, synced, local))


if __name__ == "__main__":
    absltest.main()
