"""The trainers on the JAX engine: DataParallel over 8 host devices and over 2 processes.

Runs under `KERAS_BACKEND=jax` in its own process (`.ci/run`), where
conftest.py gives JAX 8 host devices. tests/mnist_sigmoid_test.py runs
there too (the MNIST trainer's outputs, resume and the synchronised-BN check
on 8 devices); this file adds what only the JAX engine has: its orbax
checkpoints (file:// run directories, damaged and half-written checkpoints),
DataParallel and the 2-process job.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import flag_state
from tests import mnist_sigmoid_test
from tests import multi_worker
from tests import run_outputs
from tests import tensorboard_events
from trainers.run import checkpoints
from trainers.run import errors
from trainers.run import event_files
from trainers.run import model_dirs

if keras.backend.backend() != "jax":
    pytest.skip(
        "The JAX engine's tests run under KERAS_BACKEND=jax in their own process (.ci/run)",
        allow_module_level=True,
    )

_TIMEOUT_S = 420
# The survivor ends within this of a process's loss: at once on gloo's reset
# connection, else when JAX's coordination service misses the lost process's
# heartbeats (100 s by default); a hang would last to JAX's 300 s shutdown barrier.
_LOSS_LIMIT_S = 150


def setUpModule():
    flag_state.ensure_parsed()  # The in-process trainer runs read absl flags.


def _event_files(run_dir):
    """The event files of `run_dir`'s launches (not the end-of-run summaries' own file)."""
    paths = glob.glob(os.path.join(run_dir, event_files.PATTERN))
    return [p for p in paths if not p.endswith(event_files.END_SUFFIX)]


def _history(run_dir):
    with open(os.path.join(run_dir, "history.json")) as f:
        return json.load(f)


def _run_at_file_url(model_dir, **overrides):
    """`mnist_sigmoid_test._run` of the BN network with `--model_dir=file://<model_dir>`."""
    # _run reads the summary with `open`, which takes no URL; GFile does.
    with mock.patch.object(mnist_sigmoid_test, "open", tf.io.gfile.GFile, create=True):
        return mnist_sigmoid_test._run("file://" + model_dir, norm="batch_norm", **overrides)


def _checkpoints(run_dir):
    """The entries of the run's orbax checkpoint directory (committed steps are bare numbers)."""
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


def _damage(step_dir):
    """Overwrites the array data files of the orbax checkpoint in `step_dir` with garbage."""
    data_files = glob.glob(os.path.join(step_dir, "**", "d", "*"), recursive=True)
    assert data_files, f"no array data files under {step_dir}"
    for path in data_files:
        with open(path, "wb") as f:
            f.write(b"garbage")


def _tiny_model(units):
    """A Dense + BatchNormalization model and its built SGD optimizer."""
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(units), keras.layers.BatchNormalization()]
    )
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer


class OrbaxCheckpointerTest(absltest.TestCase):
    """The checkpointer alone, on a small model (the trainer runs are below)."""

    def test_round_trip_keeps_the_newest_and_refuses_another_model(self):
        run_dir = tempfile.mkdtemp()
        model, optimizer = _tiny_model(4)
        checkpointer = checkpoints.OrbaxCheckpointer(run_dir, 2, model, optimizer)
        self.assertEqual(checkpointer.restore(), 0)
        for step in (2, 4, 6):
            checkpointer.save(step)
        self.assertEqual(checkpointer.steps(), [4, 6])
        self.assertEqual(_checkpoints(run_dir), ["4", "6"])
        checkpointer.close()

        restored, restored_optimizer = _tiny_model(4)  # Other initial values.
        checkpointer = checkpoints.OrbaxCheckpointer(run_dir, 2, restored, restored_optimizer)
        self.assertEqual(checkpointer.restore(), 6)
        checkpointer.close()
        pairs = zip(
            model.variables + optimizer.variables,
            restored.variables + restored_optimizer.variables,
        )
        for saved, loaded in pairs:
            np.testing.assert_array_equal(saved.numpy(), loaded.numpy(), err_msg=saved.path)

        other, other_optimizer = _tiny_model(5)
        checkpointer = checkpoints.OrbaxCheckpointer(run_dir, 2, other, other_optimizer)
        with self.assertRaisesRegex(errors.InputError, r"checkpoints/6 is of another model"):
            checkpointer.restore()
        checkpointer.close()


