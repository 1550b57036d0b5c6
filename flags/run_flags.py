"""Run and path flags: where a run writes, where data lives, its seed."""

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


@flags.validator("model_dir", message="--model_dir must not be empty.")
def _model_dir_not_empty(value):
    return bool(value and value.strip())
