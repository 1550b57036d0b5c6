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
    "tpu", None,
    "TPU name or grpc:// address, with --distribution_strategy=tpu; 'local' "
    "for a TPU VM.",
)
SYNC_BATCH_NORM = flags.DEFINE_bool(
    "sync_batch_norm", False,
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
    "num_cpu_devices", None,
    "Split the CPU into this many logical devices before creating the "
    "strategy, to run multi-replica code on a machine without accelerators.",
    lower_bound=1,
)
