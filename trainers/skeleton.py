"""The one training skeleton of the trainers: build, resume, train, evaluate, log, checkpoint.

A trainer supplies a `Task` (its model, data, evaluation and summaries) and
a `LoopConfig`; `train_and_evaluate` runs the steps every trainer shares on
a runner, the engine underneath: `trainers.tf_runner.DistributeRunner` (a
tf.distribute custom loop) on TensorFlow, `trainers.jax_runner.JaxRunner`
(jitted stateless steps over `keras.distribution`) on JAX; the config's
`create_runner` picks the Keras backend's. Evaluation, logging and
checkpoint scheduling here do not depend on the engine: tasks compile their
own evaluation functions with `runner.compile(fn, model)`.
"""

import dataclasses
import time

from absl import logging
import keras

from flags import distribution_flags as distribution_flags
from trainers import preflight
from trainers import run_state


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How one run trains, evaluates and checkpoints.

    Attributes:
        name: the run's name in log lines.
        run_dir: where its checkpoints, history and events go.
        seed: seeds weight initialisation (and the task's data order).
        train_steps: the step to train to.
        eval_every: steps between evaluations (each followed by a checkpoint).
        batch_size: the GLOBAL batch per step.
        steps_per_execution: steps per compiled call; None: a whole
            evaluation interval per call.
        max_to_keep: checkpoints kept.
        sync_group_size: replicas per synchronised-BN group, or None.
        allow_config_change: resume a run whose recorded identity
            (`Task.identity`) differs, recording the change.
        deterministic: make the engine's ops deterministic
            (`runner.make_deterministic`), so a run and its resumption after
            any kill give bit-identical histories.
    """

    name: str
    run_dir: str
    seed: int
    train_steps: int
    eval_every: int
    batch_size: int
    steps_per_execution: int | None
    max_to_keep: int
    sync_group_size: int | None = None
    allow_config_change: bool = False
    deterministic: bool = True


class Task:
    """What a trainer supplies to the skeleton; override the methods it calls.

    The skeleton calls, in order: `build` (under the engine's scope),
    `prepare_evaluation`, `config_values` and `identity`, `write_start`
    (fresh runs only), `train_dataset`, then per evaluation `evaluate` and
    `write_summaries`, and `write_end` (once per run, also when a relaunch
    finds the end of a finished run not yet logged).
    """

    def build(self):
        """Returns `(model, optimizer)`."""
        raise NotImplementedError

    def prepare_evaluation(self, model, runner):
        """Readies the evaluation of the built `model` on `runner`."""

    def config_values(self):
        """The run's configuration as a flat dict, logged for a fresh run."""
        raise NotImplementedError

    def identity(self):
        """The settings a resumed run must share with its checkpoint, as a flat dict.

        Those that shape the trajectory (seed, batch, learning rate, network),
        not those a relaunch may change (steps, evaluation cadence, paths).
        """
        raise NotImplementedError

    def write_start(self, writer):
        """Logs what a fresh run records before its first step (in `writer`)."""

    def train_dataset(self, start_step):
        """The GLOBAL-batch training data from `start_step` on."""
        raise NotImplementedError

    def evaluate(self, step, interval):
        """Returns the record of the evaluation at `step`.

        `interval` holds the steps since the previous evaluation: their mean
        "train_loss", their number "steps" and the "seconds" they took.
        """
        raise NotImplementedError

    def write_summaries(self, record, history):
        """Logs `record` (the default writer is the run's, at its step)."""
        raise NotImplementedError

    def write_end(self, writer, history):
        """Logs what a run records when it has trained (in `writer`, its own file)."""


def check_replicas(loop, num_replicas):
    """Raises `preflight.InputError` if the batch or BN groups cannot split the replicas."""
    if loop.batch_size % num_replicas:
        raise preflight.InputError(
            f"The global batch must split evenly over {num_replicas} replicas. "
            f"Received: batch_size={loop.batch_size}"
        )
    try:
        distribution_flags.check_sync_group_size(loop.sync_group_size, num_replicas)
    except ValueError as error:
        raise preflight.InputError(str(error)) from None


def train_and_evaluate(task, loop, runner):
    """Trains `task` as `loop` says on `runner`; returns the run's history.

    Seeds, builds under the runner, restores the latest checkpoint in
    `loop.run_dir` (a restarted run continues at its step), then trains to
    `loop.train_steps`, evaluating, logging and checkpointing every
    `loop.eval_every` steps (see `train_and_log`). Only the chief writes.

    Returns:
        dict with "evals" (one record per evaluation), "steps" and "wall_time_s".

    Raises:
        preflight.InputError (a ValueError): if the global batch does not
            split evenly over the replicas, or the sync group size does not
            divide their number.
    """
    replicas = runner.num_replicas
    check_replicas(loop, replicas)
    logging.info(
        "Global batch %d = %d replicas × %d per replica",
        loop.batch_size,
        replicas,
        loop.batch_size // replicas,
    )
    keras.utils.set_random_seed(loop.seed)
    if loop.deterministic:
        runner.make_deterministic()
    model, optimizer = runner.build(task.build)
    task.prepare_evaluation(model, runner)
    checkpointer = runner.checkpointer(loop.run_dir, loop.max_to_keep, model, optimizer)
    with run_state.RunState(
        loop.run_dir,
        checkpointer,
        task.config_values(),
        task.identity(),
        loop.train_steps,
        is_chief=runner.is_chief,
        allow_config_change=loop.allow_config_change,
    ) as run:
        if run.start == 0:
            task.write_start(run.writer)
        # Sums per replica, divided by the global batch in the step: the
        # gradients of the global-batch mean loss.
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        run_steps = runner.train_function(
            task.train_dataset(run.start), model, optimizer, loss_fn, loop.batch_size
        )
        history = train_and_log(run, task, loop, run_steps)
        if not run.finished:
            end_writer = run.end_writer()
            task.write_end(end_writer, history)
            end_writer.flush()
            run.finish()
        return history


def train_and_log(run, task, loop, run_steps):
    """Trains from `run.start` to `loop.train_steps`, evaluating every `loop.eval_every` steps.

    Steps run in compiled chunks of at most `loop.steps_per_execution`
    (`run_steps(n) -> mean loss`). After each interval, which ends at the
    next multiple of `eval_every` (or at `train_steps`), `task.evaluate`
    returns the record to keep, and the record is committed in the order of
    `trainers.run_state`: `run.record` writes it into the history,
    `task.write_summaries` logs it inside `run.writer` at that step (a no-op
    writer off the chief) and the writer is flushed, then `run.save`
    checkpoints the step.

    Returns:
        `run.history`.
    """
    history, step = run.history, run.start
    began = time.time() - history["wall_time_s"]
    while step < loop.train_steps:
        target = min(step - step % loop.eval_every + loop.eval_every, loop.train_steps)
        interval_start, loss_sum, tick = step, 0.0, time.time()
        while step < target:
            n = min(loop.steps_per_execution or target - step, target - step)
            loss_sum += float(run_steps(n)) * n
            step += n
        interval = {
            "train_loss": loss_sum / (step - interval_start),
            "steps": step - interval_start,
            "seconds": time.time() - tick,
        }
        record = task.evaluate(step, interval)
        run.record(record, step, time.time() - began)
        with run.writer.as_default(step=step):
            task.write_summaries(record, history)
        run.writer.flush()
        run.save(step)
        metrics = ", ".join(
            f"{k} {v:.4g}" for k, v in record.items() if k != "step" and isinstance(v, float)
        )
        logging.info("%s step %d/%d: %s", loop.name, step, loop.train_steps, metrics)
    return history
