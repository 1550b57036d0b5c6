"""How the workers of a job agree on the checkpoint they resume from, and what saves leave.

The agreement runs through the job's collectives (`checkpoints.OneProcess`
names them); here a job of two workers is stood in for by `_PairedJob`,
which plays the other worker's answers, so the protocol's cases run in one
process. The TensorFlow checkpointer's own files are checked on a small
model: a non-chief worker's scratch directory (one a killed launch left
included), the removal of old and stale checkpoints. On JAX, a damaged orbax
checkpoint is passed over without the tracebacks of its abandoned reads.
"""

import logging as std_logging
import os
import subprocess
import sys
import tempfile
import types
from unittest import mock

from absl import logging as absl_logging
from absl.testing import absltest
import keras
import pytest
import tensorflow as tf

from tests import multi_worker
from trainers.run import checkpoints
from trainers.run import errors


class _PairedJob:
    """A job of two workers seen from one of them; `other(step)` says how the other's read of
    `step` went: "ok", "damaged" or "passing"."""

    num_workers = 2

    def __init__(self, is_chief, chief_steps=(), other=lambda step: "ok"):
        self.is_chief = is_chief
        self._chief_steps = list(chief_steps)
        self._other = other
        self.named = []
        self._asked = 0  # The questions about the last named step: passing, then unreadable.

    def chief_value(self, value):
        if not self.is_chief:  # The chief names its next candidate.
            value = self._chief_steps.pop(0) if self._chief_steps else 0
        self.named.append(value)
        self._asked = 0
        return value

    def any_worker(self, flag):
        other = self._other(self.named[-1])
        self._asked += 1
        if self._asked == 1:  # Did any read fail in passing?
            return flag or other == "passing"
        return flag or other != "ok"  # Did any read fail?


class RestoreAgreementTest(absltest.TestCase):
    def test_every_worker_resumes_where_all_of_them_read(self):
        read = []
        job = _PairedJob(is_chief=True, other=lambda step: "damaged" if step == 12 else "ok")
        with self.assertLogs("absl", level="INFO") as logs:
            step = checkpoints.restore_newest_readable(
                [(12, "ckpt-12"), (8, "ckpt-8")], read.append, "checkpoints", job
            )
        self.assertEqual((step, read), (8, [12, 8]))
        messages = [r.getMessage() for r in logs.records]
        self.assertIn(
            "Checkpoint ckpt-12 is unreadable on another worker, trying an older one", messages
        )
        self.assertIn("Resumed from ckpt-8 at step 8 (all 2 workers)", messages)

    def test_a_worker_follows_the_steps_the_chief_names_not_its_own_listing(self):
        read = []

        def reader(step):
            read.append(step)
            if step == 12:
                raise ValueError("read less bytes than requested")

        job = _PairedJob(is_chief=False, chief_steps=[12, 8])
        self.assertEqual(checkpoints.restore_newest_readable([], reader, "checkpoints", job), 8)
        self.assertEqual(read, [12, 8])

    def test_a_passing_failure_anywhere_stops_every_worker_and_passes_over_nothing(self):
        read = []
        job = _PairedJob(is_chief=True, other=lambda step: "passing")
        with self.assertRaisesRegex(
            errors.InputError,
            r"^Checkpoint ckpt-12 could not be read just now \(it failed on another worker\), "
            r"which is no sign of damage: relaunch the same command to read it again\.$",
        ):
            checkpoints.restore_newest_readable(
                [(12, "ckpt-12"), (8, "ckpt-8")], read.append, "checkpoints", job
            )
        self.assertEqual(read, [12])

        def unavailable(step):
            raise tf.errors.UnavailableError(None, None, "the store is busy")

        with self.assertRaisesRegex(errors.InputError, r"UnavailableError: the store is busy"):
            checkpoints.restore_newest_readable([(12, "ckpt-12"), (8, "ckpt-8")], unavailable, "c")

    def test_the_chief_preparing_the_directory_in_vain_stops_every_worker(self):
        job = _PairedJob(is_chief=False, chief_steps=[-1])
        with self.assertRaisesRegex(errors.InputError, r"The chief could not prepare checkpoints"):
            checkpoints.restore_newest_readable([], lambda step: None, "checkpoints", job)

    def test_none_readable_by_every_worker_is_one_error(self):
        job = _PairedJob(is_chief=True, other=lambda step: "damaged")
        with self.assertRaisesRegex(
            errors.InputError,
            r"No checkpoint in checkpoints is readable \(ckpt-12, ckpt-8; the newest: unreadable "
            r"on another worker\)",
        ):
            checkpoints.restore_newest_readable(
                [(12, "ckpt-12"), (8, "ckpt-8")], lambda step: None, "checkpoints", job
            )


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _checkpointer(run_dir, job=None, worker="chief"):
    step = tf.Variable(0, dtype=tf.int64)
    return checkpoints.TFCheckpointer(run_dir, 2, step, *_model(), job=job, worker=worker)


