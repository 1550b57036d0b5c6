"""Run and path flags: where a run writes, where data lives, its seed."""

import os

from absl import flags

MODEL_DIR = flags.DEFINE_string(
    "model_dir",
    "runs/default",
    "Directory for checkpoints, TensorBoard event files and results. A run "
    "restarted with the same --model_dir resumes from its last checkpoint; "
    "a directory written by another trainer is refused.",
)
DATA_DIR = flags.DEFINE_string(
    "data_dir",
    None,
    "TensorFlow Datasets data directory holding the prepared data set "
    "(DIR/<dataset>/<version>/). Default: TFDS's own (the TFDS_DATA_DIR "
    "environment variable, else ~/tensorflow_datasets), where a data set TFDS "
    "can download (MNIST) is downloaded on first use.",
)
SEED = flags.DEFINE_integer(
    "seed", 0, "Seed for weight initialisation and data order.", lower_bound=0
)
NUM_SEEDS = flags.DEFINE_integer(
    "num_seeds",
    1,
    "Train every run for seeds --seed … --seed+N−1 (mnist_sigmoid: each network, each seed's "
    "data order and initial kernels shared by both; inception_bn --variant=all: each variant, "
    "each seed's data order shared by all), each seed a run of its own in <run>/seed_<s>; the "
    "figure and summary.json give the mean and spread over seeds.",
    lower_bound=1,
)


def seed_dir(run_dir, seed, num_seeds):
    """`run_dir`, or `run_dir/seed_<seed>` when the invocation trains several seeds."""
    return os.path.join(run_dir, f"seed_{seed}") if num_seeds > 1 else run_dir


def seeds(seed, num_seeds):
    """The seeds of --seed and --num_seeds: seed, seed + 1, …, seed + num_seeds − 1."""
    return list(range(seed, seed + num_seeds))


@flags.validator("model_dir", message="--model_dir must not be empty.")
def _model_dir_not_empty(value):
    return bool(value and value.strip())


ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "Resume a run in --model_dir whose recorded settings (seed, batch size, learning rate, "
    "network or variant, ...) differ from this launch's; the change is recorded in its "
    "history.json. Without it such a relaunch is refused.",
)
DETERMINISTIC = flags.DEFINE_bool(
    "deterministic",
    True,
    "Bit-identical runs for the same command and seed on the same machine and engine: "
    "TensorFlow's op determinism (tf.config.experimental.enable_op_determinism); JAX's CPU "
    "programs are deterministic as compiled. Turn it off for speed where a deterministic op "
    "is slower (some GPU kernels).",
)
