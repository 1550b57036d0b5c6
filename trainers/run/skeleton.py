"""The one training skeleton of the trainers: build, resume, train, evaluate, log, checkpoint.

A trainer supplies a `Task` (its model, data, evaluation and summaries) and
a `LoopConfig`; `train_and_evaluate` runs the steps every trainer shares on
a runner, the engine underneath: `trainers.engines.tf_runner.DistributeRunner` (a
tf.distribute custom loop) on TensorFlow, `trainers.engines.jax_runner.JaxRunner`
(jitted stateless steps over `keras.distribution`) on JAX; the config's
`create_runner` picks the Keras backend's. Evaluation, logging and
checkpoint scheduling here do not depend on the engine: tasks compile their
own evaluation functions with `runner.compile(fn, model)`.

With `LoopConfig.eval_bn_statistics="precise"` each evaluation runs twice:
with the moving statistics, then with statistics re-estimated by
`keras_bn.estimate_population_statistics` on the run's first
`precise_bn_batches` training batches (`Task.train_dataset(0)`: the same
batches at every evaluation, and for a resumed run). The model's
non-trainable state is put back before the record is logged and checkpointed,
so checkpoints and the training trajectory hold the moving statistics only.
"""

import dataclasses
import signal
import time

from absl import logging
import keras

from trainers.reporting import console
from trainers.run import divergence
from trainers.run import evaluation
from trainers.run import fault_points
from trainers.run import preemption
from trainers.run import run_state


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
            (`Task.config.identity()`, and `Task.data_identity`)
            differs in settings that can change, applying and recording them.
        deterministic: make the engine's ops deterministic
            (`runner.make_deterministic`), so a run and its resumption after
            any kill give bit-identical histories.
        eval_bn_statistics: "moving" (the layers' moving statistics, the
            paper's) or "precise" (re-estimated before each evaluation; see
            `evaluation.evaluate`).
        precise_bn_batches: with "precise", the training batches the
            statistics are estimated on.
        on_divergence: at an evaluation that finds the run diverged
            (`trainers.run.divergence`): "stop" the run there, or
            "continue" training; either way a non-finite state is never
            checkpointed.
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
    eval_bn_statistics: str = "moving"
    precise_bn_batches: int = 100
    on_divergence: str = divergence.STOP

    @classmethod
    def of(cls, config, **run):
        """The loop of `config` (a trainer's config): its fields of these names, then `run`'s.

        `run` gives what the trainer's config does not hold, or holds for a
        whole invocation only: the run's name, directory, seed, ...
        """
        names = {field.name for field in dataclasses.fields(cls)} - set(run)
        return cls(
            **{name: getattr(config, name) for name in names if hasattr(config, name)}, **run
        )


class Task:
    """What a trainer supplies to the skeleton; override the methods it calls.

    Attributes:
        config: the run's config (a trainer's frozen dataclass), logged whole
            for a fresh run; its identity fields (`RunConfig.identity`) are
            what a resumed run must share with its checkpoint.

    The skeleton calls, in order: `build` (under the engine's scope),
    `prepare_evaluation`, `data_identity`, `write_start` (fresh runs
    only), `train_dataset`, then per evaluation `evaluate` and
    `write_summaries`, and `write_end` (once per run, also when a relaunch
    finds the end of a finished run not yet logged).
    """

    def build(self):
        """Returns `(model, optimizer)`."""
        raise NotImplementedError

    def prepare_evaluation(self, model, runner):
        """Readies the evaluation of the built `model` on `runner`."""

    def data_identity(self):
        """What identifies the run's data (a JSON value, e.g. `data_checks.fingerprint`), or None.

        Part of the run's identity: a relaunch on other data is refused
        unless it allows the change.
        """
        return None

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

    def statistics_metrics(self):
        """The keys of `evaluate`'s record that depend on the BN inference statistics.

        With precise statistics each is recorded again, prefixed "moving_", as
        the moving statistics give it.
        """
        return ()

    def write_summaries(self, record, history):
        """Logs `record` (the default writer is the run's, at its step)."""
        raise NotImplementedError

    def write_end(self, writer, history):
        """Logs what a run records when it has trained (in `writer`, its own file)."""