class TFCheckpointerFilesTest(absltest.TestCase):
    def test_a_non_chief_scratch_directory_a_killed_launch_left_is_removed(self):
        tmp, run_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
        with mock.patch.object(tempfile, "tempdir", tmp):
            scratch = checkpoints.worker_scratch_dir(run_dir, "worker_1")
            os.makedirs(os.path.join(scratch, "ckpt-4_temp"))  # What a SIGKILL left.
            job = _PairedJob(is_chief=False)
            checkpointer = _checkpointer(run_dir, job, "worker_1")
            self.assertEqual(os.listdir(scratch), [])
            checkpointer.save(4)
            self.assertEqual(os.listdir(scratch), [])  # Emptied after each save.
            checkpointer.close()
            self.assertEqual(os.listdir(tmp), [])
        self.assertFalse(os.path.exists(os.path.join(run_dir, "checkpoints")))

    def test_saves_keep_the_newest_and_drop_stale_later_ones(self):
        run_dir = tempfile.mkdtemp()
        checkpointer = _checkpointer(run_dir)
        for step in (4, 8, 12):
            checkpointer.save(step)
        directory = os.path.join(run_dir, "checkpoints")
        self.assertEqual([s for s, _ in checkpoints.checkpoint_prefixes(directory)], [12, 8])
        # A relaunch that went back to step 8 (12 was unreadable then) saves 10, then 12.
        self.assertEqual(_checkpointer(run_dir).restore(newest=8), 8)
        checkpointer.save(10)
        self.assertEqual([s for s, _ in checkpoints.checkpoint_prefixes(directory)], [10, 8])
        state = tf.train.get_checkpoint_state(directory)
        self.assertEqual(os.path.basename(state.model_checkpoint_path), "ckpt-10")
        self.assertEqual(sorted(os.listdir(directory))[0], "checkpoint")
        self.assertFalse([n for n in os.listdir(directory) if "tmp" in n or "temp" in n])

    def test_a_state_file_of_garbage_bytes_is_rebuilt(self):
        run_dir = tempfile.mkdtemp()
        checkpointer = _checkpointer(run_dir)
        for step in (4, 8):
            checkpointer.save(step)
        directory = os.path.join(run_dir, "checkpoints")
        with open(os.path.join(directory, "checkpoint"), "wb") as f:
            f.write(bytes(range(128, 256)))  # Not UTF-8: TensorFlow's reader raises on it.
        with self.assertLogs("absl", level="WARNING"):
            self.assertEqual(_checkpointer(run_dir).restore(), 8)
        state = tf.train.get_checkpoint_state(directory)
        self.assertEqual(os.path.basename(state.model_checkpoint_path), "ckpt-8")

    def test_a_deletion_killed_after_its_index_leaves_data_the_next_start_removes(self):
        run_dir = tempfile.mkdtemp()
        checkpointer = _checkpointer(run_dir)
        for step in (4, 8):
            checkpointer.save(step)
        directory = os.path.join(run_dir, "checkpoints")
        os.remove(os.path.join(directory, "ckpt-4.index"))  # The deletion's first half.
        _checkpointer(run_dir)
        self.assertFalse([n for n in os.listdir(directory) if n.startswith("ckpt-4")])
        state = tf.train.get_checkpoint_state(directory)
        self.assertEqual(
            [os.path.basename(p) for p in state.all_model_checkpoint_paths], ["ckpt-8"]
        )


