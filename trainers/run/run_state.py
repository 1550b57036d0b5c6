"""A run's resumable state: checkpoint, history file and TensorBoard events, committed in one order.

The invariant. The latest readable checkpoint is the run's commit point.
Every evaluation at step S is recorded in this order:

1. the evaluation record joins `history.json` (written atomically);
2. its summaries are logged and flushed to the run's event files;
3. the checkpoint of step S is saved: S is committed.

So when a run is killed at any instant and relaunched, its checkpoint of
step C has a history holding every evaluation up to C and event files
holding every summary up to C. The relaunch keeps exactly those: it drops
history records and events of steps after C (`event_files.keep_through`),
which the resumed run computes and logs again. A run's end (its HParams
metrics, then `history["finished"]`) is committed after its last checkpoint,
in a file of its own, and logged again by a relaunch that finds it missing.
With deterministic training (see docs/reproduction.md) a relaunch after any
kill therefore ends with the uninterrupted run's history, summaries and
points, each point once.

A run's identity (the settings that shape its trajectory: seed, batch,
learning rate, network) is recorded in the history; a relaunch with other
values is refused unless it allows the change, which is then recorded.
"""

import json
import os

from absl import logging
import tensorflow as tf

from trainers.reporting import tensorboard_writers
from trainers.run import atomic_files
from trainers.run import errors
from trainers.run import event_files
from trainers.run import fault_points
from trainers.run import json_files