def train_and_evaluate(task, loop, runner):
    """Trains `task` as `loop` says on `runner`; returns the run's history.

    Seeds, builds under the runner, restores the latest checkpoint in
    `loop.run_dir` (a restarted run continues at its step), then trains to
    `loop.train_steps`, evaluating, logging and checkpointing every
    `loop.eval_every` steps (see `train_and_log`). Only the chief writes.

    Returns:
        dict with "evals" (one record per evaluation), "steps" and "wall_time_s".

    The trainer's `main` checked that the global batch and the BN groups
    split the replicas (`program.claim`).
    """
    replicas = runner.num_replicas
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
    identity = task.config.identity()
    data = task.data_identity()
    if data is not None:
        identity["data"] = data
    learning_rate = optimizer.get_config()["learning_rate"]  # A float, or a schedule's config.
    with (
        preemption.deferred() as stops,
        run_state.RunState(
            loop.run_dir,
            checkpointer,
            task.config.flat_values(),
            identity,
            loop.train_steps,
            is_chief=runner.is_chief,
            allow_config_change=loop.allow_config_change,
            changeable=task.config.changeable_keys() | {"data"},
        ) as run,
    ):
        # A stop asked during start-up: the restored step is all there is to keep.
        if not run.finished and runner.any_worker(stops.signal is not None):
            raise preemption.Stopped(loop.name, run.start, stops.signal or _TERM, saved=True)
        if isinstance(learning_rate, float):
            # The config's rate, not the checkpoint's: a changed rate takes effect.
            optimizer.learning_rate = learning_rate
        if run.fresh:
            task.write_start(run.writer)
        # Sums per replica, divided by the global batch in the step: the
        # gradients of the global-batch mean loss.
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        run_steps = runner.train_function(
            task.train_dataset(run.start), model, optimizer, loss_fn, loop.batch_size
        )
        watch = divergence.Watch(model, runner.host_values, run.start)
        history = train_and_log(run, task, loop, run_steps, model, watch, runner, stops)
        if not run.finished:
            fault_points.reach("run end")
            end_writer = run.end_writer()
            task.write_end(end_writer, history)
            end_writer.close()
            run.finish()
        return history


def train_and_log(run, task, loop, run_steps, model, watch, runner, stops):
    """Trains from `run.start` to `loop.train_steps`, evaluating every `loop.eval_every` steps.

    Steps run in compiled chunks of at most `loop.steps_per_execution`
    (`run_steps(n) -> mean loss`). After each interval, which ends at the
    next multiple of `eval_every` (or at `train_steps`), `evaluate` returns
    the record to keep (`task.evaluate`'s; with precise BN statistics that of
    the trained `model`'s re-estimated statistics, the moving ones' metrics
    beside it), and the record is committed in the order of
    `trainers.run.run_state`: `run.record` writes it into the history,
    `task.write_summaries` logs it inside `run.writer` at that step (a no-op
    writer off the chief) and the writer is flushed, then `run.save`
    checkpoints the step, unless `watch` (a `divergence.Watch`) finds the
    run diverged: the divergence is then recorded first, the step is not
    checkpointed, one line says so, and with `loop.on_divergence` "stop" the
    run ends there.

    A SIGTERM or SIGINT (`stops`, the `preemption.StopRequests`) stops the run after the
    compiled call it arrives in, every worker at the same step
    (`runner.any_worker`): at the end of an interval after its commit, else
    after committing the interval's sums so far (`run.record_partial`) and
    checkpointing the step, so a relaunch goes on exactly as the
    uninterrupted run. It ends in `preemption.Stopped`.

    Returns:
        `run.history`.
    """
    history = run.history
    began = time.time() - history["wall_time_s"]
    progress = console.Progress(loop.name, run.start, loop.train_steps)
    # Where training stands, also mid-interval: what an interruption reports.
    position = {"step": run.start}

    def stop_requested():
        return runner.any_worker(stops.signal is not None)

    while position["step"] < loop.train_steps and not run.finished:
        try:
            diverged = _interval(
                run, task, loop, run_steps, (model, watch), position, began, stop_requested
            )
        except KeyboardInterrupt as interrupted:
            progress.end_line()
            if isinstance(interrupted, _Stop):
                raise preemption.Stopped(
                    loop.name, position["step"], stops.signal or _TERM, interrupted.saved
                ) from None
            raise console.Interrupted(loop.name, position["step"], run.saved_step) from None
        record = history["evals"][-1]
        progress.update(
            position["step"],
            {k: v for k, v in record.items() if k != "step" and isinstance(v, float)},
        )
        if diverged:
            break
        # At the last step the run ends as usual: nothing is left to stop.
        if position["step"] < loop.train_steps and stop_requested():
            progress.end_line()
            saved = run.saved_step == position["step"]
            raise preemption.Stopped(loop.name, position["step"], stops.signal or _TERM, saved)
    return history


