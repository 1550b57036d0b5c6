"""The trainers on the JAX engine: DataParallel over 8 host devices and over 2 processes.

Runs under `KERAS_BACKEND=jax` in its own process (`.ci/run`), where
conftest.py gives JAX 8 host devices. tests/mnist_sigmoid_test.py runs
there too (the MNIST trainer's outputs, resume and the synchronised-BN check
on 8 devices); this file adds what only the JAX engine has.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
import keras
import numpy as np
import pytest

from tests import mnist_sigmoid_test
from tests import multi_worker
from tests import tensorboard_events

if keras.backend.backend() != "jax":
    pytest.skip(
        "The JAX engine's tests run under KERAS_BACKEND=jax in their own process (.ci/run)",
        allow_module_level=True,
    )

_TIMEOUT_S = 420


def _event_files(run_dir):
    return glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))


def _history(run_dir):
    with open(os.path.join(run_dir, "history.json")) as f:
        return json.load(f)


class DataParallelTest(absltest.TestCase):
    def test_mnist_over_8_devices_records_engine_and_strategy(self):
        model_dir = tempfile.mkdtemp()
        summary = mnist_sigmoid_test._run(
            model_dir,
            norm="batch_norm",
            batch_size=16,
            distribution_strategy="data_parallel",
            num_cpu_devices=8,
            sync_batch_norm=True,
        )
        config = summary["config"]
        self.assertEqual(
            (config["engine"], config["distribution_strategy"], config["num_cpu_devices"]),
            ("jax", "data_parallel", 8),
        )
        run_dir = os.path.join(model_dir, "batch_norm")
        evals = _history(run_dir)["evals"]
        self.assertEqual([e["step"] for e in evals], [4, 8])
        self.assertTrue(all(np.isfinite(e["train_loss"]) for e in evals), evals)
        tags = tensorboard_events.read_events(run_dir)
        self.assertEqual([s for s, _ in tags["eval/test_accuracy"]], [4, 8])


@pytest.mark.slow
class InceptionSmokeTest(absltest.TestCase):
    def test_bn_x5_on_fake_data_over_8_devices(self):
        model_dir = tempfile.mkdtemp()
        args = [
            "--variant=bn_x5",
            "--use_fake_data",
            "--image_size=32",
            "--batch_size=8",
            "--train_steps=2",
            "--eval_every=1",
            "--eval_steps=1",
            "--distribution_strategy=data_parallel",
            "--num_cpu_devices=8",
            "--sync_batch_norm",
            f"--model_dir={model_dir}",
        ]
        result = subprocess.run(
            [sys.executable, "-m", "trainers.inception_bn", *args],
            cwd=multi_worker.ROOT,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["steps"], 2)
        self.assertEqual(summary["config"]["engine"], "jax")
        evals = _history(model_dir)["evals"]
        self.assertEqual([e["step"] for e in evals], [1, 2])
        for record in evals:
            self.assertTrue(np.isfinite(record["train_loss"]), record)
            self.assertTrue(0.0 <= record["top1"] <= record["top5"] <= 1.0, record)
        tags = tensorboard_events.read_events(model_dir)
        for tag in ("train/loss", "eval/top1", "eval/top5", "train/images_per_sec"):
            self.assertEqual([s for s, _ in tags[tag]], [1, 2], tag)


def _launch_two_processes(model_dir, train_steps):
    """The MNIST BN network over 2 processes × 4 host devices, synchronised BN."""
    args = [
        "--norm=batch_norm",
        "--train_subset=640",
        "--batch_size=32",
        "--probe_size=64",
        "--eval_every=2",
        f"--train_steps={train_steps}",
        "--distribution_strategy=data_parallel",
        "--num_cpu_devices=4",
        "--sync_batch_norm",
        f"--data_dir={mnist_sigmoid_test.SHARED_DATA}",
        f"--model_dir={model_dir}",
    ]
    return multi_worker.run_workers(
        "trainers.mnist_sigmoid",
        [args, args],
        timeout_s=_TIMEOUT_S,
        cluster_env=multi_worker.keras_distribution_env,
    )


@pytest.mark.slow
class MultiProcessTest(absltest.TestCase):
    """Process 0 alone writes; a relaunch of both processes resumes at its checkpoint."""

    def test_process_0_writes_and_relaunch_resumes(self):
        if not os.path.isdir(os.path.join(mnist_sigmoid_test.SHARED_DATA, "mnist")):
            self.skipTest("real MNIST not present")
        model_dir = tempfile.mkdtemp()
        run_dir = os.path.join(model_dir, "batch_norm")
        for code, output in _launch_two_processes(model_dir, train_steps=2):
            self.assertEqual(code, 0, output[-3000:])
            self.assertIn("Global batch 32 = 8 replicas", output)
        self.assertLen(_event_files(run_dir), 1)
        self.assertEqual(os.listdir(os.path.join(run_dir, "checkpoints")), ["ckpt-2.npz"])

        for code, output in _launch_two_processes(model_dir, train_steps=4):
            self.assertEqual(code, 0, output[-3000:])
            self.assertIn("at step 2", output)  # Both processes resumed from process 0's file.
        self.assertEqual([e["step"] for e in _history(run_dir)["evals"]], [2, 4])
        # One event file per launch, process 0's: every evaluation logged once.
        self.assertLen(_event_files(run_dir), 2)
        tags = tensorboard_events.read_events(run_dir)
        self.assertEqual([s for s, _ in tags["train/loss"]], [2, 4])
        self.assertEqual([s for s, _ in tags["eval/test_accuracy"]], [2, 4])
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["runs"]["batch_norm"]["steps"], 4)
        self.assertEqual(summary["config"]["engine"], "jax")


if __name__ == "__main__":
    absltest.main()
