"""Creating a run's engine from the distribution flags (see distribution_flags).

The Keras backend picks the engine: a `tf.distribute` strategy under a
`trainers.engines.tf_runner.DistributeRunner` on TensorFlow, a `keras.distribution`
under a `trainers.engines.jax_runner.JaxRunner` on JAX. A multi-worker run that
loses a worker ends in one line saying which and how to resume
(`DistributionConfig.reporting_lost_workers`).
"""

import contextlib
import dataclasses
import os
import re

import keras

from trainers.engines import devices
from trainers.run import errors
from trainers.run import run_config


@dataclasses.dataclass(frozen=True)
class DistributionConfig:
    """The distribution settings of a run (flags/distribution_flags.py).

    The trainers' configs extend it, so every trainer carries and logs them.
    """

    distribution_strategy: str
    tpu: str | None
    num_cpu_devices: int | None
    num_gpu_devices: int | None
    sync_batch_norm: bool = run_config.identity_field()
    sync_group_size: int | None = run_config.identity_field()
    # The Keras backend the run trains on, recorded with the configuration.
    engine: str = dataclasses.field(default_factory=keras.backend.backend, kw_only=True)

    def create_strategy(self):
        """The tf.distribute strategy these settings name (see `create_strategy`)."""
        return create_strategy(
            self.distribution_strategy, self.tpu, self.num_cpu_devices, self.num_gpu_devices
        )

    def create_runner(self, jit_compile=False):
        """The runner of the Keras backend's engine for these settings.

        Create it before any dataset or model: on TensorFlow datasets are
        distributed by the strategy and variables placed under its scope, on
        JAX the host devices and processes are fixed before JAX starts.
        `jit_compile` (TensorFlow) XLA-compiles each replica's step; JAX
        compiles every step anyway.
        """
        if self.engine == "jax":
            from trainers.engines import jax_runner

            return jax_runner.create_runner(self.distribution_strategy, self.num_cpu_devices)
        from trainers.engines import tf_runner

        return tf_runner.DistributeRunner(self.create_strategy(), jit_compile)

    def reporting_lost_workers(self, model_dir):
        """A context turning the loss of a peer worker into a `WorkerLostError`.

        Wrap everything after the runner's creation in it (steps, evaluations
        and checkpoint saves all run collectives), inside
        `errors.one_line_errors`. Outside `multi_worker_mirrored` nothing
        is turned. `model_dir` is where the chief's checkpoints are found.
        """
        if self.distribution_strategy != "multi_worker_mirrored":
            return contextlib.nullcontext()
        return _reporting_lost_workers(model_dir)


class WorkerLostError(errors.InputError):
    """A worker of a multi-worker run was lost: one line naming it and how to resume."""


@contextlib.contextmanager
def _reporting_lost_workers(model_dir):
    import tensorflow as tf

    # What a survivor's collectives raise once a peer has gone: its connection
    # reset or refused (Unavailable), the coordination service's missed
    # heartbeats (Unavailable, or the abort as Cancelled/Aborted), a timeout.
    peer_errors = (
        tf.errors.UnavailableError,
        tf.errors.DeadlineExceededError,
        tf.errors.CancelledError,
        tf.errors.AbortedError,
        tf.errors.InternalError,
    )
    try:
        yield
    except peer_errors as error:
        # An InternalError is also what a bug raises: only an aborted collective is a loss.
        if isinstance(error, tf.errors.InternalError) and "collective" not in error.message.lower():
            raise
        raise WorkerLostError(_lost_worker_message(error, model_dir)) from error


_ABORTED = "Collective ops is aborted"


