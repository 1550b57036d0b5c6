"""SIGKILL a trainer at random moments and right after checkpoint commits; relaunch; compare.

Each test trains one small run uninterrupted, then the same command into
another --model_dir, killed with SIGKILL several times (as soon as its
lock file appears, while it writes trainer.json, its first file; within its
first seconds; at a random moment; right after a checkpoint appears) and
relaunched until a launch finishes. The killed
run must end with the uninterrupted run's history.json, summary.json and
TensorBoard points (each point once, scalar values equal), timings aside.
The trainers' engine is the test process's Keras backend: CI runs both
trainers under TensorFlow, and the MNIST one again under `KERAS_BACKEND=jax`
(`.ci/run`; `-k inception` runs Inception's on JAX too).
"""

import collections
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import data_dirs
from tests import run_outputs
from tests import tensorboard_events
from trainers.run import model_dirs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_TIMEOUT_S = 300
_RELAUNCHES = 9  # Kills plus the launch that finishes; bounds a run that never ends.
_TIMING_TAGS = {"train/images_per_sec"}
_CHECKPOINT = re.compile(r"^(?:ckpt-)?(\d+)(?:\.index)?$")

_MNIST = (
    "trainers.mnist_sigmoid",
    [
        "--norm=batch_norm",
        "--train_subset=600",
        "--train_steps=40",
        "--eval_every=4",
        "--batch_size=20",
        "--probe_size=50",
        f"--data_dir={data_dirs.SHARED_DATA}",
    ],
    ["batch_norm"],
    [
        "at its first file",  # The first launch, into an empty --model_dir.
        "while starting",
        "after a commit",
        "after a commit",
        # Last: a random moment can come after the launch's end, which ends the schedule.
        "at random",
        "at random",
    ],
)
_INCEPTION = (
    "trainers.inception_bn",
    [
        "--variant=bn_x5",
        "--dropout=0.4",  # BN, dropout and distortions: each resumed exactly.
        "--use_fake_data",
        "--image_size=32",
        "--batch_size=4",
        "--train_steps=12",
        "--eval_every=2",
        "--eval_steps=1",
    ],
    [""],
    # Fewer kills: each launch compiles the model again (half a minute on JAX).
    ["at its first file", "after a commit", "at random"],
)


def _checkpoint_steps(run_dir):
    """The steps of the committed checkpoints in `run_dir/checkpoints` (either engine's)."""
    try:
        names = os.listdir(os.path.join(run_dir, "checkpoints"))
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for m in map(_CHECKPOINT.match, names) if m}


def _points(directory):
    """Every (tag, step) logged in `directory`'s event files, counted, and the scalars' values."""
    events = tensorboard_events.read_events(directory)
    counts = collections.Counter(
        (tag, step) for tag, points in events.items() for step, _ in points
    )
    values = {
        (tag, step): value
        for tag, points in events.items()
        if tag not in _TIMING_TAGS
        for step, value in points
    }
    return counts, values


class _Launcher:
    def __init__(self, module, args, model_dir):
        self.command = [sys.executable, "-m", module, *args, f"--model_dir={model_dir}"]
        self.model_dir = model_dir
        self.log = os.path.join(tempfile.mkdtemp(), "log")

    def start(self):
        out = open(self.log, "ab")
        return subprocess.Popen(self.command, cwd=_REPO, stdout=out, stderr=subprocess.STDOUT)

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()


def _run_to_end(launcher):
    process = launcher.start()
    try:
        return process.wait(timeout=_LAUNCH_TIMEOUT_S)
    finally:
        process.kill()


def _wait_and_kill(process, when, model_dir, run_dir, rng, duration_s):
    """SIGKILLs `process` at the moment `when` names; returns False if it finished first.

    `duration_s` is an uninterrupted launch's time, which bounds the random moments.
    """
    deadline = time.time() + _LAUNCH_TIMEOUT_S
    first_file = os.path.join(model_dir, model_dirs.LOCK)  # Taken just before trainer.json.
    if when == "at its first file":
        kill_at = deadline
    elif when == "while starting":
        kill_at = time.time() + rng.uniform(0.5, 0.2 * duration_s)
    elif when == "at random":
        kill_at = time.time() + rng.uniform(0.2, 0.9) * duration_s
    else:  # "after a commit": as soon as a new checkpoint appears.
        kill_at, known = deadline, _checkpoint_steps(run_dir)
    while process.poll() is None and time.time() < deadline:
        if when == "after a commit" and _checkpoint_steps(run_dir) - known:
            break
        if when == "at its first file" and os.path.exists(first_file):
            break
        if time.time() >= kill_at:
            break
        time.sleep(0.005)
    if process.poll() is not None:
        return False
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    return True


@pytest.mark.slow
class KillResumeTest(parameterized.TestCase):
    @parameterized.named_parameters(("mnist", *_MNIST), ("inception", *_INCEPTION))
    def test_relaunch_after_kills_gives_the_uninterrupted_outputs(
        self, module, args, runs, schedule
    ):
        if module == _MNIST[0] and not os.path.isdir(data_dirs.SHARED_DATA):
            self.skipTest(f"real MNIST not at {data_dirs.SHARED_DATA}")
        reference = _Launcher(module, args, tempfile.mkdtemp())
        began = time.time()
        self.assertEqual(_run_to_end(reference), 0, reference.output()[-3000:])
        duration_s = time.time() - began

        killed = _Launcher(module, args, tempfile.mkdtemp())
        rng = random.Random(0)
        finished, kills = False, []
        for when in schedule + ["never"] * (_RELAUNCHES - len(schedule)):
            process = killed.start()
            try:
                if when == "never" or not _wait_and_kill(
                    process,
                    when,
                    killed.model_dir,
                    os.path.join(killed.model_dir, runs[0]),
                    rng,
                    duration_s,
                ):
                    code = process.wait(timeout=_LAUNCH_TIMEOUT_S)
                    self.assertEqual(code, 0, killed.output()[-3000:])
                    finished = True
                    break
                kills.append(when)
            finally:
                process.kill()
        self.assertTrue(finished, killed.output()[-3000:])
        # Every kill but a random one hits a running launch (a random moment may come after
        # the launch's end, and the random ones come last).
        sure = [when for when in schedule if when != "at random"]
        self.assertEqual(kills[: len(sure)], sure, kills)
        print(f"{module}: killed {kills}, then a launch finished")

        self.assertEqual(
            run_outputs.read_json(os.path.join(killed.model_dir, "summary.json")),
            run_outputs.read_json(os.path.join(reference.model_dir, "summary.json")),
        )
        for run in runs:
            got, want = (os.path.join(d.model_dir, run) for d in (killed, reference))
            self.assertEqual(
                run_outputs.read_json(os.path.join(got, "history.json")),
                run_outputs.read_json(os.path.join(want, "history.json")),
            )
            (got_counts, got_values), (want_counts, want_values) = _points(got), _points(want)
            self.assertEqual(got_counts, want_counts)
            self.assertEqual(set(got_counts.values()), {1})  # Each point once.
            self.assertEqual(got_values, want_values)
        if runs != [""]:  # The model_dir root's own points (layouts, figures), each once.
            self.assertEqual(_points(killed.model_dir)[0], _points(reference.model_dir)[0])


if __name__ == "__main__":
    absltest.main()
