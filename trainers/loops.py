"""The training loop shared by the trainers: multi-step execution, evaluation,
logging, checkpoints and resume, with only the chief writing."""

import os
import shutil
import tempfile
import time

from absl import logging
import tensorflow as tf

from trainers import summaries


def make_multi_step(strategy, model, optimizer, loss_fn, global_batch, jit_compile=False):
    """Returns a compiled `run(iterator, n)` doing n SGD steps, mean loss back.

    Running n steps per call (Keras' steps_per_execution) keeps Python out of
    the inner loop. `loss_fn(labels, logits)` returns the per-replica SUM of
    per-example losses; dividing by the GLOBAL batch makes the strategy's
    summed gradients those of the global-batch mean loss. Regularisation
    losses are added once per replica, scaled by 1/num_replicas.
    """
    replicas = strategy.num_replicas_in_sync

    def forward_backward(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits) / global_batch
            if model.losses:
                loss += tf.add_n(model.losses) / replicas
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads

    if jit_compile:
        forward_backward = tf.function(forward_backward, jit_compile=True)

    def replica_step(x, y):
        loss, grads = forward_backward(x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def run(iterator, n):
        total = tf.constant(0.0)
        for _ in tf.range(n):
            per_replica = strategy.run(replica_step, args=next(iterator))
            total += strategy.reduce("SUM", per_replica, axis=None)
        return total / tf.cast(n, tf.float32)

    return run


def train_and_log(run, *, train_steps, eval_every, steps_per_execution, run_steps, evaluate, write_summaries, name):
    """Trains from `run.start` to `train_steps`, evaluating every `eval_every` steps.

    The one loop of both trainers. Steps run in compiled chunks of at most
    `steps_per_execution` (`None`: a whole evaluation interval per call).
    After each interval, which ends at the next multiple of `eval_every` (or
    at `train_steps`), the trainer's `evaluate(step, interval)` returns the
    record to keep (`interval` holds the interval's mean "train_loss", its
    "steps" and "seconds"), the record joins `run.history["evals"]`,
    `write_summaries(record, history)` logs it inside `run.writer` at that
    step (a no-op writer off the chief), and `run.save` checkpoints and
    writes the history (the history on the chief only).

    Args:
        run: the `RunState`.
        train_steps: the step to train to.
        eval_every: steps between evaluations.
        steps_per_execution: steps per compiled call, or `None`.
        run_steps: `run_steps(n) -> mean loss` runs n steps.
        evaluate: `evaluate(step, interval) -> dict`, the trainer's record.
        write_summaries: `write_summaries(record, history)`.
        name: the run's name in log lines.

    Returns:
        `run.history`.
    """
    history, step = run.history, run.start
    began = time.time() - history["wall_time_s"]
    while step < train_steps:
        target = min(step - step % eval_every + eval_every, train_steps)
        interval_start, loss_sum, tick = step, 0.0, time.time()
        while step < target:
            n = min(steps_per_execution or target - step, target - step)
            loss_sum += float(run_steps(n)) * n
            step += n
        interval = {
            "train_loss": loss_sum / (step - interval_start),
            "steps": step - interval_start,
            "seconds": time.time() - tick,
        }
        record = evaluate(step, interval)
        history["evals"].append(record)
        with run.writer.as_default(step=step):
            write_summaries(record, history)
        run.writer.flush()
        run.save(step, time.time() - began)
        logging.info(
            "%s step %d/%d: %s", name, step, train_steps,
            ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step" and isinstance(v, float)),
        )
    return history


class RunState:
    """A run's checkpoint, history file and TensorBoard writer, resumable.

    On creation it restores the latest checkpoint under `run_dir` (if any)
    and the history logged up to it, dropping evaluation records after the
    checkpoint's step (they are redone after resuming), and logs the run's
    configuration (a dict) for a fresh run. `save` checkpoints and rewrites the history together, so
    the two always agree.

    Only the chief writes (see `strategy.is_chief`). In a multi-worker run
    every worker must take part in a checkpoint save (the save reads
    distributed variables collectively), so each non-chief worker saves into
    its own temporary directory, outside `run_dir`, deleted by `close`
    (TensorFlow's multi-worker recipe); it writes no events and no history.
    Every worker restores from the chief's checkpoints in `run_dir`, so a
    relaunch of all workers resumes at the chief's step.

    Attributes:
        history: dict with "evals" (one record per evaluation), "steps" and
            "wall_time_s".
        start: the step the run continues from (0 for a fresh run).
        writer: the run's `tf.summary` writer (a no-op writer off the chief).
        is_chief: whether this process writes.
    """

    def __init__(self, run_dir, step, config_values, max_to_keep, is_chief=True, **trackables):
        self.is_chief = is_chief
        self._step = step
        self._checkpoint = tf.train.Checkpoint(step=step, **trackables)
        chief_dir = os.path.join(run_dir, "checkpoints")
        self._scratch = None if is_chief else tempfile.mkdtemp(prefix="keras_bn_worker_")
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, chief_dir if is_chief else self._scratch, max_to_keep=max_to_keep
        )
        self._history_path = os.path.join(run_dir, "history.json")
        self.history = {"evals": [], "steps": 0, "wall_time_s": 0.0}
        latest = tf.train.latest_checkpoint(chief_dir)
        if latest:
            self._checkpoint.restore(latest).assert_existing_objects_matched()
            self.history = summaries.read_json(self._history_path, self.history)
            restored = int(step.numpy())
            self.history["evals"] = [e for e in self.history["evals"] if e["step"] <= restored]
            self.history["steps"] = restored
            logging.info("Resumed from %s at step %d", latest, restored)
        self.start = int(step.numpy())
        if is_chief:
            self.writer = tf.summary.create_file_writer(run_dir)
            if self.start == 0:
                summaries.write_config(self.writer, config_values)
        else:
            self.writer = tf.summary.create_noop_writer()

    def save(self, step, wall_time_s):
        """Checkpoints at `step` (every worker) and writes the history (chief)."""
        self._step.assign(step)
        self.history["steps"] = step
        self.history["wall_time_s"] = wall_time_s
        self._manager.save(checkpoint_number=step)
        if self.is_chief:
            summaries.write_json(self._history_path, self.history)

    def __enter__(self):
        return self

    def __exit__(self, *unused_exc_info):
        self.close()

    def close(self):
        """Flushes the writer and removes a non-chief worker's scratch checkpoints."""
        self.writer.flush()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