def _lost_worker_message(error, model_dir):
    """Which task was lost (TensorFlow's error names it, TF_CONFIG its address), how to resume."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec()
    tasks = [(job, i) for job in cluster.jobs for i in cluster.task_indices(job)]
    this = (resolver.task_type, resolver.task_id)
    name = lambda task: f"{task[0]} {task[1]} ({cluster.task_address(*task)})"
    named = re.findall(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)", error.message)
    lost = sorted({(job, int(i)) for job, i in named} & set(tasks) - {this})
    if lost:
        who = f"lost {', '.join(map(name, lost))} of this job"
    else:  # Not every error names the peer: list the job rather than guess.
        job = ", ".join(map(name, tasks))
        who = f"lost a worker of this job ({job}; TensorFlow does not say which)"
    # TensorFlow's own words: its collective's abort, where a compiled
    # function's error buries it under "Graph execution error:", else its
    # first line (and the next, which a line ending in ":" introduces);
    # without "{{function_node ...}}" prefixes.
    lines = [line.strip() for line in re.sub(r"\{\{.*?\}\}", "", error.message).splitlines()]
    lines = [line for line in lines if line] or ["?"]
    first = next((i for i, line in enumerate(lines) if line.startswith(_ABORTED)), 0)
    cause = " ".join(lines[first : first + (2 if lines[first].endswith(":") else 1)])[:200]
    checkpoint = _last_checkpoint(model_dir)
    resume = (
        f"it resumes from the last checkpoint, step {checkpoint[0]} ({checkpoint[1]})"
        if checkpoint
        else f"no checkpoint is in --model_dir={model_dir} yet, so it starts over"
    )
    return (
        f"{who}; this is {name(this)}, which stops too (TensorFlow: {cause}). "
        f"Relaunch every worker with the same command: {resume}."
    )


def _last_checkpoint(model_dir):
    """`(step, prefix)` of the newest chief checkpoint under `model_dir`, or None.

    The newest by time, not step: `--variant=all` and MNIST's networks and
    seeds each checkpoint into their own `<run>/checkpoints`.
    """
    import tensorflow as tf

    from trainers.run import checkpoints

    found = [
        (tf.io.gfile.stat(prefix + ".index").mtime_nsec, step, prefix)
        for directory, _, _ in tf.io.gfile.walk(model_dir)
        if os.path.basename(directory.rstrip("/")) == "checkpoints"
        for step, prefix in checkpoints.checkpoint_prefixes(directory)
    ]
    if not found:
        return None
    _, step, prefix = max(found)
    return step, prefix


def create_strategy(name, tpu=None, num_cpu_devices=None, num_gpu_devices=None):
    """Returns the `tf.distribute.Strategy` called `name`.

    Create it before any dataset or model: datasets are then distributed by
    it and variables placed under its scope.

    Args:
        name: one of "off", "one_device", "mirrored", "multi_worker_mirrored",
            "tpu".
        tpu: the TPU name or address for "tpu" ("local" on a TPU VM).
        num_cpu_devices: if set, first split the CPU into this many logical
            devices; "mirrored" then mirrors over them when there is no GPU.
        num_gpu_devices: if set, first split GPU 0 into this many logical
            GPUs (a multi-replica check on a one-GPU machine).

    Raises:
        ValueError: for an unknown name or "tpu" without `tpu`.
    """
    import tensorflow as tf  # Local: the JAX engine needs no strategy.

    cpus = (
        devices.split_device("CPU", num_cpu_devices)[:num_cpu_devices] if num_cpu_devices else None
    )
    if num_gpu_devices:
        devices.split_device("GPU", num_gpu_devices)
    if name == "off":
        return tf.distribute.get_strategy()
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        if cpus and not tf.config.list_logical_devices("GPU"):
            return tf.distribute.MirroredStrategy(cpus)
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker_mirrored":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        if not tpu:
            raise ValueError("The tpu strategy needs a TPU address. Received: tpu=None")
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu="" if tpu == "local" else tpu
        )
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(
        "Unknown distribution strategy. Expected one of off, one_device, "
        f"mirrored, multi_worker_mirrored, tpu. Received: name={name!r}"
    )