@pytest.mark.integration
class FileUrlAndDamagedCheckpointsTest(absltest.TestCase):
    """MNIST runs in `file://` run directories, relaunched over damaged checkpoints."""

    def test_file_url_run_checkpoints_and_resumes(self):
        model_dir = tempfile.mkdtemp()
        run_dir = os.path.join(model_dir, "batch_norm")
        _run_at_file_url(model_dir, train_steps=4)
        self.assertEqual(_checkpoints(run_dir), ["4"])
        # model_dirs locked the URL's local directory.
        self.assertTrue(os.path.exists(os.path.join(model_dir, model_dirs.LOCK)))
        summary = _run_at_file_url(model_dir, train_steps=8)
        self.assertEqual(summary["runs"]["batch_norm"]["steps"], 8)
        self.assertEqual([e["step"] for e in _history(run_dir)["evals"]], [4, 8])
        self.assertEqual(_checkpoints(run_dir), ["4", "8"])

    def test_damaged_newest_checkpoint_falls_back_then_all_damaged_is_one_error(self):
        model_dir = tempfile.mkdtemp()
        run_dir = os.path.join(model_dir, "batch_norm")
        mnist_sigmoid_test._run(model_dir, norm="batch_norm", train_steps=8)
        _damage(os.path.join(run_dir, "checkpoints", "8"))
        with self.assertLogs("absl", level="WARNING") as logs:
            mnist_sigmoid_test._run(model_dir, norm="batch_norm", train_steps=12)
        unreadable = [r.getMessage() for r in logs.records if "unreadable" in r.getMessage()]
        self.assertLen(unreadable, 1)
        self.assertIn(os.path.join(run_dir, "checkpoints", "8"), unreadable[0])
        self.assertNotIn("\n", unreadable[0])
        # Resumed at step 4: step 8 trained again, then 12.
        self.assertEqual([e["step"] for e in _history(run_dir)["evals"]], [4, 8, 12])
        self.assertCountEqual(_checkpoints(run_dir), ["8", "12"])

        for step in ("8", "12"):
            _damage(os.path.join(run_dir, "checkpoints", step))
        # The trainer ends with the checkpointer's `errors.InputError` as one line.
        with self.assertRaises(SystemExit) as raised:
            mnist_sigmoid_test._run(model_dir, norm="batch_norm", train_steps=16)
        message = str(raised.exception.code)
        self.assertRegex(message, r"^mnist_sigmoid: error: No checkpoint in \S+ is readable")
        self.assertNotIn("\n", message)
        for step in ("8", "12"):
            self.assertIn(os.path.join(run_dir, "checkpoints", step), message)

    def test_leftover_temporary_directory_of_a_killed_save_is_ignored(self):
        model_dir = tempfile.mkdtemp()
        run_dir = os.path.join(model_dir, "batch_norm")
        mnist_sigmoid_test._run(model_dir, norm="batch_norm", train_steps=4)
        # What a save of step 8 killed halfway leaves: orbax's temporary directory.
        leftover = os.path.join(run_dir, "checkpoints", "8.orbax-checkpoint-tmp", "default")
        os.makedirs(leftover)
        with open(os.path.join(leftover, "_METADATA"), "w") as f:
            f.write("{half a")
        mnist_sigmoid_test._run(model_dir, norm="batch_norm", train_steps=8)
        self.assertEqual([e["step"] for e in _history(run_dir)["evals"]], [4, 8])
        self.assertEqual(_checkpoints(run_dir), ["4", "8"])


