"""Distribution flags: which tf.distribute strategy a trainer runs under."""

from absl import flags

STRATEGIES = ("off", "one_device", "mirrored", "multi_worker_mirrored", "tpu")

DISTRIBUTION_STRATEGY = flags.DEFINE_enum(
    "distribution_strategy",
    "off",
    STRATEGIES,
    "off: the default strategy; one_device: the first GPU, else the CPU; "
    "mirrored: all local GPUs (CPU if none); multi_worker_mirrored: workers "
    "from TF_CONFIG; tpu: the TPU named by --tpu.",
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
    "strategy, to run multi-replica code on a machine without accelerators.",
    lower_bound=1,
)
NUM_GPU_DEVICES = flags.DEFINE_integer(
    "num_gpu_devices",
    None,
    "Split GPU 0 into this many logical GPUs (16 GiB each) before creating "
    "the strategy, to run multi-replica code on a one-GPU machine.",
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
