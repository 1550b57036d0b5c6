r"""BN-Inception on ImageNet: the paper's §4.2 runs, distributed, with TensorBoard.

Variants (--variant): inception, bn_baseline, bn_x5, bn_x30, bn_x5_sigmoid;
each sets the paper's recipe (trainers/inception/recipes.py) and individual
flags override it. SGD with momentum 0.9 and exponential learning-rate decay;
--batch_size is the GLOBAL batch per step (the paper's 32), split evenly over
the replicas of --distribution_strategy. Evaluates single-crop top-1/top-5
every --eval_every steps, logs loss, learning rate, top-1, top-5, images/sec,
the whole configuration, and the step at which top-1 first reaches --target_accuracy
(the paper's Table 2 metric) to TensorBoard under --model_dir, and
checkpoints; a restarted run continues at its checkpointed step.

--eval_bn_statistics=precise evaluates with BN statistics re-estimated before
each evaluation on the run's first --precise_bn_batches training batches
(trainers/run/skeleton.py): top1 (and so the steps to the target), top5 and
summary.json are then theirs, the record keeps the moving statistics' as
moving_top1/moving_top5 and the estimation's wall time as
precise_bn_seconds, TensorBoard logs eval/moving_top1, eval/moving_top5 and
eval/precise_bn_seconds, and the checkpoints keep the moving statistics.

Smoke run (fake data, small images, a few steps):

    python -m trainers.inception_bn --use_fake_data --image_size=64 \
        --train_steps=20 --eval_every=10 --eval_steps=2 --batch_size=8 \
        --model_dir=runs/inception_smoke

Expected result of the smoke run: a finite loss starting near ln(1000) ≈ 6.9
that falls as the model memorises the 4 repeated fake batches, event files
and checkpoints in --model_dir.

Real run (ImageNet prepared by TFDS under DIR, 8 GPUs):

    python -m trainers.inception_bn --variant=bn_x5 --data_dir=DIR \
        --distribution_strategy=mirrored --batch_size=256 --sync_batch_norm \
        --model_dir=gs://bucket/bn_x5

Expected result of the real runs, from the paper (Table 2; see
docs/reproduction.md for what this implementation has been run on): BN-x5
reaches 72.2% top-1 in 14× fewer steps than Inception and peaks at 73.0%;
BN-x30 peaks at 74.8%.

Other data sets (--dataset: any TFDS data set with image and label
features; trainers/inception/data.py) and Table 2 in miniature, the five
variants in turn with one summary and Figure 2 (trainers/inception/table2.py):

    python -m trainers.inception_bn --dataset=fashion_mnist --variant=all \
        --image_size=32 --train_steps=1000 --eval_every=100 --eval_steps=64 \
        --data_dir=DIR --model_dir=runs/table2_fashion_mnist

--width_multiplier scales every convolution's filter count (1.0: the paper's
network) so that the miniature fits on CPUs; --num_seeds=N (with
--variant=all only) trains every variant for seeds --seed … --seed+N−1, each
in --model_dir/<variant>/seed_<s>, and the table gives mean ± std over seeds
with Figure 2's min–max bands:

    python -m trainers.inception_bn --dataset=fashion_mnist --variant=all \
        --num_seeds=3 --width_multiplier=0.25 --image_size=32 --batch_size=32 \
        --train_steps=1000 --eval_every=100 --eval_steps=64 \
        --data_dir=DIR --model_dir=runs/table2_seeds

Learning-rate sweep (--lr_sweep; trainers/reporting/lr_sweep.py; TensorFlow only, one
seed, no --variant other than all and no recipe override): the inception and
bn_baseline recipes, the same but for BN, each at its learning rate × each
multiplier and its decay scaled to --train_steps as with --variant=all, in
--model_dir/<variant>/lr_x<m>, compared in lr_sweep.json, lr_sweep.md and
lr_sweep.png at the root:

    python -m trainers.inception_bn --dataset=fashion_mnist --lr_sweep=1,5,30,100 \
        --width_multiplier=0.25 --image_size=32 --train_steps=1000 --eval_every=100 \
        --eval_steps=64 --data_dir=DIR --model_dir=runs/lr_sweep_inception
"""