_TERM = signal.SIGTERM  # What stopped a worker that agreed to another worker's signal.


class _Stop(KeyboardInterrupt):
    """Raised by `_interval` when it stopped mid-interval; `saved`: whether it checkpointed."""

    def __init__(self, saved):
        super().__init__(saved)
        self.saved = saved


def _interval(run, task, loop, run_steps, model_and_watch, position, began, stop_requested):
    """Trains from `position["step"]` to the next evaluation, evaluates and commits it.

    `position["step"]` follows every compiled call of `run_steps` (a whole
    interval without `steps_per_execution`), so an interruption knows the
    step training had reached. A run resumed mid-interval goes on from the
    interval's committed sums. Returns whether the run stops there
    (diverged, with `on_divergence` "stop"); raises `_Stop` when
    `stop_requested()` after a call that does not end the interval.
    """
    model, watch = model_and_watch
    step = position["step"]
    target = min(step - step % loop.eval_every + loop.eval_every, loop.train_steps)
    sums = {"interval_start": step, "loss_sum": 0.0, "seconds": 0.0}
    partial = run.history.pop("partial_interval", None)
    if partial is not None and partial["step"] == step:  # Resumed mid-interval.
        sums = {key: partial[key] for key in sums}
    tick = time.time()
    while step < target:
        n = min(loop.steps_per_execution or target - step, target - step)
        sums["loss_sum"] += float(run_steps(n)) * n
        step += n
        position["step"] = step
        if step < target and stop_requested():
            sums["seconds"] += time.time() - tick
            run.record_partial(step, sums, time.time() - began)
            run.writer.flush()
            saved = watch.weights_problem() is None  # A non-finite state is never checkpointed.
            if saved:
                run.save(step)
            raise _Stop(saved)
    interval = {
        "train_loss": sums["loss_sum"] / (step - sums["interval_start"]),
        "steps": step - sums["interval_start"],
        "seconds": sums["seconds"] + time.time() - tick,
    }
    fault_points.reach("evaluation")
    record = evaluation.evaluate(task, loop, model, step, interval)
    problem = watch.check(record, step)
    if problem is not None:
        first = "diverged" not in run.history
        run.diverge(step, problem, stops=loop.on_divergence == divergence.STOP)
        if first:
            console.diverged(loop.name, step, problem, run.saved_step, loop.on_divergence)
    run.record(record, step, time.time() - began)
    with run.writer.as_default(step=step):
        task.write_summaries(record, run.history)
    run.writer.flush()
    if problem is None:  # A non-finite state is never checkpointed.
        run.save(step)
    return problem is not None and loop.on_divergence == divergence.STOP
