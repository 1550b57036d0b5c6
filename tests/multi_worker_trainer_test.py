"""The trainers across two MultiWorkerMirroredStrategy processes.

Inception's: only the chief may write into --model_dir: one event file, its
history and summary, its checkpoints, which restore into a fresh model; the
other worker checkpoints into its own temporary directory. The chief logs
the BN monitor's health while the other worker trains on. MNIST's (its
launches start in a third of Inception's time; the stops and relaunches go
through the same program): a SIGTERM to one worker stops both at one step;
when a worker is SIGKILLed mid-run, the chief ends within a minute in one
line naming it and the relaunch that resumes, which does; after the three
launches the chief's event files hold every evaluation once and no scratch
directory is left.
"""

import glob
import json
import os
import re
import subprocess
import tempfile
import time

from absl.testing import absltest
import numpy as np
import pytest
import tensorflow as tf

from tests import data_dirs
from tests import multi_worker
from tests import soak
from tests import tensorboard_events
from trainers.inception import recipes as inception_recipes
from trainers.inception import task as inception_task
from trainers.run import checkpoints
from trainers.run import event_files

_TIMEOUT_S = 300
_MODULE = "trainers.inception_bn"
# MNIST's two workers as the soak runs them (a checkpoint every 4 steps).
_MNIST = soak.Scenario("mnist", "tensorflow", workers=2, train_steps=60)
_LOSS_LIMIT_S = 60  # The survivor ends within this of a worker's loss.


def _args(model_dir, train_steps):
    return [
        "--use_fake_data",
        "--image_size=32",
        "--eval_every=1",
        "--eval_steps=1",
        "--batch_size=4",
        "--width_multiplier=0.05",  # What is all-reduced and checkpointed each step: 1/400.
        "--variant=bn_x5",
        "--distribution_strategy=multi_worker_mirrored",
        "--sync_batch_norm",
        f"--train_steps={train_steps}",
        f"--model_dir={model_dir}",
    ]


def _launch(model_dir, train_steps):
    args = _args(model_dir, train_steps)
    return multi_worker.run_workers(_MODULE, [args, args], timeout_s=_TIMEOUT_S)


def _await_checkpoint(model_dir, workers, after=0):
    """Waits for a chief's checkpoint of a step past `after`; False if a worker lost its port.

    Committed: listed in TensorFlow's `checkpoint` state file, written after
    the checkpoint's own files.
    """
    directory = os.path.join(model_dir, "checkpoints")

    def committed():
        latest = tf.train.latest_checkpoint(directory)
        return latest and int(latest.rsplit("-", 1)[1]) > after

    return multi_worker.wait_for(committed, workers, _TIMEOUT_S)


def _event_files(model_dir, end=False):
    """The launches' event files, or with `end` the run's end-of-run file."""
    paths = glob.glob(os.path.join(model_dir, "**", "events.out.tfevents.*"), recursive=True)
    return [p for p in paths if p.endswith(event_files.END_SUFFIX) == end]


