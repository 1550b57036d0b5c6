"""A multi-process run that loses a peer ends in one line (trainers/engines/lost_peers.py).

The TensorFlow errors a survivor raises, and the fatal dump JAX's client
prints before it aborts, each become one line naming the lost peer, this
process and the checkpoint a relaunch resumes from. No processes of a job
are started here: the errors are those real runs raised, and the watcher
runs as the program it is, reading a dump on its standard input. The real
losses are killed in tests/multi_worker_trainer_test.py (TensorFlow) and
tests/trainer_jax_test.py (JAX).
"""

import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
import pytest
import tensorflow as tf

from trainers.engines import lost_peers
from trainers.engines import strategy as strategy_lib

# TensorFlow's errors in a survivor, as real runs raised them: a compiled
# step's collective finding the peer's connection reset, and an eager one
# aborted by the coordination service's missed heartbeats.
_RESET = (
    "Graph execution error:\n\nDetected at node while/CollectiveReduceV2_11 defined at (most "
    'recent call last):\n  File "trainers/engines/loops.py", line 38, in run\n\nCollective ops is '
    "aborted by: recvmsg:Connection reset by peer\nAdditional GRPC error information from "
    "remote target /job:worker/replica:0/task:{peer} while calling "
    "/tensorflow.WorkerService/RecvBuf:\n\t [[{{{{node while/CollectiveReduceV2_11}}}}]]"
)
_HEARTBEATS = (
    "{{{{function_node __wrapped__CollectiveReduceV2_device_/job:worker/replica:0/task:{this}"
    "/device:CPU:0}}}} Collective ops is aborted by: Error reported from /job:worker/task:{peer}: "
    "The following tasks are unhealthy (stopped sending heartbeats):\n"
    "/job:worker/replica:0/task:{peer}\nThe tasks have crashed."
)


def _distribution(name):
    """A `DistributionConfig` of strategy `name`."""
    return strategy_lib.DistributionConfig(name, None, None, None, False, None)