import dataclasses
import math
import os

from absl import app
from absl import flags
import keras

from flags import batch_norm_flags as batch_norm_flags
from flags import distribution_flags as distribution_flags
from flags import run_flags as run_flags
from flags import training_flags as training_flags
from trainers.engines import strategy as strategy_lib
from trainers.inception import data as image_data
from trainers.inception import recipes as inception_recipes
from trainers.inception import table2 as inception_table2
from trainers.inception import task as inception_task
from trainers.reporting import console
from trainers.reporting import lr_sweep
from trainers.reporting import summaries
from trainers.run import data_checks
from trainers.run import errors
from trainers.run import model_dirs
from trainers.run import skeleton

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
    image_data.IMAGENET,
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

TRAINER = "trainers.inception_bn"  # Recorded in --model_dir (see trainers/run/model_dirs.py).


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
    ["variant", "learning_rate", "dropout", "weight_decay", "lr_decay_steps"],
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


def check_seeds_and_sweep(variant, num_seeds, lr_sweep, overrides):
    """Raises `errors.InputError` for the --num_seeds and --lr_sweep combinations refused.

    --num_seeds > 1 repeats --variant=all only; --lr_sweep trains the
    inception and bn_baseline recipes as they are (so no other --variant and
    no recipe override) on TensorFlow, where their LRN layers build. Checked
    by `config_from_flags` on the values it read, not by flag validators:
    these flags are shared with mnist_sigmoid, whose values would trip a
    validator in a process that defines both trainers' flags.

    Args:
        variant: --variant.
        num_seeds: --num_seeds.
        lr_sweep: the --lr_sweep multipliers, or None.
        overrides: the recipe-overriding flags by name (--learning_rate,
            --dropout, --weight_decay, --lr_decay_steps), None where unset.
    """
    if num_seeds > 1 and variant != "all":
        raise errors.InputError(
            "--num_seeds > 1 repeats Table 2 in miniature (--variant=all) over seeds; train one "
            "variant's seeds each with its own --seed and --model_dir. "
            f"Received: num_seeds={num_seeds}, variant={variant}"
        )
    if not lr_sweep:
        return
    given = [f"{name}={value}" for name, value in overrides.items() if value is not None]
    if variant not in (VARIANT.default, "all"):
        given.insert(0, f"variant={variant}")
    if given:
        raise errors.InputError(
            "--lr_sweep trains the inception and bn_baseline recipes as they are, each at its "
            "learning rate × each multiplier: drop --variant (or pass --variant=all), "
            "--learning_rate, --dropout, --weight_decay and --lr_decay_steps. "
            f"Received: {', '.join(given)}"
        )
    if distribution_flags.engine() != "tensorflow":
        raise errors.InputError(
            "--lr_sweep trains inception and bn_baseline, whose local response normalisation "
            "(tf.nn.local_response_normalization) builds on TensorFlow only: run the sweep "
            f"under KERAS_BACKEND=tensorflow. Received: engine={distribution_flags.engine()}"
        )


