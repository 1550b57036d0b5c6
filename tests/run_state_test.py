"""The trainers' run state: commit order, checkpoint fallback, config changes, event files.

The MNIST trainer runs in this process on mock data (tests/mnist_sigmoid_test.py's
`_run`), under the suite's Keras backend; what only TensorFlow's checkpoints have
(the state file, `_temp` directories) is skipped on JAX. Kills and other faults at
random are the fault soak's (tests/soak.py, tests/soak_test.py).
"""

import glob
import json
import os
import shutil
import tempfile

from absl.testing import absltest
import keras
import pytest
import tensorflow as tf

from tests import data_dirs
from tests import flag_state
from tests import inception_bn_test
from tests import mnist_sigmoid_test
from tests import run_outputs
from tests import tensorboard_events
from trainers.run import checkpoints
from trainers.run import errors
from trainers.run import event_files
from trainers.run import run_state

_run = mnist_sigmoid_test._run


def setUpModule():
    flag_state.ensure_parsed()


def _history(run_dir):
    with open(os.path.join(run_dir, "history.json")) as f:
        return json.load(f)


def _steps(run_dir):
    return [e["step"] for e in _history(run_dir)["evals"]]


def _garble(path):
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        f.write(b"\xff" * max(size, 16))


def _tf_checkpoint_files(run_dir, step):
    return glob.glob(os.path.join(run_dir, "checkpoints", f"ckpt-{step}.*"))


class _Restored:
    """A checkpointer that holds a checkpoint of `step`, restored whatever `newest` says."""

    job = checkpoints.OneProcess

    def __init__(self, step):
        self.step = step

    def restore(self, newest=None):
        return self.step if newest is None or newest >= self.step else 0

    def close(self):
        pass


class IdentityTest(absltest.TestCase):
    """A relaunch's identity check, on a history file alone (no trainer)."""

    def _relaunch(self, recorded_data, data):
        run_dir = tempfile.mkdtemp()
        history = {"evals": [{"step": 4}], "steps": 4, "wall_time_s": 1.0}
        history["identity"] = {"seed": 0, "data": recorded_data}
        with open(os.path.join(run_dir, "history.json"), "w") as f:
            json.dump(history, f)
        identity = {"seed": 0, "data": data}
        with run_state.RunState(run_dir, _Restored(4), {}, identity, 8) as run:
            return run.start, run.history["identity"]

    def test_a_run_recorded_before_the_content_digest_resumes_and_records_it(self):
        old = {"splits": {"train": {"bytes": 10, "examples": 1}}}
        new = {"splits": {"train": {"bytes": 10, "examples": 1, "digest": "ab"}}}
        self.assertEqual(self._relaunch(old, new), (4, {"seed": 0, "data": new}))

    def test_other_content_of_the_same_size_is_refused(self):
        old = {"splits": {"train": {"bytes": 10, "examples": 1, "digest": "ab"}}}
        new = {"splits": {"train": {"bytes": 10, "examples": 1, "digest": "cd"}}}
        with self.assertRaisesRegex(errors.InputError, r"data\.splits\.train\.digest='ab' → 'cd'"):
            self._relaunch(old, new)


