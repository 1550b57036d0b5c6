"""SIGTERM and SIGINT stop a run at the next step boundary, checkpointed; relaunches resume exactly.

The Inception trainer on fake data compiles one step per call, so a signal
mid-interval stops it mid-interval. Runs under TensorFlow in the default
suite and under `KERAS_BACKEND=jax` in `.ci/run`.
"""

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


if __name__ == "__main__":
    absltest.main()