@pytest.mark.slow
# One worker runs the tests that start several trainer processes (soak_test.py).
@pytest.mark.xdist_group("several_processes")
class MultiWorkerTrainerTest(absltest.TestCase):
    def test_chief_alone_writes(self):
        model_dir = tempfile.mkdtemp()
        for code, output in _launch(model_dir, train_steps=2):
            self.assertEqual(code, 0, output[-3000:])
        self.assertLen(_event_files(model_dir), 1)
        self.assertLen(_event_files(model_dir, end=True), 1)
        self.assertCountEqual(
            os.listdir(model_dir),
            ["checkpoints", "history.json", "summary.json", "trainer.json", "trainer.lock"]
            + [
                os.path.basename(f) for f in _event_files(model_dir) + _event_files(model_dir, True)
            ],
        )
        latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
        self.assertTrue(latest.endswith("-2"), latest)
        # The chief's checkpoint restores into a fresh model.
        model = inception_task.build_model(
            inception_recipes.RECIPES["bn_x5"],
            image_size=32,
            sync_batch_norm=True,
            width_multiplier=0.05,
        )
        step = tf.Variable(0, dtype=tf.int64)
        tf.train.Checkpoint(step=step, model=model).restore(
            latest
        ).expect_partial().assert_existing_objects_matched()
        self.assertEqual(int(step.numpy()), 2)
        self.assertFalse(all(np.all(np.asarray(v) == 0) for v in model.non_trainable_variables))
        with open(os.path.join(model_dir, "history.json")) as f:
            self.assertEqual([e["step"] for e in json.load(f)["evals"]], [1, 2])
        tags = tensorboard_events.read_events(model_dir)
        self.assertEqual([s for s, _ in tags["train/loss"]], [1, 2])
        # BN health, probed by the chief alone in its local replica.
        self.assertEqual([s for s, _ in tags["batch_norm/worst_train_inference_gap"]], [1, 2])

    def _stop_worker_1_after_a_checkpoint(self, model_dir, after, stop):
        """Launches MNIST's two workers, `stop`s worker 1 after a checkpoint past `after`.

        Returns `[(exit status, output)]` of both workers and the seconds from
        the stop to the chief's end. The chief still trains then: the run has
        `_MNIST.train_steps` steps, a checkpoint every `_MNIST.eval_every`.
        """
        args = _MNIST.args(model_dir)
        run_dir = os.path.join(model_dir, *_MNIST.run_dirs)
        for _ in range(3):  # Launches retried while a worker loses its port.
            with multi_worker.started_workers(_MNIST.module, [args, args]) as workers:
                if not _await_checkpoint(run_dir, workers, after):
                    continue
                stop(workers[1].process)
                stopped = time.monotonic()
                try:
                    workers[0].process.wait(timeout=_LOSS_LIMIT_S)
                except subprocess.TimeoutExpired:
                    self.fail(f"The chief still ran {_LOSS_LIMIT_S} s after worker 1 stopped")
                seconds = time.monotonic() - stopped
                ends = [(w.process.wait(timeout=_TIMEOUT_S), w.output()) for w in workers]
            return ends, seconds
        self.fail("Every launch lost a port")

    def test_sigterm_to_one_worker_then_a_lost_worker_then_relaunch(self):
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not at {data_dirs.SHARED_DATA}")
        model_dir = tempfile.mkdtemp()
        run_dir = os.path.join(model_dir, *_MNIST.run_dirs)

        # A SIGTERM to one machine stops both workers at one step, checkpointed
        # once (the workers agree by an all-reduce of their stop requests).
        ends, _ = self._stop_worker_1_after_a_checkpoint(model_dir, 0, lambda p: p.terminate())
        steps = set()
        for code, output in ends:
            self.assertEqual(code, 143, output[-3000:])
            stopped = re.search(r"stopped at step (\d+) on SIGTERM; checkpoint saved", output)
            self.assertIsNotNone(stopped, output[-3000:])
            self.assertNotIn("Traceback", output)
            steps.add(int(stopped[1]))
        self.assertLen(steps, 1)
        (step,) = steps
        self.assertLess(step, _MNIST.train_steps)

        # A worker SIGKILLed: the chief ends in one line naming it and the checkpoint.
        ends, seconds = self._stop_worker_1_after_a_checkpoint(model_dir, step, lambda p: p.kill())
        code, output = ends[0]
        scratch = checkpoints.worker_scratch_dir(run_dir, "worker_1")
        self.assertTrue(os.path.isdir(scratch))  # Left by worker 1's SIGKILL.
        self.assertLess(seconds, _LOSS_LIMIT_S)
        self.assertNotEqual(code, 0, output[-3000:])
        self.assertIn(f"at step {step}", output)  # It resumed from the stop's checkpoint.
        self.assertNotIn("Traceback", output)
        last_line = [line for line in output.splitlines() if line.strip()][-1]
        error = re.fullmatch(
            r"mnist_sigmoid: error: lost worker 1 \(127\.0\.0\.1:\d+\) of this job; .*Relaunch "
            r"every worker with the same command: it resumes from the last checkpoint, step "
            r"(\d+) \(.*\)\.",
            last_line,
        )
        self.assertIsNotNone(error, last_line)
        step = int(error[1])
        self.assertLess(step, _MNIST.train_steps)

        args = _MNIST.args(model_dir)
        for code, output in multi_worker.run_workers(
            _MNIST.module, [args, args], timeout_s=_TIMEOUT_S
        ):
            self.assertEqual(code, 0, output[-3000:])
            self.assertRegex(output, rf"at step {step}\b")  # Both from the chief's checkpoint.
        # The chief alone wrote, one event file per launch (three), and one
        # end-of-run file: every evaluation logged once, none lost to the stops.
        self.assertLen(_event_files(run_dir), 3)
        self.assertLen(_event_files(run_dir, end=True), 1)
        every = list(range(_MNIST.eval_every, _MNIST.train_steps + 1, _MNIST.eval_every))
        tags = tensorboard_events.read_events(run_dir)
        self.assertEqual([s for s, _ in tags["train/loss"]], every)
        with open(os.path.join(run_dir, "history.json")) as f:
            history = json.load(f)
        self.assertEqual(
            (history["steps"], [e["step"] for e in history["evals"]]), (_MNIST.train_steps, every)
        )
        self.assertFalse(os.path.exists(scratch))  # Gone after the relaunch's end.


if __name__ == "__main__":
    absltest.main()