@dataclasses.dataclass(frozen=True)
class Config(strategy_lib.DistributionConfig):
    """Everything one invocation runs with: every flag's value, the recipe resolved.

    Made once in `main` from the flags and logged whole (TensorBoard text
    "config", and `summary.json`), so no flag can go unrecorded.
    """

    variant: str
    recipe: inception_recipes.Recipe | None  # None for variant "all": each has its own.
    model_dir: str
    data_dir: str | None
    dataset: str
    with_inception_x5: bool
    seed: int
    num_seeds: int
    lr_sweep: tuple | None
    train_steps: int
    batch_size: int
    eval_every: int
    eval_steps: int | None
    image_size: int
    width_multiplier: float
    use_fake_data: bool
    steps_per_execution: int
    mixed_precision: bool
    jit_compile: bool
    target_accuracy: float
    bn_momentum_warmup: bool
    allow_config_change: bool
    deterministic: bool
    eval_bn_statistics: str
    precise_bn_batches: int

    def loop(self):
        """The `skeleton.LoopConfig` of the run."""
        return skeleton.LoopConfig(
            name=self.variant,
            run_dir=self.model_dir,
            seed=self.seed,
            train_steps=self.train_steps,
            eval_every=self.eval_every,
            batch_size=self.batch_size,
            steps_per_execution=self.steps_per_execution,
            max_to_keep=3,
            sync_group_size=self.sync_group_size,
            allow_config_change=self.allow_config_change,
            deterministic=self.deterministic,
            eval_bn_statistics=self.eval_bn_statistics,
            precise_bn_batches=self.precise_bn_batches,
        )

    def create_runner(self):
        """The engine's runner of these settings (`jit_compile` off on TPUs: XLA anyway)."""
        jit_compile = self.jit_compile and self.distribution_strategy != "tpu"
        return super().create_runner(jit_compile)


def config_from_flags():
    """The `Config` of the parsed flags (called by `main` only).

    Raises:
        errors.InputError: for a refused --num_seeds or --lr_sweep
            combination (`check_seeds_and_sweep`).
    """
    holders = [
        run_flags.MODEL_DIR,
        run_flags.DATA_DIR,
        run_flags.SEED,
        run_flags.NUM_SEEDS,
        training_flags.LR_SWEEP,
        training_flags.TRAIN_STEPS,
        training_flags.BATCH_SIZE,
        training_flags.EVAL_EVERY,
        VARIANT,
        DATASET,
        WITH_INCEPTION_X5,
        IMAGE_SIZE,
        WIDTH_MULTIPLIER,
        USE_FAKE_DATA,
        STEPS_PER_EXECUTION,
        MIXED_PRECISION,
        JIT_COMPILE,
        EVAL_STEPS,
        TARGET_ACCURACY,
        run_flags.ALLOW_CONFIG_CHANGE,
        run_flags.DETERMINISTIC,
        training_flags.EVAL_BN_STATISTICS,
        training_flags.PRECISE_BN_BATCHES,
        *batch_norm_flags.HOLDERS,
        *distribution_flags.HOLDERS,
    ]
    values = training_flags.with_defaults(summaries.flag_values(holders), TRAINING_DEFAULTS)
    values["lr_sweep"] = training_flags.lr_multipliers()
    # --learning_rate, --dropout, --weight_decay and --lr_decay_steps override
    # the recipe, where they are recorded.
    overrides = summaries.flag_values(
        [training_flags.LEARNING_RATE, DROPOUT, WEIGHT_DECAY, DECAY_STEPS]
    )
    check_seeds_and_sweep(values["variant"], values["num_seeds"], values["lr_sweep"], overrides)
    recipe = None  # --variant=all and --lr_sweep train several recipes.
    if values["variant"] != "all" and not values["lr_sweep"]:
        recipe = inception_recipes.resolve(
            values["variant"],
            learning_rate=overrides["learning_rate"],
            dropout=overrides["dropout"],
            weight_decay=overrides["weight_decay"],
            decay_steps=overrides["lr_decay_steps"],
        )
    return Config(recipe=recipe, **values)


