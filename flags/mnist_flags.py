"""The sigmoid MNIST trainer's own flags (trainers/mnist_sigmoid.py)."""

import math

from absl import flags

NORM = flags.DEFINE_enum(
    "norm",
    "both",
    ["none", "batch_norm", "both"],
    "none: the sigmoid baseline; batch_norm: BN before every sigmoid; both: "
    "run the two in turn with the same seed and data order.",
)
INIT_STD = flags.DEFINE_float(
    "init_std", 0.1, "Std of the Gaussian weight initialisation.", lower_bound=0.0
)
flags.register_validator(
    "init_std", math.isfinite, message="--init_std must be a finite number >= 0."
)
PROBE_SIZE = flags.DEFINE_integer(
    "probe_size",
    1000,
    "Test images in the fixed probe batch for the percentiles and histograms.",
    lower_bound=2,
)
TRAIN_SUBSET = flags.DEFINE_integer(
    "train_subset",
    None,
    "Use only the first N training examples (smoke runs). Default: all 60,000.",
    lower_bound=1,
)
# This trainer's defaults of the shared training flags: the paper's §4.1 setup.
TRAINING_DEFAULTS = dict(train_steps=50_000, batch_size=60, learning_rate=0.5, eval_every=500)
