"""What a trainer shows a person: its progress, its results, and a one-line interruption.

Every evaluation still goes to TensorBoard and history.json; the console gets
what a person reads. On a terminal each run shows one live line (step, the
latest metrics, steps/s, time left); in a log file at most one line per tenth
of the run. The libraries' own progress chatter (a line per checkpoint write
from TensorFlow, TFDS's dataset notes) is left out; their warnings are not.
"""

import importlib.util
import logging as std_logging
import math
import os
import sys
import time

from absl import logging

# TensorFlow (a line per checkpoint write), TFDS (a note per dataset it
# opens), orbax (some twenty lines per checkpoint) and JAX log their routine
# notes at INFO through absl, as the trainers do.
_QUIET_INFO_PACKAGES = ("tensorflow", "tensorflow_datasets", "orbax", "jax")


def _install_dirs(packages):
    """The directories `packages` are installed in (those installed), each ending in a separator."""
    dirs = []
    for package in packages:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for location in (spec and spec.submodule_search_locations) or ():
            dirs.append(os.path.join(os.path.realpath(location), ""))
    return tuple(dirs)


class _LibraryInfo(std_logging.Filter):
    """Drops INFO records (and below) logged by code installed in `directories`."""

    def __init__(self, directories):
        super().__init__()
        self.directories = directories

    def filter(self, record):
        quiet = os.path.realpath(record.pathname).startswith(self.directories)
        shown = record.levelno >= std_logging.WARNING or not quiet
        if shown:
            for progress in list(_OPEN_LIVE_LINE):
                progress.end_line()  # A warning starts on a line of its own.
        return shown


def quiet_libraries():
    """Keeps the libraries' INFO records off the console; their warnings stay, each on its line.

    TensorFlow logs every checkpoint write ("Sharding callback duration"),
    orbax each step of one, TFDS each dataset it opens. TensorFlow's C++
    start-up lines (oneDNN, CUDA probing) come before Python can filter
    them; TensorFlow 2.21 prints them whatever `TF_CPP_MIN_LOG_LEVEL` says.
    """
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _LibraryInfo) for f in handler.filters):
        handler.addFilter(_LibraryInfo(_install_dirs(_QUIET_INFO_PACKAGES)))


def duration(seconds):
    """`seconds` as a short duration: 45s, 12m05s, 3h20m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """One run's progress, reported after each evaluation.

    Args:
        name: the run's name, at the start of each line.
        start: the step the run starts (or resumes) at.
        total: the run's last step.
        stream: where a terminal's live line goes (default stderr); on
            anything that is not a terminal each report is an absl INFO
            line: the launch's first evaluation, then at most one per tenth
            of the run (and the last step).
    """

    def __init__(self, name, start, total, stream=None):
        self.name, self.start, self.total = name, start, total
        self.stream = sys.stderr if stream is None else stream
        self.live = self.stream.isatty()
        self.began = time.monotonic()
        self.steps_per_line = max(1, math.ceil(total / 10))
        self.next_line = start  # The first evaluation of a launch is shown, then tenths.

    def update(self, step, metrics):
        """Reports `step` with `metrics` (name → float), with steps/s and time left."""
        seconds = time.monotonic() - self.began
        rate = (step - self.start) / seconds if seconds > 0 else 0.0
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        pace = f"{rate:.1f} steps/s"
        if rate > 0 and step < self.total:
            pace += f", {duration((self.total - step) / rate)} left"
        text = f"{self.name} step {step}/{self.total}: {shown} ({pace})"
        if self.live:
            filled = 20 * step // max(self.total, 1)
            bar = "#" * filled + "." * (20 - filled)
            self.stream.write(f"\r\033[K[{bar}] {text}")
            _OPEN_LIVE_LINE[:] = [self]
            if step >= self.total:
                self.end_line()
            self.stream.flush()
        elif step >= self.next_line or step >= self.total:
            logging.info("%s", text)
            self.next_line = (step // self.steps_per_line + 1) * self.steps_per_line

    def end_line(self):
        """Ends the live line (at the end, or cut short), so what follows starts afresh."""
        if self.live and _OPEN_LIVE_LINE == [self]:
            self.stream.write("\n")
            self.stream.flush()
            _OPEN_LIVE_LINE.clear()


# The Progress whose live line is on the terminal without its newline, if any.
_OPEN_LIVE_LINE = []


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: the step training had reached and the newest checkpoint's.

    A `KeyboardInterrupt`, so no `except Exception` on its way out swallows it.
    """

    def __init__(self, name, step, checkpoint_step):
        super().__init__(name, step, checkpoint_step)
        self.name, self.step, self.checkpoint_step = name, step, checkpoint_step

    def __str__(self):
        last = self.checkpoint_step
        last = f"step {last}" if last else "none yet (it restarts at 0)"
        return (
            f"{self.name}: interrupted at step {self.step}; the last checkpoint is {last}; "
            "relaunch the same command to resume"
        )


def diverged(name, step, problem, last_checkpoint, on_divergence):
    """The one line saying run `name` diverged at `step` (stderr, also in a log)."""
    for progress in list(_OPEN_LIVE_LINE):
        progress.end_line()  # Not glued to the end of a live line.
    last = f"step {last_checkpoint}" if last_checkpoint else "none"
    then = (
        "the run stops here"
        if on_divergence == "stop"
        else "training goes on (--on_divergence=continue), checkpointing only finite states"
    )
    print(
        f"{name}: diverged at step {step}: {problem}; the last finite checkpoint is {last}; {then}",
        file=sys.stderr,
        flush=True,
    )


def one_line(message, limit=None):
    """`message` (an error, or any text) on one line, cut to `limit` characters if given."""
    text = " ".join(str(message).split())  # One line, whatever the message held.
    if limit is not None and len(text) > limit:
        return text[:limit] + "..."
    return text


def table(headers, rows):
    """Rows as an aligned plain-text table (a list of lines)."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _cell(value):
    if value is None:
        return "never"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def result_paths(model_dir, files):
    """Lines naming where a run's results are: `files` (label: name in `model_dir`), TensorBoard."""
    lines = [f"{label + ':':<12} {os.path.join(model_dir, name)}" for label, name in files.items()]
    return lines + [f"TensorBoard: tensorboard --logdir {model_dir}"]


def show(lines):
    """Prints `lines` to stdout: results a person reads, without log prefixes."""
    print("\n".join(lines), flush=True)
