"""Training-loop flags shared by the trainers, each trainer with its own defaults.

The defaults differ per trainer (the paper's MNIST and ImageNet setups), so
the flags default to `None` and each trainer's `config_from_flags` fills an
unset one from its own defaults (`with_defaults`): importing a trainer
changes no flag, and a process holding both trainers gives each its own.
Run as a program, a trainer also `set_defaults` before parsing, so its
`--help` shows its defaults.
"""

import math
import os

from absl import flags

from flags import distribution_flags as distribution_flags
from flags import run_flags as run_flags

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


EVAL_BN_STATISTICS = flags.DEFINE_enum(
    "eval_bn_statistics",
    "moving",
    ["moving", "precise"],
    "The BN population statistics each evaluation uses. moving: the layers' moving averages "
    "(the paper's). precise: re-estimated before each evaluation on --precise_bn_batches "
    "training batches (keras_bn.estimate_population_statistics); the record keeps the "
    "moving-statistics metrics too (prefixed moving_), and the checkpoints the moving "
    "statistics. Models without keras_bn layers evaluate as with moving.",
)
ON_DIVERGENCE = flags.DEFINE_enum(
    "on_divergence",
    "stop",
    ["stop", "continue"],
    "What a run does at an evaluation that finds it diverged (a non-finite train loss, "
    "metric or weight, or a BN layer that skipped every update of the interval): stop "
    "there, or continue training. Either way the divergence is recorded (history.json, "
    "summary.json, one line on stderr) and a non-finite state is never checkpointed.",
)
PRECISE_BN_BATCHES = flags.DEFINE_integer(
    "precise_bn_batches",
    100,
    "With --eval_bn_statistics=precise: how many training batches (the run's first ones, "
    "the same at every evaluation) the statistics are estimated on.",
    lower_bound=1,
)
# Names the number of processes of a multi-process JAX job (Keras' convention).
_JAX_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"


@flags.validator(
    "eval_bn_statistics",
    message="--eval_bn_statistics=precise runs eager passes that read every BN layer's "
    "statistics on the host, which a multi-process JAX job cannot (its arrays span "
    "processes): use --eval_bn_statistics=moving, or one process.",
)
def _precise_in_one_jax_process(value):
    if value != "precise" or distribution_flags.engine() != "jax":
        return True
    return int(os.environ.get(_JAX_NUM_PROCESSES, "1")) <= 1


@flags.validator("learning_rate", message="--learning_rate must be a finite number > 0.")
def _positive_learning_rate(value):
    return value is None or (math.isfinite(value) and value > 0.0)


LR_SWEEP = flags.DEFINE_list(
    "lr_sweep",
    None,
    "Learning-rate sweep: comma-separated multipliers of the base learning rate (e.g. "
    "1,5,30,100). mnist_sigmoid trains each network at --learning_rate × m, inception_bn the "
    "inception and bn_baseline recipes at the recipe's rate × m, each run in "
    "<model_dir>/<network>/lr_x<m>; lr_sweep.json, lr_sweep.md and lr_sweep.png at the "
    "model_dir root compare them (trainers/reporting/lr_sweep.py). One seed.",
)


@flags.validator("lr_sweep")
def _positive_multipliers(value):
    if not value:  # Unset, or set empty: no sweep.
        return True
    try:
        multipliers = [float(m) for m in value]
    except ValueError:
        multipliers = []  # Refused below with the values as given.
    if not multipliers or not all(0.0 < m < math.inf for m in multipliers):
        raise flags.ValidationError(
            "--lr_sweep takes finite multipliers > 0, comma-separated (e.g. 1,5,30,100). "
            f"Received: lr_sweep={','.join(value)}"
        )
    # Runs are named lr_x<m> with m to 6 significant digits: equal names would share a run.
    if len({f"{m:g}" for m in multipliers}) < len(multipliers):
        raise flags.ValidationError(
            "--lr_sweep names a multiplier twice (to 6 significant digits). "
            f"Received: lr_sweep={','.join(value)}"
        )
    return True


@flags.multi_flags_validator(
    ["lr_sweep", run_flags.NUM_SEEDS.name],
    message="--lr_sweep trains one seed per learning rate: drop --num_seeds, or sweep each "
    "seed with its own --seed and --model_dir.",
)
def _sweep_with_one_seed(values):
    return not values["lr_sweep"] or values["num_seeds"] == 1


def lr_multipliers():
    """The --lr_sweep multipliers as floats, in the order given, or None without a sweep."""
    return tuple(float(m) for m in LR_SWEEP.value) if LR_SWEEP.value else None


def values_with_defaults(holders, defaults):
    """Each holder's value by flag name, a training flag left unset taken from `defaults`.

    Args:
        holders: the flag holders a trainer's config is made of.
        defaults: a trainer's `TRAINING_DEFAULTS` (train_steps, batch_size,
            learning_rate, eval_every).

    Returns:
        A dict of flag name to value; a flag given on the command line keeps
        its value.
    """
    values = {holder.name: holder.value for holder in holders}
    unset = {k: v for k, v in defaults.items() if k in values and values[k] is None}
    return {**values, **unset}


def set_defaults(*, train_steps, batch_size, learning_rate, eval_every):
    """Sets a trainer's defaults of the four training flags (its `__main__` block, for `--help`).

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