def main(argv):
    console.quiet_libraries()
    with errors.one_line_errors("inception_bn"):
        if len(argv) > 1:
            raise errors.InputError(f"Unexpected arguments: {argv[1:]}")
        config = config_from_flags()
        model_dirs.check_model_dir(config.model_dir, TRAINER)
        spec = image_data.dataset_spec(config.dataset, config.data_dir)
        # The strategy comes first: datasets and variables are created under it,
        # and a multi-worker strategy must start before TensorFlow's runtime,
        # which the data checks (reading the shards) start.
        runner = config.create_runner()
        if not config.use_fake_data:
            image_data.check_prepared(spec, config.data_dir, config.batch_size)
            data_checks.reads_data_files(image_data.shard_paths(spec, config.data_dir))
        skeleton.check_replicas(config.loop(), runner.num_replicas)
        if runner.is_chief:
            model_dirs.claim_model_dir(config.model_dir, TRAINER)
    if config.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    train = lambda one: train_variant(one, spec, runner)
    # A lost worker, too, ends the run in one line.
    with (
        errors.one_line_errors("inception_bn"),
        config.reporting_lost_workers(config.model_dir),
    ):
        if config.lr_sweep:
            run_lr_sweep(config, train, spec.num_classes, writes=runner.is_chief)
        elif config.variant == "all":
            inception_table2.run(
                config, train, inception_task.config_values, writes=runner.is_chief
            )
            if runner.is_chief:
                show_paths(config, "table2.md")
        else:
            history = train(config)
            if runner.is_chief:
                show_result(config, history)


def show_result(config, history):
    """The end of a one-variant run on the console: top-1, steps to the target, the paths."""
    evals = history["evals"]
    target = f"first step at top-1 {config.target_accuracy:.1%}"
    row = (
        config.variant,
        evals[-1]["top1"] if evals else None,
        max((e["top1"] for e in evals), default=None),
        inception_task.steps_to_target(evals, config.target_accuracy),
    )
    console.show([""] + console.table(["variant", "final top-1", "best top-1", target], [row]))
    show_paths(config)


def show_paths(config, *names):
    """Where the run's results are: summary.json, `names` at the model_dir, TensorBoard."""
    lines = [f"summary:     {os.path.join(config.model_dir, 'summary.json')}"]
    lines += [f"{name + ':':<12} {os.path.join(config.model_dir, name)}" for name in names]
    lines.append(f"TensorBoard: tensorboard --logdir {config.model_dir}")
    console.show([""] + lines)


def train_variant(config, spec, runner):
    """Trains one variant's `config` on `spec`'s data; returns its history."""
    keras.backend.clear_session()  # Variants of --variant=all share nothing but the runner.
    history = skeleton.train_and_evaluate(
        inception_task.InceptionRun(config, spec), config.loop(), runner
    )
    if runner.is_chief:  # Only the chief writes the run's results.
        inception_task.write_summary(config, history)
    return history


# --lr_sweep compares these two recipes, the same but for BN.
SWEEP_VARIANTS = ("inception", "bn_baseline")


def sweep_config(config, variant, multiplier):
    """One run of --lr_sweep: the variant's config of --variant=all, its rate × `multiplier`."""
    one = inception_table2.variant_config(config, variant)
    recipe = dataclasses.replace(one.recipe, learning_rate=one.recipe.learning_rate * multiplier)
    model_dir = lr_sweep.run_dir(config.model_dir, variant, multiplier)
    return dataclasses.replace(one, recipe=recipe, model_dir=model_dir)


def run_lr_sweep(config, train_variant, num_classes, writes=True):
    """--lr_sweep: inception and bn_baseline at each multiple of their rate (`lr_sweep`).

    Each recipe's decay interval is scaled to --train_steps as in --variant=all.
    """
    sweep = lr_sweep.Sweep(
        model_dir=config.model_dir,
        networks=SWEEP_VARIANTS,
        multipliers=config.lr_sweep,
        base_learning_rates={v: inception_recipes.RECIPES[v].learning_rate for v in SWEEP_VARIANTS},
        num_classes=num_classes,
        accuracy_key="top1",
        config=inception_task.config_values(config),
    )
    writer = summaries.root_writer(config.model_dir) if writes else None
    return lr_sweep.run(sweep, lambda v, m: train_variant(sweep_config(config, v, m)), writer)


if __name__ == "__main__":
    training_flags.set_defaults(**TRAINING_DEFAULTS)  # Shown by --help; not at import.
    app.run(main)
