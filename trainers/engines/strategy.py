"""Creating a run's engine from the distribution flags (see distribution_flags).

The Keras backend picks the engine: a `tf.distribute` strategy under a
`trainers.engines.tf_runner.DistributeRunner` on TensorFlow, a `keras.distribution`
under a `trainers.engines.jax_runner.JaxRunner` on JAX. A multi-worker run that
loses a worker ends in one line saying which and how to resume
(`DistributionConfig.reporting_lost_workers`).
"""

import dataclasses

import keras

from trainers.engines import devices
from trainers.engines import lost_peers
from trainers.run import preemption
from trainers.run import run_config


@dataclasses.dataclass(frozen=True)
class DistributionConfig(run_config.RunConfig):
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

            runner = jax_runner.create_runner(self.distribution_strategy, self.num_cpu_devices)
        else:
            from trainers.engines import tf_runner

            runner = tf_runner.DistributeRunner(self.create_strategy(), jit_compile)
        # A multi-worker runtime may have taken SIGTERM over (see `preemption.reclaim`).
        preemption.reclaim()
        return runner

    def reporting_lost_workers(self, program, model_dir):
        """A context ending the run in one line if it loses a peer (`lost_peers.reporting`)."""
        return lost_peers.reporting(self.engine, self.distribution_strategy, program, model_dir)


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