class RunState:
    """A run's checkpoint, history file and TensorBoard writers, resumable.

    On creation it restores the latest readable checkpoint under `run_dir`
    (the checkpointer falls back to older ones) and cuts the history and
    event files back to its step (see the module docstring); a fresh run
    logs its configuration. Only the chief writes events and the history;
    the checkpointer decides where each worker's checkpoints go.

    Args:
        run_dir: the run's directory.
        checkpointer: the engine's checkpointer (`restore() -> step`,
            `save(step)`, `close()`).
        config_values: the run's whole configuration (a flat dict), logged
            as text for a fresh run.
        identity: the settings a resumed run must share (a flat dict of JSON
            values).
        train_steps: the step the run trains to.
        is_chief: whether this process writes.
        allow_config_change: resume even if `identity` differs from the
            recorded one in keys of `changeable`, recording the change.
        changeable: the keys of `identity` a resumed run may change (the
            caller makes each change take effect after the restore).

    Attributes:
        history: dict with "evals" (one record per evaluation), "steps",
            "wall_time_s", "identity", and "finished" once the end is logged.
        start: the step the run continues from (0 for a fresh run).
        saved_step: the step of the newest checkpoint (`start`, then each
            `save`'s).
        writer: the run's `tf.summary` writer (a no-op writer off the chief).
        is_chief: whether this process writes.

    Raises:
        errors.InputError: if the identity differs from the committed
            run's and `allow_config_change` is false, or no checkpoint is
            readable.
    """

    def __init__(
        self,
        run_dir,
        checkpointer,
        config_values,
        identity,
        train_steps,
        is_chief=True,
        allow_config_change=False,
        changeable=(),
    ):
        tf.io.gfile.makedirs(run_dir)
        self.is_chief = is_chief
        self._run_dir = run_dir
        self._checkpointer = checkpointer
        self._history_path = os.path.join(run_dir, "history.json")
        identity = json.loads(json.dumps(identity))  # As the history file holds it.
        job = checkpointer.job
        recorded, changes, failure = None, {}, None
        try:
            recorded = self._read_history()
            if recorded and recorded.get("steps"):
                # Before the restore: a setting that changes the variables would
                # make every checkpoint look unreadable.
                allowed = set(changeable) if allow_config_change else set()
                changes = self._identity_changes(recorded, identity, allowed)
        except errors.InputError as error:  # A worker's own data or files may differ.
            failure = error
        _agree(job, failure)
        # A checkpoint past the history's last commit is of steps an earlier
        # relaunch went back over (its newest checkpoint was unreadable then).
        self.start = checkpointer.restore(newest=recorded["steps"] if recorded else None)
        self.saved_step = self.start  # The newest checkpoint's step (0: none).
        self.history = {"evals": [], "steps": 0, "wall_time_s": 0.0, "identity": identity}
        if self.start or _ended_diverged(recorded, identity):
            self.history = self._committed_history(recorded, identity, changes)
        # A run that stopped diverged is over, though its checkpoint is older.
        ended = self.history.get("finished") and (
            self.start == train_steps or _ended_diverged(self.history, identity)
        )
        self.finished = self.history["finished"] = bool(ended)
        self.fresh = self.history["steps"] == 0  # Nothing of it is committed.
        self.writer = tf.summary.create_noop_writer()
        if is_chief:
            try:
                self._cut_back(config_values)
            except errors.InputError as error:  # A damaged event file: every worker stops.
                failure = error
        _agree(job, failure)

    def _cut_back(self, config_values):
        """The chief's files cut back to the restored step; the run's writer (see the class)."""
        fault_points.reach("run state")
        if not self.finished:
            if self.start:  # The file first: a kill then leaves no "finished" without its end.
                json_files.write_json(self._history_path, self.history)
            event_files.remove_end(self._run_dir)
        event_files.keep_through(self._run_dir, self.history["steps"])
        # A finished run logs nothing more: no event file for this launch.
        if not self.finished:
            self.writer = tf.summary.create_file_writer(self._run_dir)
        if self.fresh:
            tensorboard_writers.write_config(self.writer, config_values)

    def _read_history(self):
        """The history file's content, or None if there is none.

        Raises:
            errors.InputError: if it is not JSON (it is written atomically:
                damaged since).
        """
        try:
            return json_files.read_json(self._history_path, None)
        except ValueError as error:  # json.JSONDecodeError, a bad non-finite entry.
            raise errors.InputError(
                f"{self._history_path} is damaged ({type(error).__name__}: {error}): the run's "
                "evaluations cannot be read. Restore it from a copy, or pass another "
                "--model_dir to start over."
            ) from None

    def _committed_history(self, history, identity, changes):
        """The history up to the restored step, with `changes` (of `_identity_changes`) recorded.

        A run that stopped diverged keeps its whole history (the evaluations
        after its last checkpoint included), unless its settings change.
        """
        if history is None:
            raise errors.InputError(
                f"{self._history_path} is missing, though a checkpoint of step {self.start} "
                "exists: the run's evaluations are lost. Pass another --model_dir to start over."
            )
        if not _ended_diverged(history, identity):
            history["evals"] = [e for e in history["evals"] if e["step"] <= self.start]
            history["steps"] = self.start
            if history.get("diverged", {}).get("step", 0) > self.start:
                del history["diverged"]  # Found after the checkpoint: found again, or not.
            if history.get("partial_interval", {}).get("step") != self.start:
                history.pop("partial_interval", None)  # Not of the restored step.
        if changes:
            history.setdefault("config_changes", []).append(
                {"step": self.start, "changed": changes}
            )
        history["identity"] = identity
        return history

    def _identity_changes(self, history, identity, allowed):
        """`{key: [recorded, new]}` of the identity's changes (flat keys), each in `allowed`.

        Raises:
            errors.InputError: naming the differences, if any is not allowed.
        """
        recorded = _flat(history.get("identity", identity))
        current = _flat(identity)
        changed = sorted(
            k
            for k in set(recorded) | set(current)
            if recorded.get(k) != current.get(k) and not _added_since(k, recorded)
        )
        differences = ", ".join(f"{k}={recorded.get(k)!r} → {current.get(k)!r}" for k in changed)
        fixed = [k for k in changed if not any(k == a or k.startswith(f"{a}.") for a in allowed)]
        at = f"{self._run_dir} holds a run at step {history['steps']}"
        if fixed and not allowed:
            raise errors.InputError(
                f"{at} with other settings ({differences}): relaunch with the run's settings, "
                "pass another --model_dir, or pass --allow_config_change to continue it with "
                "these (recorded in history.json)."
            )
        if fixed:
            raise errors.InputError(
                f"{at} whose {', '.join(fixed)} cannot change ({differences}): they fix its "
                "initial weights or its variables. Relaunch with the run's values, or pass "
                "another --model_dir to start a run with these."
            )
        if changed:
            logging.warning("Continuing %s with changed settings: %s", self._run_dir, differences)
        return {k: [recorded.get(k), current.get(k)] for k in changed}

    def record(self, record, step, wall_time_s):
        """Adds an evaluation `record` at `step` to the history and writes it (chief).

        Step 1 of the commit order: call it before logging the record's
        summaries and before `save`.
        """
        self.history["evals"].append(record)
        self.history["steps"] = step
        self.history["wall_time_s"] = wall_time_s
        if self.is_chief:
            json_files.write_json(self._history_path, self.history)

    def record_partial(self, step, sums, wall_time_s):
        """Commits a stop mid-interval at `step`: the interval's `sums` so far (chief), then `save`.

        A relaunch restored to `step` goes on from them, so the interval's
        record is the uninterrupted run's.
        """
        self.history["partial_interval"] = {"step": step, **sums}
        self.history["steps"] = step
        self.history["wall_time_s"] = wall_time_s
        if self.is_chief:
            json_files.write_json(self._history_path, self.history)

    def diverge(self, step, reason, stops):
        """Records the run's first divergence, at `step`, before its `record` (see `divergence`).

        `stops`: whether the run ends there (`--on_divergence=stop`); such a
        run is over for good (a relaunch with its settings trains nothing).
        """
        self.history.setdefault(
            "diverged",
            {"step": step, "reason": reason, "last_checkpoint": self.saved_step, "stopped": stops},
        )

    def save(self, step):
        """Checkpoints at `step` (every worker): step 3 of the commit order, after the flush.

        The run's event files are flushed to the disk first (the chief's), so a
        commit that survives a power loss has its events.
        """
        if self.is_chief:
            atomic_files.sync(event_files.paths(self._run_dir))
        self._checkpointer.save(step)
        self.saved_step = step

    def end_writer(self):
        """A writer of the run's end-of-run summaries, in a file of their own (chief)."""
        if not self.is_chief:
            return tf.summary.create_noop_writer()
        return tf.summary.create_file_writer(self._run_dir, filename_suffix=event_files.END_SUFFIX)

    def finish(self):
        """Commits the run's end, once its end-of-run summaries are flushed (to the disk too)."""
        self.finished = self.history["finished"] = True
        if self.is_chief:
            atomic_files.sync(event_files.paths(self._run_dir))
            json_files.write_json(self._history_path, self.history)

    def __enter__(self):
        return self

    def __exit__(self, *unused_exc_info):
        self.close()

    def close(self):
        """Closes the writer and the checkpointer."""
        self.writer.close()
        self._checkpointer.close()


def _agree(job, failure):
    """Raises `failure` (an `errors.InputError` or None) on every worker of `job` if any has one.

    Every worker calls it at the same point: one that raised alone would
    leave the others waiting in their next collective.
    """
    if job.any_worker(failure is not None):
        raise failure or errors.InputError(
            "Another worker of this job stopped at start-up, and so does this one: that "
            "worker's line says why. Relaunch every worker once it is mended."
        )


def _ended_diverged(history, identity):
    """Whether `history` (or None) is of a run that stopped diverged, with these settings."""
    return bool(
        history
        and history.get("finished")
        and history.get("diverged", {}).get("stopped")
        and history.get("identity") == identity
    )


def _added_since(key, recorded):
    """Whether identity `key` is one a run recorded before the trainers kept it lacks.

    The data's content digest (`data_checks.fingerprint`) came after its
    names and sizes: a run recorded without it is resumed on the sizes alone
    and records the digest from then on.
    """
    return key.startswith("data.") and key.endswith(".digest") and key not in recorded


def _flat(values, prefix=""):
    """`values` (a dict of JSON values), nested dicts' keys joined by ".": "data.splits.train"."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