class _Trainer(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.model_dir = tempfile.mkdtemp()
        self.run_dir = os.path.join(self.model_dir, "batch_norm")

    def run_trainer(self, **overrides):
        return _run(self.model_dir, norm="batch_norm", **overrides)


@pytest.mark.integration
class ConfigChangeTest(_Trainer):
    def test_relaunch_with_other_seed_and_batch_is_refused_in_one_line(self):
        self.run_trainer(train_steps=4)
        with self.assertRaisesRegex(
            (errors.InputError, SystemExit),
            r"holds a run at step 4 with other settings \(batch_size=20 → 10, seed=1 → 2\).*"
            r"--allow_config_change",
        ):
            self.run_trainer(seed=2, batch_size=10)
        self.assertEqual(_steps(self.run_dir), [4])

    def test_allowed_change_resumes_and_is_recorded(self):
        self.run_trainer(train_steps=4)
        self.run_trainer(learning_rate=0.1, allow_config_change=True)
        history = _history(self.run_dir)
        self.assertEqual(_steps(self.run_dir), [4, 8])
        self.assertEqual(
            history["config_changes"], [{"step": 4, "changed": {"learning_rate": [0.5, 0.1]}}]
        )
        self.assertEqual(history["identity"]["learning_rate"], 0.1)

    def test_more_steps_are_no_change(self):
        self.run_trainer(train_steps=4)
        self.run_trainer(train_steps=8, eval_every=2)
        self.assertEqual(_steps(self.run_dir), [4, 6, 8])
        self.assertNotIn("config_changes", _history(self.run_dir))


@pytest.mark.integration
class EndOfRunTest(_Trainer):
    def test_end_lost_after_the_last_checkpoint_is_logged_once_by_the_relaunch(self):
        self.run_trainer()
        # What a kill between the last checkpoint and the end's commit leaves.
        history = _history(self.run_dir)
        history["finished"] = False
        with open(os.path.join(self.run_dir, "history.json"), "w") as f:
            json.dump(history, f)
        for path in event_files.paths(self.run_dir):
            if path.endswith(event_files.END_SUFFIX):
                os.remove(path)
        tags = tensorboard_events.read_events(self.run_dir)
        self.assertNotIn("hparams/final_test_accuracy", tags)

        self.run_trainer()
        tags = tensorboard_events.read_events(self.run_dir)
        self.assertEqual([s for s, _ in tags["hparams/final_test_accuracy"]], [8])
        self.assertEqual([s for s, _ in tags["eval/test_accuracy"]], [4, 8])
        self.assertTrue(_history(self.run_dir)["finished"])

    def test_extended_run_logs_its_end_at_the_new_last_step_only(self):
        self.run_trainer(train_steps=4)
        self.run_trainer(train_steps=8)
        tags = tensorboard_events.read_events(self.run_dir)
        self.assertEqual([s for s, _ in tags["hparams/final_test_accuracy"]], [8])
        root = tensorboard_events.read_events(self.model_dir)
        self.assertEqual([s for s, _ in root["figure1"]], [8])  # The root's launches: one figure.


@pytest.mark.integration
class CheckpointFallbackTest(_Trainer):
    def setUp(self):
        super().setUp()
        if keras.backend.backend() != "tensorflow":
            self.skipTest("TensorFlow's checkpoint files; trainer_jax_test.py tests JAX's")

    def test_unreadable_latest_checkpoint_falls_back_to_the_older_one(self):
        self.run_trainer()
        for path in _tf_checkpoint_files(self.run_dir, 8):
            if ".data-" in path:
                _garble(path)
        with self.assertLogs(level="WARNING") as logs:
            self.run_trainer(train_steps=12)
        self.assertTrue(any("ckpt-8 is unreadable" in line for line in logs.output), logs.output)
        self.assertEqual(_steps(self.run_dir), [4, 8, 12])
        tags = tensorboard_events.read_events(self.run_dir)
        self.assertEqual([s for s, _ in tags["eval/test_accuracy"]], [4, 8, 12])

    def test_no_readable_checkpoint_names_the_files(self):
        self.run_trainer()
        for step in (4, 8):
            for path in _tf_checkpoint_files(self.run_dir, step):
                _garble(path)
        with self.assertRaisesRegex(
            (errors.InputError, SystemExit),
            r"No checkpoint in .* is readable \(.*ckpt-8, .*ckpt-4; the newest: ",
        ):
            self.run_trainer(train_steps=12)

    def test_garbled_state_file_is_rebuilt_not_restarted(self):
        self.run_trainer()
        state = os.path.join(self.run_dir, "checkpoints", "checkpoint")
        with open(state, "w") as f:
            f.write("garbage {{")
        os.makedirs(os.path.join(self.run_dir, "checkpoints", "ckpt-12_temp"))
        self.run_trainer(train_steps=12)
        self.assertEqual(_steps(self.run_dir), [4, 8, 12])
        self.assertEqual(
            os.path.basename(tf.train.latest_checkpoint(os.path.dirname(state))), "ckpt-12"
        )
        self.assertFalse(glob.glob(os.path.join(self.run_dir, "checkpoints", "*_temp")))

    def _killed_save(self, step, copied_step):
        """`ckpt-<step>` as a save killed while TensorFlow wrote its index (not committed)."""
        for path in _tf_checkpoint_files(self.run_dir, copied_step):
            killed = path.replace(f"ckpt-{copied_step}.", f"ckpt-{step}.")
            shutil.copy(path, killed)
            if killed.endswith(".index"):
                with open(killed, "r+b") as f:
                    f.truncate(f.seek(0, os.SEEK_END) // 2)

    def test_a_killed_uncommitted_save_is_removed(self):
        self.run_trainer()
        self._killed_save(12, copied_step=8)
        with self.assertLogs(level="WARNING") as logs:
            self.run_trainer(train_steps=12)
        self.assertTrue(
            any("ckpt-12: a save killed before its commit" in line for line in logs.output),
            logs.output,
        )
        self.assertEqual(_steps(self.run_dir), [4, 8, 12])

    def test_a_killed_first_save_starts_the_run_over(self):
        self.run_trainer(train_steps=4)
        self._killed_save(8, copied_step=4)
        checkpoints = os.path.join(self.run_dir, "checkpoints")
        for path in _tf_checkpoint_files(self.run_dir, 4) + [
            os.path.join(checkpoints, "checkpoint")
        ]:
            os.remove(path)  # As if step 8's save were the run's first.
        os.remove(os.path.join(self.run_dir, "history.json"))
        self.run_trainer(train_steps=8)
        self.assertEqual(_steps(self.run_dir), [4, 8])
        self.assertEqual(os.path.basename(tf.train.latest_checkpoint(checkpoints)), "ckpt-8")

    def test_lost_state_file_is_rebuilt(self):
        self.run_trainer()
        os.remove(os.path.join(self.run_dir, "checkpoints", "checkpoint"))
        self.run_trainer(train_steps=12)
        self.assertEqual(_steps(self.run_dir), [4, 8, 12])


class DeterminismTest(absltest.TestCase):
    """The same command and seed twice: bit-identical histories (measured times aside)."""

    def _twice(self, train):
        histories = []
        for _ in range(2):
            run_dir = train(tempfile.mkdtemp())
            histories.append(run_outputs.read_json(os.path.join(run_dir, "history.json")))
        self.assertEqual(histories[0], histories[1])
        return histories[0]

    @pytest.mark.integration
    def test_mnist(self):
        def train(model_dir):
            _run(model_dir, norm="batch_norm")
            return os.path.join(model_dir, "batch_norm")

        self.assertLen(self._twice(train)["evals"], 2)

    @pytest.mark.slow
    def test_inception_on_real_fashion_mnist_with_distortions_and_shuffling(self):
        if not os.path.isdir(data_dirs.SHARED_DATA):
            self.skipTest(f"real Fashion-MNIST not at {data_dirs.SHARED_DATA}")

        def train(model_dir):
            inception_bn_test._smoke(
                model_dir,
                use_fake_data=False,
                dataset="fashion_mnist",
                data_dir=data_dirs.SHARED_DATA,
                train_steps=6,
                eval_steps=2,
            )
            return model_dir

        self.assertLen(self._twice(train)["evals"], 3)


class EventFilesTest(absltest.TestCase):
    def _write(self, run_dir, steps):
        writer = tf.summary.create_file_writer(run_dir)
        with writer.as_default():
            for step in steps:
                tf.summary.scalar("loss", float(step), step=step)
        writer.close()

    def test_keep_through_drops_later_steps_and_a_torn_record(self):
        run_dir = tempfile.mkdtemp()
        self._write(run_dir, [1, 2, 3, 4])
        (path,) = event_files.paths(run_dir)
        with open(path, "ab") as f:
            f.write(b"\x20\x00\x00\x00")  # A record cut off inside its length field.
        self.assertEqual(event_files.keep_through(run_dir, 2), 2)
        self.assertEqual(tensorboard_events.read_events(run_dir)["loss"], [(1, 1.0), (2, 2.0)])
        self.assertEqual(event_files.keep_through(run_dir, 2), 0)  # Nothing left to drop.

    def test_keep_through_step_0_deletes_every_file(self):
        run_dir = tempfile.mkdtemp()
        self._write(run_dir, [0, 1])
        event_files.keep_through(run_dir, 0)
        self.assertEqual(event_files.paths(run_dir), [])


if __name__ == "__main__":
    absltest.main()