@pytest.mark.integration
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
            # The same program at 5% width: 80 s on 2 cores instead of 116, most of it compiling.
            "--width_multiplier=0.05",
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


def _two_process_args(model_dir, train_steps):
    """The MNIST BN network over 2 processes × 4 host devices, synchronised BN."""
    return [
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


def _launch_two_processes(model_dir, train_steps):
    args = _two_process_args(model_dir, train_steps)
    return multi_worker.run_workers(
        "trainers.mnist_sigmoid",
        [args, args],
        timeout_s=_TIMEOUT_S,
        cluster_env=multi_worker.keras_distribution_env,
    )


def _committed_steps(run_dir):
    directory = os.path.join(run_dir, "checkpoints")
    return (
        {int(n) for n in os.listdir(directory) if n.isdigit()}
        if os.path.isdir(directory)
        else set()
    )


def _kill_after_a_new_checkpoint(model_dir, victim):
    """Starts both processes, kills `victim` after a checkpoint newer than the present ones.

    Returns the survivor's exit status, its seconds from the kill to its
    end, and its output (the watcher's last line included), or None when a
    process lost its port first.
    """
    run_dir = os.path.join(model_dir, "batch_norm")
    before = _committed_steps(run_dir)
    args = _two_process_args(model_dir, train_steps=30)
    env = multi_worker.keras_distribution_env
    with multi_worker.started_workers(
        "trainers.mnist_sigmoid", [args, args], cluster_env=env
    ) as ws:
        if not multi_worker.wait_for(lambda: _committed_steps(run_dir) - before, ws, _TIMEOUT_S):
            return None
        ws[victim].process.kill()
        killed = time.monotonic()
        survivor = ws[1 - victim]
        try:
            code = survivor.process.wait(timeout=_LOSS_LIMIT_S)
        except subprocess.TimeoutExpired:
            code = None  # Still running: the caller's assertion shows its output.
        seconds = time.monotonic() - killed
        # The watcher, a process of its own, may write the last line just after.
        written_by = time.monotonic() + 10
        while time.monotonic() < written_by and ": error: " not in survivor.output():
            time.sleep(0.1)
        return code, seconds, survivor.output()


@pytest.mark.slow
class MultiProcessTest(absltest.TestCase):
    """Process 0 alone writes the events; a relaunch of both processes resumes at the checkpoint.

    A lost process ends the other in one line; a SIGTERM to one stops both at
    one step, and the relaunch ends as the uninterrupted run did.
    """

    def test_a_lost_process_ends_the_other_in_one_line_and_relaunch_resumes(self):
        if not os.path.isdir(os.path.join(mnist_sigmoid_test.SHARED_DATA, "mnist")):
            self.skipTest("real MNIST not present")
        model_dir = tempfile.mkdtemp()
        # Process 1 lost: process 0 sees gloo's reset connection in Python.
        # Process 0 (the coordinator) lost: JAX's client aborts process 1,
        # and the watcher says the line.
        for victim in (1, 0):
            for _ in range(3):  # Launches retried while a process loses its port.
                ended = _kill_after_a_new_checkpoint(model_dir, victim)
                if ended is not None:
                    break
            else:
                self.fail("Every launch lost a port")
            code, seconds, output = ended
            self.assertIsNotNone(code, f"process {1 - victim} still ran: {output[-3000:]}")
            self.assertLess(seconds, _LOSS_LIMIT_S)
            self.assertNotEqual(code, 0, output[-3000:])
            for dump in ("Traceback", "Check failure", "Fatal Python error"):
                self.assertNotIn(dump, output)
            last_line = [line for line in output.splitlines() if line.strip()][-1]
            coordinator = r" \(the coordinator, 127\.0\.0\.1:\d+\)"
            # Killed mid-transfer, gloo aborts the survivor itself (naming no peer).
            lost = rf"lost process {victim}{coordinator if victim == 0 else ''} of this job"
            error = re.fullmatch(
                rf"mnist_sigmoid: error: ({lost}|a collective with the other processes aborted "
                rf"in gloo, .*); this is process {1 - victim}\b.* Relaunch every process with "
                r"the same command: it resumes from the last checkpoint, step (\d+) \(.*\)\.",
                last_line,
            )
            self.assertIsNotNone(error, last_line)
            self.assertEqual(int(error[2]), max(_committed_steps(f"{model_dir}/batch_norm")))

        for code, output in _launch_two_processes(model_dir, train_steps=30):
            self.assertEqual(code, 0, output[-3000:])
            self.assertRegex(output, rf"at step {error[2]}\b")
        with open(os.path.join(model_dir, "summary.json")) as f:
            self.assertEqual(json.load(f)["runs"]["batch_norm"]["steps"], 30)

    def test_sigterm_to_one_process_stops_both_at_one_step_and_relaunch_resumes(self):
        if not os.path.isdir(os.path.join(mnist_sigmoid_test.SHARED_DATA, "mnist")):
            self.skipTest("real MNIST not present")
        whole, model_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
        for code, output in _launch_two_processes(whole, train_steps=12):
            self.assertEqual(code, 0, output[-3000:])
            self.assertIn("Global batch 32 = 8 replicas", output)
        whole_run = os.path.join(whole, "batch_norm")
        self.assertLen(_event_files(whole_run), 1)  # Process 0's alone.
        # Each orbax step written once: no half-written or second copy left.
        committed = _committed_steps(whole_run)
        self.assertIn(12, committed)
        self.assertEqual(_checkpoints(whole_run), sorted(str(s) for s in committed))
        args = _two_process_args(model_dir, train_steps=12)
        env = multi_worker.keras_distribution_env
        run_dir = os.path.join(model_dir, "batch_norm")
        with multi_worker.started_workers(
            "trainers.mnist_sigmoid", [args, args], cluster_env=env
        ) as ws:
            # Training, past its first evaluation (a lost port fails the test: rare).
            self.assertTrue(
                multi_worker.wait_for(lambda: _committed_steps(run_dir), ws, _TIMEOUT_S)
            )
            ws[1].process.send_signal(signal.SIGTERM)  # A scheduler's notice to one machine.
            ended = [(w.process.wait(timeout=_LOSS_LIMIT_S), w.output()) for w in ws]
        steps = set()
        for code, output in ended:
            self.assertEqual(code, 143, output[-3000:])  # Both stop, as on a SIGTERM.
            stopped = re.search(
                r"stopped at step (\d+) on SIGTERM; checkpoint saved; relaunch the same command",
                output,
            )
            self.assertIsNotNone(stopped, output[-3000:])
            self.assertNotIn("Traceback", output)
            steps.add(int(stopped[1]))
        self.assertLen(steps, 1)  # Agreed: one step, checkpointed once for both.
        (step,) = steps
        self.assertLess(step, 12)
        self.assertIn(step, _committed_steps(run_dir))

        for code, output in _launch_two_processes(model_dir, train_steps=12):
            self.assertEqual(code, 0, output[-3000:])
            self.assertRegex(output, rf"at step {step}\b")
        self.assertEqual(
            run_outputs.read_json(os.path.join(run_dir, "history.json")),
            run_outputs.read_json(os.path.join(whole_run, "history.json")),
        )
        # One event file per launch, process 0's: every evaluation logged once.
        self.assertLen(_event_files(run_dir), 2)
        tags, whole_tags = (tensorboard_events.read_events(d) for d in (run_dir, whole_run))
        evaluations = list(range(2, 13, 2))
        for tag in ("train/loss", "eval/test_accuracy"):
            self.assertEqual([s for s, _ in tags[tag]], evaluations, tag)
            self.assertEqual([s for s, _ in whole_tags[tag]], evaluations, tag)
        with open(os.path.join(model_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["runs"]["batch_norm"]["steps"], 12)
        self.assertEqual(summary["config"]["engine"], "jax")


if __name__ == "__main__":
    absltest.main()
