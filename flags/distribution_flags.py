"""Distribution flags: how a trainer spreads its steps over devices, on either engine.

The Keras backend (`KERAS_BACKEND`) picks the engine: TensorFlow runs a
tf.distribute strategy, JAX a `keras.distribution`. A strategy the engine
cannot run is refused when the flags are parsed.
"""

from absl import flags
import keras

STRATEGIES = ("off", "one_device", "mirrored", "multi_worker_mirrored", "tpu", "data_parallel")
# The strategies each engine runs (the Keras backend's name).
ENGINE_STRATEGIES = {
    "tensorflow": ("off", "one_device", "mirrored", "multi_worker_mirrored", "tpu"),
    "jax": ("off", "data_parallel"),
}

DISTRIBUTION_STRATEGY = flags.DEFINE_enum(
    "distribution_strategy",
    "off",
    STRATEGIES,
    "off: one device; TensorFlow only: one_device: the first GPU, else the CPU; "
    "mirrored: all local GPUs (CPU if none); multi_worker_mirrored: workers "
    "from TF_CONFIG; tpu: the TPU named by --tpu. JAX only: data_parallel: "
    "keras.distribution.DataParallel over every device (of all processes when "
    "KERAS_DISTRIBUTION_NUM_PROCESSES and the other KERAS_DISTRIBUTION_* variables "
    "name a multi-process job).",
)
TPU = flags.DEFINE_string(
    "tpu",
    None,
    "TPU name or grpc:// address, with --distribution_strategy=tpu; 'local' for a TPU VM.",
)
SYNC_BATCH_NORM = flags.DEFINE_bool(
    "sync_batch_norm",
    False,
    "Normalise with global-batch moments across replicas "
    "(keras_bn.BatchNormalization(synchronized=True)).",
)

flags.register_multi_flags_validator(
    ["distribution_strategy", "tpu"],
    lambda values: values["distribution_strategy"] == "tpu" or not values["tpu"],
    message="--tpu is only used with --distribution_strategy=tpu.",
)
flags.register_multi_flags_validator(
    ["distribution_strategy", "tpu"],
    lambda values: values["distribution_strategy"] != "tpu" or bool(values["tpu"]),
    message="--distribution_strategy=tpu needs --tpu (a name, address or 'local').",
)
NUM_CPU_DEVICES = flags.DEFINE_integer(
    "num_cpu_devices",
    None,
    "Split the CPU into this many logical devices before creating the "
    "strategy, to run multi-replica code on a machine without accelerators "
    "(under JAX: this process's host devices, XLA's "
    "--xla_force_host_platform_device_count).",
    lower_bound=1,
)
NUM_GPU_DEVICES = flags.DEFINE_integer(
    "num_gpu_devices",
    None,
    "Split GPU 0 into this many logical GPUs (16 GiB each) before creating "
    "the strategy, to run multi-replica code on a one-GPU machine (TensorFlow only).",
    lower_bound=1,
)
SYNC_GROUP_SIZE = flags.DEFINE_integer(
    "sync_group_size",
    None,
    "With --sync_batch_norm: normalise over consecutive groups of this many "
    "replicas instead of all (keras_bn.BatchNormalization(sync_group_size=k)); "
    "must divide the replica count. Default: all replicas.",
    lower_bound=1,
)

flags.register_multi_flags_validator(
    ["sync_batch_norm", "sync_group_size"],
    lambda values: values["sync_group_size"] is None or values["sync_batch_norm"],
    message="--sync_group_size groups the replicas of synchronised BN and needs --sync_batch_norm.",
)


def engine():
    """The engine the trainers run on: the Keras backend's name."""
    return keras.backend.backend()


@flags.validator("distribution_strategy")
def _strategy_runs_on_engine(value):
    supported = ENGINE_STRATEGIES.get(engine(), ("off",))
    if value not in supported:
        raise flags.ValidationError(
            f"--distribution_strategy={value} does not run under KERAS_BACKEND={engine()}; "
            f"this engine runs {', '.join(supported)}."
        )
    return True


@flags.validator("num_gpu_devices")
def _gpu_split_on_tensorflow(value):
    if value is not None and engine() != "tensorflow":
        raise flags.ValidationError(
            f"--num_gpu_devices splits a GPU with TensorFlow and does not apply under "
            f"KERAS_BACKEND={engine()}."
        )
    return True


# Every distribution flag, for the trainers' configs.
HOLDERS = (
    DISTRIBUTION_STRATEGY,
    TPU,
    NUM_CPU_DEVICES,
    NUM_GPU_DEVICES,
    SYNC_BATCH_NORM,
    SYNC_GROUP_SIZE,
)


def check_sync_group_size(sync_group_size, num_replicas):
    """Raises a ValueError naming both numbers if the group size cannot split the replicas."""
    if sync_group_size is not None and num_replicas % sync_group_size:
        raise ValueError(
            f"--sync_group_size={sync_group_size} must divide the number of replicas, "
            f"{num_replicas}, of --distribution_strategy."
        )
