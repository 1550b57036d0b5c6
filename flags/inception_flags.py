"""The Inception trainer's own flags (trainers/inception_bn.py), and the combinations it refuses."""

import math

from absl import flags

from flags import distribution_flags as distribution_flags
from flags import training_flags as training_flags
from trainers.inception import recipes as inception_recipes

_RECIPE_DEFAULT = "Default: the --variant recipe's (trainers/inception/recipes.py)."
VARIANT = flags.DEFINE_enum(
    "variant",
    "bn_x5",
    [*inception_recipes.RECIPES, "all"],
    "The paper's model variant (recipe bundle); inception_x5 is Inception at BN-x5's "
    "learning rate. all: the five Table 2 variants in turn, each in --model_dir/<variant>, "
    "with the decay interval scaled to --train_steps, then the Table 2 summary and Figure 2 "
    "(trainers/inception/table2.py).",
)
WITH_INCEPTION_X5 = flags.DEFINE_bool(
    "with_inception_x5",
    False,
    "With --variant=all, also train inception_x5 (the paper's check that Inception "
    "without BN cannot use the ×5 learning rate).",
)
DATASET = flags.DEFINE_string(
    "dataset",
    inception_recipes.PAPER_DATASET,
    "TFDS image-classification data set with 'image' and 'label' features (e.g. "
    "fashion_mnist); grayscale becomes 3 channels, classes come from its info.",
)
IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Input height and width.", lower_bound=32)
WIDTH_MULTIPLIER = flags.DEFINE_float(
    "width_multiplier",
    1.0,
    "Scales every convolution's filter count (rounded, at least 1): a narrower network for "
    "miniatures on CPUs. 1.0: the paper's BN-Inception.",
)
flags.register_validator(
    "width_multiplier",
    lambda value: 0.0 < value < math.inf,
    message="--width_multiplier must be a finite number > 0.",
)
USE_FAKE_DATA = flags.DEFINE_bool(
    "use_fake_data", False, "Random data of the real shapes instead of --dataset."
)
DROPOUT = flags.DEFINE_float(
    "dropout", None, f"Dropout rate. {_RECIPE_DEFAULT}", lower_bound=0.0, upper_bound=0.99
)
WEIGHT_DECAY = flags.DEFINE_float(
    "weight_decay", None, f"L2 coefficient. {_RECIPE_DEFAULT}", lower_bound=0.0
)
DECAY_STEPS = flags.DEFINE_integer(
    "lr_decay_steps",
    None,
    f"Steps per 0.94× learning-rate decay. {_RECIPE_DEFAULT}",
    lower_bound=1,
)
STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution", 1, "Train steps per compiled call.", lower_bound=1
)
MIXED_PRECISION = flags.DEFINE_bool(
    "mixed_precision", False, "bfloat16 compute (mixed_bfloat16 policy)."
)
JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile",
    False,
    "XLA-compile each replica's forward/backward (under --distribution_strategy=tpu "
    "XLA always compiles the whole step).",
)
EVAL_STEPS = flags.DEFINE_integer(
    "eval_steps", None, "Evaluation batches. Default: the whole split.", lower_bound=1
)
TARGET_ACCURACY = flags.DEFINE_float(
    "target_accuracy",
    0.722,
    "Top-1 whose first reaching step is recorded (paper: 72.2%).",
    lower_bound=0.0,
    upper_bound=1.0,
)
# This trainer's defaults of the shared training flags: the paper's batch of 32;
# --learning_rate unset takes the --variant recipe's.
TRAINING_DEFAULTS = dict(
    train_steps=3_000_000, batch_size=32, learning_rate=None, eval_every=10_000
)


@flags.multi_flags_validator(
    ["jit_compile", "sync_batch_norm", "distribution_strategy"],
    message=(
        "--jit_compile cannot be combined with --sync_batch_norm under "
        "--distribution_strategy=mirrored or multi_worker_mirrored: --jit_compile "
        "compiles each replica's forward/backward as a function nested in "
        "strategy.run, and tf.distribute cannot run the synchronised BN "
        "collectives inside it. Drop one of the two flags, or use "
        "--distribution_strategy=tpu, where XLA compiles the whole step, "
        "collectives included."
    ),
)
def _jit_compile_with_sync(values):
    return not (
        values["jit_compile"]
        and values["sync_batch_norm"]
        and values["distribution_strategy"] in ("mirrored", "multi_worker_mirrored")
    )


@flags.validator(
    "jit_compile",
    message="--jit_compile applies to the TensorFlow engine; under KERAS_BACKEND=jax every "
    "training step is XLA-compiled already: drop the flag.",
)
def _jit_compile_on_tensorflow(value):
    return not value or distribution_flags.engine() == "tensorflow"


@flags.multi_flags_validator(
    ["variant", training_flags.LEARNING_RATE.name, "dropout", "weight_decay", "lr_decay_steps"],
    message=(
        "--variant=all trains every variant with its own recipe: --learning_rate, --dropout, "
        "--weight_decay and --lr_decay_steps would override them all alike. Drop them, or "
        "train one --variant with them."
    ),
)
def _all_keeps_the_recipes(values):
    overrides = ("learning_rate", "dropout", "weight_decay", "lr_decay_steps")
    return values["variant"] != "all" or all(values[name] is None for name in overrides)


@flags.multi_flags_validator(
    ["variant", "with_inception_x5"],
    message="--with_inception_x5 adds a variant to --variant=all; pass --variant=inception_x5 "
    "to train it alone.",
)
def _inception_x5_with_all(values):
    return values["variant"] == "all" or not values["with_inception_x5"]
