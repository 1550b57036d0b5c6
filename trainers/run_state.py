"""A run's resumable state: its checkpoint, history file and TensorBoard writer."""

import os

import tensorflow as tf

from trainers import summaries


class RunState:
    """A run's checkpoint, history file and TensorBoard writer, resumable.

    On creation it restores the latest checkpoint under `run_dir` (if any)
    and the history logged up to it, dropping evaluation records after the
    checkpoint's step (they are redone after resuming), and logs the run's
    configuration (a dict) for a fresh run. `save` checkpoints and rewrites
    the history together, so the two always agree. Only the chief writes
    events and the history; the checkpointer decides where each worker's
    checkpoints go (see `trainers.tf_runner.Checkpointer`).

    Attributes:
        history: dict with "evals" (one record per evaluation), "steps" and
            "wall_time_s".
        start: the step the run continues from (0 for a fresh run).
        writer: the run's `tf.summary` writer (a no-op writer off the chief).
        is_chief: whether this process writes.
    """

    def __init__(self, run_dir, checkpointer, config_values, is_chief=True):
        tf.io.gfile.makedirs(run_dir)
        self.is_chief = is_chief
        self._checkpointer = checkpointer
        self._history_path = os.path.join(run_dir, "history.json")
        self.history = {"evals": [], "steps": 0, "wall_time_s": 0.0}
        self.start = checkpointer.restore()
        if self.start:
            self.history = summaries.read_json(self._history_path, self.history)
            evals = self.history["evals"]
            self.history["evals"] = [e for e in evals if e["step"] <= self.start]
            self.history["steps"] = self.start
        if is_chief:
            self.writer = tf.summary.create_file_writer(run_dir)
            if self.start == 0:
                summaries.write_config(self.writer, config_values)
        else:
            self.writer = tf.summary.create_noop_writer()

    def save(self, step, wall_time_s):
        """Checkpoints at `step` (every worker) and writes the history (chief)."""
        self.history["steps"] = step
        self.history["wall_time_s"] = wall_time_s
        self._checkpointer.save(step)
        if self.is_chief:
            summaries.write_json(self._history_path, self.history)

    def __enter__(self):
        return self

    def __exit__(self, *unused_exc_info):
        self.close()

    def close(self):
        """Flushes the writer and closes the checkpointer."""
        self.writer.flush()
        self._checkpointer.close()
