"""SIGTERM and SIGINT stop a run at the next safe point, checkpointed; relaunches resume exactly.

The Inception trainer on fake data compiles one step per call, so a signal
mid-interval stops it mid-interval. A signal in the other phases (the
imports, start-up, the end-of-run writes) is delivered to the MNIST trainer
at named points (`trainers.run.fault_points`). Runs under TensorFlow in the
default suite and under `KERAS_BACKEND=jax` in `.ci/run`.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest

from tests import data_dirs
from tests import run_outputs
from trainers.run import preemption

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ARGS = [
    "--use_fake_data",
    "--image_size=32",
    "--train_steps=60",
    "--eval_every=30",
    "--eval_steps=2",
    "--batch_size=8",
    "--width_multiplier=0.05",
]


def _trainer(model_dir):
    return subprocess.Popen(
        [sys.executable, "-m", "trainers.inception_bn", *_ARGS, f"--model_dir={model_dir}"],
        cwd=_REPO,
        env=dict(os.environ, KERAS_BACKEND=keras.backend.backend()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A background job ignores SIGINT; a person's Ctrl-C reaches a foreground one.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _finish(process):
    out, _ = process.communicate(timeout=600)
    return process.returncode, out


def _outputs(model_dir):
    """What two runs must share: history and summary without times and paths."""
    history = run_outputs.read_json(os.path.join(model_dir, "history.json"))
    summary = run_outputs.read_json(os.path.join(model_dir, "summary.json"))
    return history, summary


class StopRequestsTest(absltest.TestCase):
    def test_a_signal_asks_a_second_ctrl_c_interrupts_and_handlers_come_back(self):
        before = signal.getsignal(signal.SIGTERM)
        with preemption.StopRequests() as stops:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # A second SIGTERM only asks again.
            time.sleep(0.1)  # Python runs a handler at its next instruction.
            self.assertEqual(stops.signal, signal.SIGTERM)
            with self.assertRaises(KeyboardInterrupt):  # A Ctrl-C after a request: at once.
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
        self.assertEqual(signal.getsignal(signal.SIGTERM), before)
        with preemption.StopRequests() as stops:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            self.assertEqual(stops.signal, signal.SIGINT)

    def test_stopped_says_where_and_exits_with_the_signal_status(self):
        stopped = preemption.Stopped("bn_x5", 28, signal.SIGTERM, saved=True)
        self.assertIsInstance(stopped, KeyboardInterrupt)
        self.assertEqual(stopped.exit_status, 143)
        self.assertEqual(
            str(stopped),
            "bn_x5: stopped at step 28 on SIGTERM; checkpoint saved; relaunch the same command "
            "to resume",
        )
        unsaved = preemption.Stopped("bn_x5", 28, signal.SIGINT, saved=False)
        self.assertEqual(unsaved.exit_status, 130)
        self.assertIn("no checkpoint saved (the state is not finite)", str(unsaved))


@pytest.mark.integration
# One pytest-xdist worker runs the class (--dist loadgroup): setUpClass trains once.
@pytest.mark.xdist_group("PreemptionTest")
class PreemptionTest(parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.reference = tempfile.mkdtemp()  # The uninterrupted run.
        code, out = _finish(_trainer(cls.reference))
        assert code == 0, out[-3000:]

    @parameterized.parameters((signal.SIGTERM, 143), (signal.SIGINT, 130))
    def test_a_signal_mid_interval_checkpoints_that_step_and_the_relaunch_resumes_exactly(
        self, signum, status
    ):
        if signum == signal.SIGINT and keras.backend.backend() == "jax":
            # Same path as SIGTERM; each JAX launch compiles for a minute on 2 cores.
            self.skipTest("SIGINT on JAX: tests/console_test.py (the MNIST trainer)")

        model_dir = tempfile.mkdtemp()
        process = _trainer(model_dir)
        history = os.path.join(model_dir, "history.json")
        checkpoints = os.path.join(model_dir, "checkpoints")
        deadline = time.time() + 600
        while time.time() < deadline and not (
            os.path.isdir(checkpoints) and {"ckpt-30.index", "30"} & set(os.listdir(checkpoints))
        ):
            time.sleep(0.02)  # The first evaluation (step 30) is committed.
        time.sleep(0.1)  # Training goes on: the signal comes mid-interval.
        process.send_signal(signum)
        code, out = _finish(process)
        self.assertEqual(code, status, out[-3000:])
        self.assertNotIn("Traceback", out)
        last = out.strip().splitlines()[-1]
        self.assertRegex(
            last,
            rf"^inception_bn: bn_x5: stopped at step \d+ on {signum.name}; checkpoint saved; "
            r"relaunch the same command to resume$",
        )
        step = int(last.split("stopped at step ")[1].split()[0])
        committed = run_outputs.read_strict_json(history)
        self.assertEqual(committed["steps"], step)  # Nothing lost: the step is committed.
        self.assertNotEqual(step % 30, 0)
        self.assertEqual(committed["partial_interval"]["step"], step)

        code, out = _finish(_trainer(model_dir))
        self.assertEqual(code, 0, out[-3000:])
        self.assertIn(f"at step {step}", out)  # Resumed there.
        self.assertEqual(_outputs(model_dir), _outputs(self.reference))


def _mnist(model_dir, faults=None, networks="batch_norm"):
    """The tiny MNIST run, started; `faults` for the fault hook (`trainers.run.fault_points`)."""
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    env.pop("KERAS_BN_FAULT", None)
    if faults:
        env["KERAS_BN_FAULT"] = json.dumps(faults)
    args = [
        f"--norm={networks}",
        "--train_subset=600",
        "--train_steps=16",
        "--eval_every=4",
        "--batch_size=20",
        "--probe_size=50",
        f"--data_dir={data_dirs.SHARED_DATA}",
        f"--model_dir={model_dir}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "trainers.mnist_sigmoid", *args],
        cwd=_REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.integration
class SignalPhasesTest(parameterized.TestCase):
    """A signal in any phase is a request to stop, acted on at the phase's end, in one line."""

    def setUp(self):
        super().setUp()
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not at {data_dirs.SHARED_DATA}")

    def _stopped(self, process, status, pattern):
        code, out = _finish(process)
        self.assertEqual(code, status, out[-3000:])
        self.assertNotIn("Traceback", out)
        self.assertRegex(out.strip().splitlines()[-1], pattern)
        return out

    def test_a_ctrl_c_during_the_imports_stops_before_the_first_step(self):
        model_dir = tempfile.mkdtemp()
        process = _mnist(model_dir)
        time.sleep(1.0)  # Inside the imports, which take seconds.
        process.send_signal(signal.SIGINT)
        self._stopped(
            process,
            130,
            r"^mnist_sigmoid: batch_norm seed 0: stopped at step 0 on SIGINT; nothing trained "
            r"yet; relaunch the same command to resume$",
        )
        self.assertFalse(os.path.exists(os.path.join(model_dir, "batch_norm", "history.json")))

    @parameterized.parameters("rename trainer.json", "run state")
    def test_a_sigterm_during_start_up_stops_before_the_first_step(self, point):
        model_dir = tempfile.mkdtemp()
        fault = {"point": point, "count": 1, "action": "SIGTERM"}
        self._stopped(
            _mnist(model_dir, [fault]),
            143,
            r"^mnist_sigmoid: batch_norm seed 0: stopped at step 0 on SIGTERM; nothing trained "
            r"yet; relaunch the same command to resume$",
        )

    def test_a_sigterm_during_an_evaluation_stops_after_its_commit(self):
        model_dir = tempfile.mkdtemp()
        fault = {"point": "evaluation", "count": 2, "action": "SIGTERM"}
        self._stopped(
            _mnist(model_dir, [fault]),
            143,
            r"^mnist_sigmoid: batch_norm seed 0: stopped at step 8 on SIGTERM; checkpoint saved; ",
        )
        history = run_outputs.read_strict_json(
            os.path.join(model_dir, "batch_norm", "history.json")
        )
        self.assertEqual(history["steps"], 8)

    def test_a_sigterm_during_the_end_of_a_run_lets_it_end_then_stops_the_next(self):
        model_dir = tempfile.mkdtemp()
        fault = {"point": "run end", "count": 1, "action": "SIGTERM"}
        self._stopped(
            _mnist(model_dir, [fault], networks="both"),
            143,
            r"^mnist_sigmoid: batch_norm seed 0: stopped at step 0 on SIGTERM; nothing trained ",
        )
        baseline = run_outputs.read_strict_json(os.path.join(model_dir, "baseline", "history.json"))
        self.assertTrue(baseline["finished"])  # Its end was written whole.
        code, out = _finish(_mnist(model_dir, networks="both"))
        self.assertEqual(code, 0, out[-3000:])


if __name__ == "__main__":
    absltest.main()