@pytest.mark.integration
class AbandonedReadsTest(absltest.TestCase):
    """Orbax's reads abandoned at a damaged checkpoint end in debug lines, not tracebacks.

    Found by the long soak: a JAX run resumed from the checkpoint before a cut
    one, as it should, but printed a traceback per abandoned read. Each run of
    `tests.damaged_orbax_restore` passes over the cut checkpoint six times.
    Whether the abandoned reads end before the process does varies from run
    to run; `QuietAbandonedReadsTest` holds the quieting deterministically.
    """

    def _restore_past_a_cut_checkpoint(self):
        env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2")
        result = subprocess.run(
            [sys.executable, "-m", "tests.damaged_orbax_restore"],
            cwd=multi_worker.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertEqual(result.stdout.split("\n").count("resumed at step 1"), 6, result.stdout)
        return result.stderr

    def test_a_cut_checkpoint_is_passed_over_in_one_line(self):
        stderr = self._restore_past_a_cut_checkpoint()
        self.assertNotIn("Traceback", stderr)
        self.assertNotIn("Exception ignored", stderr)
        self.assertEqual(stderr.count("/checkpoints/2 is unreadable, trying an older one"), 6)


def _compiled_in(directory, source):
    """The names `source` defines, compiled as if from a file in `directory`."""
    names = {}
    exec(compile(source, os.path.join(directory, "reads.py"), "exec"), names)
    return names


_READS = """
import types

@types.coroutine
def _pending():
    yield

async def read():
    try:
        await _pending()
    finally:
        raise RuntimeError("a read abandoned")

def fail():
    raise ValueError("a damaged array")
"""


class QuietAbandonedReadsTest(absltest.TestCase):
    """What `errors.quiet_abandoned_reads` quiets, on coroutines and errors made here.

    Whether orbax's own abandoned reads end before the process does varies
    from run to run (`AbandonedReadsTest`); these are deterministic: each
    coroutine is dropped while it waits, so Python closes it then and there,
    and its `finally` raises, which Python passes to `sys.unraisablehook`.
    """

    def setUp(self):
        super().setUp()
        self.passed_on = []
        asyncio_log = std_logging.getLogger("asyncio")
        filters = list(asyncio_log.filters)
        hook = sys.unraisablehook
        self.addCleanup(setattr, sys, "unraisablehook", hook)
        self.addCleanup(setattr, asyncio_log, "filters", filters)
        sys.unraisablehook = self.passed_on.append
        errors.quiet_abandoned_reads()
        # The debug lines reach Python's logging only at absl's debug verbosity, which another
        # test in the same process may have changed.
        verbosity = absl_logging.get_verbosity()
        self.addCleanup(absl_logging.set_verbosity, verbosity)
        absl_logging.set_verbosity(absl_logging.DEBUG)

    def _drop_a_waiting_read(self, directory):
        coroutine = _compiled_in(directory, _READS)["read"]()
        coroutine.send(None)  # It now waits in `_pending`.
        del coroutine  # Closed here: its `finally` raises into sys.unraisablehook.

    def test_an_abandoned_orbax_read_is_logged_not_printed(self):
        with self.assertLogs(level="DEBUG") as logs:
            self._drop_a_waiting_read(os.path.join(tempfile.mkdtemp(), "orbax", "checkpoint"))
        self.assertEqual(self.passed_on, [])
        self.assertIn("An abandoned checkpoint read ended: a read abandoned", logs.output[0])

    def test_another_coroutine_goes_to_the_hook_there_was(self):
        self._drop_a_waiting_read(tempfile.mkdtemp())
        self.assertLen(self.passed_on, 1)
        self.assertEqual(str(self.passed_on[0].exc_value), "a read abandoned")

    def test_an_event_loop_closed_error_is_logged_not_printed(self):
        error = RuntimeError("Event loop is closed")
        sys.unraisablehook(types.SimpleNamespace(object=None, exc_value=error))
        self.assertEqual(self.passed_on, [])

    def _never_retrieved(self, directory):
        try:
            _compiled_in(directory, _READS)["fail"]()
        except ValueError:
            exc_info = sys.exc_info()
        record = std_logging.LogRecord(
            "asyncio",
            std_logging.ERROR,
            __file__,
            1,
            "Task exception was never retrieved",
            None,
            exc_info,
        )
        return std_logging.getLogger("asyncio").filter(record)

    def test_asyncio_drops_an_orbax_tasks_unretrieved_error_and_keeps_others(self):
        self.assertFalse(self._never_retrieved(os.path.join(tempfile.mkdtemp(), "orbax")))
        self.assertTrue(self._never_retrieved(tempfile.mkdtemp()))


if __name__ == "__main__":
    absltest.main()