class LostWorkerMessageTest(absltest.TestCase):
    """The one line a survivor's TensorFlow error becomes (no processes started)."""

    def lost(self, error, this=0, model_dir=None):
        """The `WorkerLostError` message `error` becomes in worker `this` of a 2-worker job."""
        cluster = {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"]}
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": this}})
        config = _distribution("multi_worker_mirrored")
        with mock.patch.dict(os.environ, {"TF_CONFIG": tf_config}):
            with self.assertRaises(lost_peers.WorkerLostError) as raised:
                with config.reporting_lost_workers("inception_bn", model_dir or tempfile.mkdtemp()):
                    raise error
        return str(raised.exception)

    def test_names_the_peer_and_the_newest_checkpoint(self):
        model_dir = tempfile.mkdtemp()
        for run, step, mtime in [("bn_x5", 9, 1.0), ("inception", 2, 2.0)]:
            os.makedirs(os.path.join(model_dir, run, "checkpoints"))
            index = os.path.join(model_dir, run, "checkpoints", f"ckpt-{step}.index")
            open(index, "w").close()
            os.utime(index, (mtime, mtime))
        message = self.lost(
            tf.errors.UnavailableError(None, None, _RESET.format(peer=1)), model_dir=model_dir
        )
        self.assertEqual(
            message,
            "lost worker 1 (127.0.0.1:1001) of this job; this is worker 0 (127.0.0.1:1000), which "
            "stops too (TensorFlow: Collective ops is aborted by: recvmsg:Connection reset by "
            "peer). Relaunch every worker with the same command: it resumes from the last "
            f"checkpoint, step 2 ({model_dir}/inception/checkpoints/ckpt-2).",
        )

    def test_a_lost_chief_seen_by_heartbeats(self):
        error = tf.errors.UnavailableError(None, None, _HEARTBEATS.format(this=1, peer=0))
        message = self.lost(error, this=1, model_dir="/nonexistent")
        self.assertStartsWith(
            message, "lost worker 0 (127.0.0.1:1000) of this job; this is worker 1"
        )
        self.assertIn("(stopped sending heartbeats): /job:worker/replica:0/task:0)", message)
        self.assertEndsWith(message, "--model_dir=/nonexistent yet, so it starts over.")

    def test_an_unnamed_peer_lists_the_job(self):
        message = self.lost(tf.errors.CancelledError(None, None, "Socket closed"))
        self.assertStartsWith(
            message,
            "lost a worker of this job (worker 0 (127.0.0.1:1000), worker 1 (127.0.0.1:1001); "
            "TensorFlow does not say which); this is worker 0 (127.0.0.1:1000)",
        )

    def test_other_errors_and_strategies_pass_through(self):
        for name, error in [
            ("multi_worker_mirrored", tf.errors.InternalError(None, None, "a kernel's bug")),
            ("mirrored", tf.errors.UnavailableError(None, None, "Socket closed")),
        ]:
            with self.assertRaises(type(error)):
                with _distribution(name).reporting_lost_workers("inception_bn", "/nonexistent"):
                    raise error


# What JAX's client printed before it aborted process 1 of a 2-process job
# whose process 0 (the coordinator) was killed (JAX 0.10.2), and the lines
# around it: the run's own, JAX's note, the C++ stack and Python's dump.
_COORDINATOR_LOST = [
    "I1205 19:29:58.372097 140678160530304 console.py:116] batch_norm seed 0 step 20/100000: "
    "test_accuracy 0.0974\n",
    "E1205 19:30:00.205677   24689 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n",
    "F1205 19:30:00.205733   24689 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died; see the "
    "other task logs for more details. absl::Status: UNAVAILABLE: Failed to send RPC to "
    "coordination service. Either the leader task was preempted/died/restarted unexpectedly or "
    "this task is experiencing network issues.\n",
    "Additional GRPC error information from remote target coordination_service while calling "
    "/xla.coordination.CoordinationService/PollForError:\n",
    "*** Check failure stack trace: ***\n",
    "    @     0x7f852e758634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n",
    "Fatal Python error: Aborted\n",
]
_HEARTBEAT_DUMP = (
    "F1205 19:27:35.602006   23753 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. absl::Status: INTERNAL: Shutdown barrier has failed.\n"
    "Barrier result: 'INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 2 "
    "heartbeat timeout. This indicates that the remote task has failed.'\n"
)


def _orbax_steps(model_dir, steps_by_run):
    """Committed orbax step directories (and one in progress) under `model_dir`."""
    for run, (step, mtime) in steps_by_run.items():
        directory = os.path.join(model_dir, run, "checkpoints")
        os.makedirs(os.path.join(directory, f"{step + 1}.orbax-checkpoint-tmp-1"))
        os.makedirs(os.path.join(directory, str(step)))
        os.utime(os.path.join(directory, str(step)), (mtime, mtime))


@pytest.mark.integration
class JaxWatcherTest(absltest.TestCase):
    """The watcher program: what it passes on, and the line a fatal dump becomes."""

    def watch(self, lines, this=1, processes=2, model_dir="/nonexistent"):
        """The watcher's output for `lines` on its input, in process `this` of the job."""
        result = subprocess.run(
            [sys.executable, "-m", "trainers.engines.lost_peers", "mnist_sigmoid", model_dir]
            + [str(this), str(processes), "127.0.0.1:1000"],
            input="".join(lines).encode(),
            capture_output=True,
            timeout=60,
            check=True,
        )
        self.assertEqual(result.stderr, b"")
        return result.stdout.decode()

    def test_a_lost_coordinator_becomes_one_line_with_the_newest_checkpoint(self):
        model_dir = tempfile.mkdtemp()
        _orbax_steps(model_dir, {"baseline": (40, 1.0), "batch_norm": (20, 2.0)})
        output = self.watch(_COORDINATOR_LOST, model_dir=model_dir)
        self.assertEqual(
            output.splitlines(),
            [
                _COORDINATOR_LOST[0].strip(),
                "mnist_sigmoid: error: lost process 0 (the coordinator, 127.0.0.1:1000) of this "
                "job; this is process 1, which stops too (JAX: UNAVAILABLE: Failed to send RPC "
                "to coordination service). Relaunch every process with the same command: it "
                f"resumes from the last checkpoint, step 20 ({model_dir}/batch_norm/checkpoints"
                "/20).",
            ],
        )

    def test_a_peer_named_by_heartbeats_without_a_checkpoint(self):
        output = self.watch([_HEARTBEAT_DUMP], this=0, processes=3)
        self.assertEqual(
            output,
            "mnist_sigmoid: error: lost process 2 of this job; this is process 0 (the "
            "coordinator, 127.0.0.1:1000), which stops too (JAX: INTERNAL: Shutdown barrier has "
            "failed). Relaunch every process with the same command: no checkpoint is in "
            "--model_dir=/nonexistent yet, so it starts over.\n",
        )

    def test_an_unnamed_peer_of_a_larger_job(self):
        dump = _COORDINATOR_LOST[2].replace("Failed to send RPC to", "Lost the")
        output = self.watch([dump], this=1, processes=4)
        self.assertStartsWith(
            output,
            "mnist_sigmoid: error: lost a process of this job (4 processes, coordinator "
            "127.0.0.1:1000; JAX does not say which); this is process 1",
        )

    def test_gloo_aborting_mid_transfer_becomes_one_line(self):
        # Process 0 of 2, when process 1 was SIGKILLed during a transfer (JAX 0.10.2).
        dump = [
            "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n",
            "  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] "
            "op.preamble.length <= op.nbytes. 19600 vs 2500. Received data size doesn't match "
            "expected size.\n",
            "Fatal Python error: Aborted\n",
            "\n",
            "Thread 0x00007fc6e15d9b80 (most recent call first):\n",
            '  File "trainers/engines/jax_runner.py", line 300 in _host\n',
        ]
        self.assertEqual(
            self.watch(dump, this=0),
            "mnist_sigmoid: error: a collective with the other processes aborted in gloo, as "
            "when a process of this job is lost mid-transfer; this is process 0 (the "
            "coordinator, 127.0.0.1:1000), which stops too (JAX: [enforce fail at "
            "external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes). "
            "Relaunch every process with the same command: no checkpoint is in "
            "--model_dir=/nonexistent yet, so it starts over.\n",
        )

    def test_lines_pass_on_and_a_loss_the_process_said_is_not_said_twice(self):
        said = "mnist_sigmoid: error: lost process 1 of this job; this is process 0 ...\n"
        lines = ["a line\n", "Traceback (most recent call last):\n", "  a bug's frame\n", said]
        self.assertEqual(self.watch(lines + _COORDINATOR_LOST[1:]), "".join(lines))
        self.assertEqual(self.watch(lines[:3] + ["no newline"]), "".join(lines[:3]) + "no newline")


class JaxReportingTest(absltest.TestCase):
    """The JAX context: file descriptor 2 through the watcher; other errors pass."""

    def test_other_errors_pass_and_descriptor_2_is_restored(self):
        import jax

        env = {
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            "KERAS_DISTRIBUTION_PROCESS_ID": "1",
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:1000,127.0.0.1:1001",
        }
        before = os.fstat(2)
        with mock.patch.dict(os.environ, env):
            errors = [
                jax.errors.JaxRuntimeError("INTERNAL: a kernel's bug"),
                KeyError("k"),
                # Before the job has formed (no `jax.distributed` here): a coordinator
                # never reached, not a lost peer.
                jax.errors.JaxRuntimeError("UNKNOWN: Gloo connect: Connection refused"),
            ]
            for error in errors:
                with self.assertRaises(type(error)):
                    with lost_peers.reporting("jax", "data_parallel", "prog", "/nonexistent"):
                        self.assertNotEqual(os.fstat(2).st_ino, before.st_ino)
                        raise error
                self.assertEqual(os.fstat(2).st_ino, before.st_ino)

    def test_a_single_process_run_is_not_watched(self):
        with mock.patch.dict(os.environ, {"KERAS_DISTRIBUTION_NUM_PROCESSES": "1"}):
            before = os.fstat(2).st_ino
            with lost_peers.reporting("jax", "data_parallel", "prog", "/nonexistent"):
                self.assertEqual(os.fstat(2).st_ino, before)


# A process of a two-process JAX job that aborts from a C++ thread, as JAX's distributed
# client does when it loses a peer; `after` says whether the reporting context has ended.
_ABORTING = """
import ctypes, os, sys, threading
from unittest import mock
sys.path.insert(0, {root!r})
from trainers.engines import lost_peers
env = {{"KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": "1",
       "KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:1000,127.0.0.1:1001"}}
with mock.patch.dict(os.environ, env):
    with lost_peers.reporting("jax", "data_parallel", "prog", "/nonexistent"):
        if not {after}:
            thread = threading.Thread(target=ctypes.CDLL(None).abort)
            thread.start()
            thread.join()
abort = threading.Thread(target=ctypes.CDLL(None).abort)
abort.start()
abort.join()
"""


@pytest.mark.integration
class JaxAbortTest(absltest.TestCase):
    def test_an_abort_inside_the_context_ends_with_status_1_and_after_it_as_an_abort(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for after, status in ((False, 1), (True, -6)):
            code = _ABORTING.format(root=root, after=after)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
            self.assertEqual(done.returncode, status, done.stderr.decode()[-2000:])


if __name__ == "__main__":
    absltest.main()
