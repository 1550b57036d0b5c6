"""What a trainer shows a person (`trainers/reporting/console.py`), end to end too."""

import contextlib
import io
import logging as std_logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import data_dirs
from trainers.reporting import console

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


class ProgressTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        # Another test of the process may have lowered absl's verbosity.
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.INFO)
        self.addCleanup(logging.set_verbosity, verbosity)

    def test_a_log_file_gets_the_first_evaluation_then_one_line_per_tenth(self):
        progress = console.Progress("bn", 0, 1000, stream=io.StringIO())
        with self.assertLogs(level="INFO") as logs:
            for step in range(50, 1001, 50):  # 20 evaluations.
                progress.update(step, {"accuracy": 0.5})
        lines = [r.getMessage() for r in logs.records]
        steps = [int(line.split("/")[0].split()[-1]) for line in lines]
        self.assertEqual(steps, [50, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000])
        self.assertTrue(lines[0].startswith("bn step 50/1000: accuracy 0.5 ("), lines[0])
        self.assertIn("steps/s", lines[0])
        self.assertIn("left)", lines[0])
        self.assertTrue(lines[-1].startswith("bn step 1000/1000"), lines[-1])
        self.assertNotIn("left", lines[-1])

    def test_a_resumed_run_shows_its_first_evaluation_then_the_runs_tenths(self):
        progress = console.Progress("bn", 430, 1000, stream=io.StringIO())
        with self.assertLogs(level="INFO") as logs:
            for step in (450, 460, 500, 550):
                progress.update(step, {"loss": 1.0})
        self.assertEqual(
            [r.getMessage().split(":")[0] for r in logs.records],
            ["bn step 450/1000", "bn step 500/1000"],
        )

    def test_a_terminal_gets_one_live_line_with_a_bar(self):
        terminal = _Terminal()
        progress = console.Progress("bn", 0, 100, stream=terminal)
        for step in (50, 100):
            progress.update(step, {"loss": 0.25})
        text = terminal.getvalue()
        self.assertEqual(text.count("\r"), 2)
        self.assertIn("[##########..........] bn step 50/100: loss 0.25", text)
        self.assertTrue(text.endswith("\n"))
        self.assertEqual(text.count("\n"), 1)

    def test_an_interrupted_live_line_is_ended(self):
        terminal = _Terminal()
        progress = console.Progress("bn", 0, 100, stream=terminal)
        progress.update(50, {"loss": 0.25})
        progress.end_line()
        self.assertTrue(terminal.getvalue().endswith("\n"))

    def test_a_divergence_line_or_a_warning_starts_on_a_line_of_its_own(self):
        terminal, stderr = _Terminal(), io.StringIO()
        progress = console.Progress("bn", 0, 100, stream=terminal)
        progress.update(50, {"loss": 0.25})
        with contextlib.redirect_stderr(stderr):
            console.diverged("bn", 60, "train_loss is nan", 50, "stop")
        self.assertTrue(terminal.getvalue().endswith("\n"))
        self.assertEqual(
            stderr.getvalue(),
            "bn: diverged at step 60: train_loss is nan; the last finite checkpoint is step 50; "
            "the run stops here\n",
        )
        progress.update(60, {"loss": 0.25})
        record = std_logging.LogRecord("w", std_logging.WARNING, __file__, 1, "careful", (), None)
        console.quiet_libraries()
        self.assertTrue(logging.get_absl_handler().filter(record))
        self.assertEqual(terminal.getvalue().count("\n"), 2)
        progress.end_line()  # Already ended: nothing more.
        self.assertEqual(terminal.getvalue().count("\n"), 2)


