"""Training-loop flags shared by the trainers, each trainer setting its own defaults.

The defaults differ per trainer (the paper's MNIST and ImageNet setups), so
each trainer's main module calls `set_defaults` once at import: its `--help`
then shows its real defaults, and the flags hold them. The values here are
what a binary that sets none sees.
"""

import math

from absl import flags

TRAIN_STEPS = flags.DEFINE_integer("train_steps", None, "Total optimisation steps.", lower_bound=1)
BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None, "GLOBAL batch size per step, split evenly across replicas.", lower_bound=1
)
LEARNING_RATE = flags.DEFINE_float(
    "learning_rate",
    None,
    "Initial learning rate. A trainer with recipes (inception_bn --variant) leaves it unset "
    "and takes the recipe's.",
    lower_bound=0.0,
)
EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", None, "Evaluate, log and checkpoint every this many steps.", lower_bound=1
)


@flags.validator("learning_rate", message="--learning_rate must be a finite number > 0.")
def _positive_learning_rate(value):
    return value is None or (math.isfinite(value) and value > 0.0)


def set_defaults(*, train_steps, batch_size, learning_rate, eval_every):
    """Sets a trainer's defaults of the four training flags (module level of its main module).

    A flag given on the command line keeps its value; one left out takes the
    new default, which `--help` shows.
    """
    for holder, value in (
        (TRAIN_STEPS, train_steps),
        (BATCH_SIZE, batch_size),
        (LEARNING_RATE, learning_rate),
        (EVAL_EVERY, eval_every),
    ):
        flags.set_default(holder, value)
