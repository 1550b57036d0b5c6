"""Training-loop flags shared by the trainers.

Defaults are None where each trainer has its own paper default; a trainer
uses `value if value is not None else its_default`.
"""

from absl import flags

TRAIN_STEPS = flags.DEFINE_integer(
    "train_steps", None, "Total optimisation steps (trainer default if unset).",
    lower_bound=1,
)
BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None,
    "GLOBAL batch size per step, split evenly across replicas "
    "(trainer default if unset).",
    lower_bound=1,
)
LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", None, "Initial learning rate (trainer default if unset).",
    lower_bound=0.0,
)
EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", None,
    "Evaluate, log and checkpoint every this many steps (trainer default if "
    "unset).",
    lower_bound=1,
)


@flags.validator("learning_rate", message="--learning_rate must be > 0.")
def _positive_learning_rate(value):
    return value is None or value > 0.0