class ConsoleTextTest(parameterized.TestCase):
    @parameterized.parameters((5, "5s"), (59.6, "1m00s"), (725, "12m05s"), (12000, "3h20m"))
    def test_duration(self, seconds, text):
        self.assertEqual(console.duration(seconds), text)

    def test_table_aligns_columns_and_says_never_for_none(self):
        lines = console.table(["network", "accuracy", "first"], [("bn", 0.98123, None)])
        self.assertEqual(
            lines,
            ["network  accuracy  first", "-------  --------  -----", "bn       0.9812    never"],
        )

    def test_interrupted_names_the_step_and_the_checkpoint(self):
        self.assertEqual(
            str(console.Interrupted("bn seed 0", 1500, 1000)),
            "bn seed 0: interrupted at step 1500; the last checkpoint is step 1000; relaunch "
            "the same command to resume",
        )
        self.assertIn("none yet", str(console.Interrupted("bn", 10, 0)))

    def test_library_info_is_dropped_and_their_warnings_kept(self):
        import tensorflow as tf

        handler = logging.get_absl_handler()
        saved = list(handler.filters)  # A trainer's main run in this process added one.

        def restore():
            handler.filters[:] = saved

        self.addCleanup(restore)
        handler.filters[:] = []
        console.quiet_libraries()
        console.quiet_libraries()  # Once is enough: no second filter.
        self.assertLen(handler.filters, 1)

        def kept(path, level):
            record = std_logging.LogRecord("x", level, path, 1, "m", (), None)
            return handler.filters[0].filter(record)

        library = os.path.join(os.path.dirname(tf.__file__), "python", "checkpoint", "saver.py")
        self.assertFalse(kept(library, std_logging.INFO))
        self.assertTrue(kept(library, std_logging.WARNING))
        self.assertTrue(kept(console.__file__, std_logging.INFO))
        # A folder merely named like a library is not one.
        self.assertTrue(kept("/home/me/jax/tensorflow/trainers/run/skeleton.py", std_logging.INFO))

    def test_an_interruption_is_a_keyboard_interrupt(self):
        # So that no `except Exception` between the loop and `main` swallows a Ctrl-C.
        with self.assertRaises(KeyboardInterrupt):
            raise console.Interrupted("bn", 10, 0)


def _trainer(model_dir, *args, engine="tensorflow"):
    """`python -m trainers.mnist_sigmoid` on real MNIST, Ctrl-C delivered as in a terminal."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainers.mnist_sigmoid",
            f"--data_dir={data_dirs.SHARED_DATA}",
            f"--model_dir={model_dir}",
            *args,
        ],
        cwd=_REPO,
        env=dict(os.environ, KERAS_BACKEND=engine),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A background job ignores SIGINT; a person's Ctrl-C reaches a foreground one.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.integration
class TrainerConsoleTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not present at {data_dirs.SHARED_DATA}")

    def test_a_run_ends_with_the_table_and_the_paths_in_few_lines(self):
        model_dir = tempfile.mkdtemp()
        process = _trainer(model_dir, "--train_steps=2000", "--eval_every=50")
        out, _ = process.communicate(timeout=600)
        self.assertEqual(process.returncode, 0, out[-3000:])
        lines = out.splitlines()
        # 40 evaluations per network: the first, then one line per tenth; and the end.
        self.assertLessEqual(len(lines), 60, out)
        self.assertNotIn("Sharding callback", out)
        self.assertEqual(len([x for x in lines if "seed 0 step" in x]), 22, out)
        self.assertRegex(out, r"network +final accuracy +best accuracy +first step at 97%")
        self.assertRegex(out, r"\nbaseline +0\.\d{4} +0\.\d{4} +(\d+|never)\n")
        self.assertRegex(out, r"\nbatch_norm +0\.\d{4} +0\.\d{4} +(\d+|never)\n")
        self.assertEqual(
            lines[-3:],
            [
                f"summary:     {os.path.join(model_dir, 'summary.json')}",
                f"figure 1:    {os.path.join(model_dir, 'figure1.png')}",
                f"TensorBoard: tensorboard --logdir {model_dir}",
            ],
        )

    @parameterized.parameters("tensorflow", "jax")
    def test_ctrl_c_stops_at_the_next_step_with_a_checkpoint_in_one_line(self, engine):
        model_dir = tempfile.mkdtemp()
        process = _started(model_dir, engine)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=120)
        self.assertEqual(process.returncode, 130, out[-3000:])
        self.assertNotIn("Traceback", out)
        last = out.strip().splitlines()[-1]
        self.assertRegex(
            last,
            r"^mnist_sigmoid: baseline seed 0: stopped at step \d+ on SIGINT; checkpoint saved; "
            r"relaunch the same command to resume$",
        )
        # MNIST compiles a whole evaluation interval per call: it stops at its end.
        step = int(re.search(r"step (\d+)", last).group(1))
        checkpoints = os.listdir(os.path.join(model_dir, "baseline", "checkpoints"))
        self.assertTrue(
            any(name.split(".")[0] in (f"ckpt-{step}", str(step)) for name in checkpoints)
        )


def _started(model_dir, engine):
    """A trainer run that has logged its first evaluation: training has started, and goes on."""
    process = _trainer(model_dir, "--train_steps=1000000", engine=engine)
    history = os.path.join(model_dir, "baseline", "history.json")
    deadline = time.time() + 300
    while not os.path.exists(history) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    return process


if __name__ == "__main__":
    absltest.main()
