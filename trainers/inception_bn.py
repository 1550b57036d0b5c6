r"""BN-Inception on ImageNet: the paper's §4.2 runs, distributed, with TensorBoard.

Variants (--variant): inception, bn_baseline, bn_x5, bn_x30, bn_x5_sigmoid;
each sets the paper's recipe (trainers/inception_recipes.py) and individual
flags override it. SGD with momentum 0.9 and exponential learning-rate decay;
--batch_size is the GLOBAL batch per step (the paper's 32), split evenly over
the replicas of --distribution_strategy. Evaluates single-crop top-1/top-5
every --eval_every steps, logs loss, learning rate, top-1, top-5, images/sec,
the whole configuration, and the step at which top-1 first reaches --target_accuracy
(the paper's Table 2 metric) to TensorBoard under --model_dir, and
checkpoints; a restarted run continues at its checkpointed step.

Smoke run here (fake data, small images, a few steps):

    python -m trainers.inception_bn --use_fake_data --image_size=64 \
        --train_steps=20 --eval_every=10 --eval_steps=2 --batch_size=8 \
        --model_dir=runs/inception_smoke

Expected result of the smoke run: a finite loss starting near ln(1000) ≈ 6.9
that falls as the model memorises the 4 repeated fake batches (6.56 at step
10, 3.41 at step 20 here), event files and checkpoints in --model_dir.

Real run (ImageNet prepared by TFDS under DIR; 8 GPUs; see README):

    python -m trainers.inception_bn --variant=bn_x5 --data_dir=DIR \
        --distribution_strategy=mirrored --batch_size=256 --sync_batch_norm \
        --model_dir=gs://bucket/bn_x5

Expected result of the real runs, from the paper (not reproduced here: no
ImageNet or accelerator on this machine): BN-x5 reaches 72.2% top-1 in 14×
fewer steps than Inception and peaks at 73.0%; BN-x30 peaks at 74.8% (Table 2).
"""

import dataclasses
import os
from typing import Optional

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
import tensorflow as tf

import keras_bn
from keras_bn import distribution
from flags import distribution_flags as distribution_flags
from flags import run_flags as run_flags
from flags import training_flags as training_flags
from trainers import imagenet_data
from trainers import inception_model
from trainers import inception_recipes
from trainers import loops
from trainers import strategy as strategy_lib
from trainers import summaries

VARIANT = flags.DEFINE_enum(
    "variant", "bn_x5", list(inception_recipes.RECIPES), "The paper's model variant (recipe bundle)."
)
IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Input height and width.", lower_bound=32)
USE_FAKE_DATA = flags.DEFINE_bool("use_fake_data", False, "Random data of the real shapes instead of ImageNet.")
DROPOUT = flags.DEFINE_float("dropout", None, "Override the recipe's dropout rate.", lower_bound=0.0, upper_bound=0.99)
WEIGHT_DECAY = flags.DEFINE_float("weight_decay", None, "Override the recipe's L2 coefficient.", lower_bound=0.0)
DECAY_STEPS = flags.DEFINE_integer("lr_decay_steps", None, "Override the recipe's steps per 0.94× decay.", lower_bound=1)
STEPS_PER_EXECUTION = flags.DEFINE_integer("steps_per_execution", 1, "Train steps per compiled call.", lower_bound=1)
MIXED_PRECISION = flags.DEFINE_bool("mixed_precision", False, "bfloat16 compute (mixed_bfloat16 policy).")
JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", False,
    "XLA-compile each replica's forward/backward (under --distribution_strategy=tpu "
    "XLA always compiles the whole step).",
)
EVAL_STEPS = flags.DEFINE_integer("eval_steps", None, "Evaluation batches (default: the whole split).", lower_bound=1)
TARGET_ACCURACY = flags.DEFINE_float(
    "target_accuracy", 0.722, "Top-1 whose first reaching step is recorded (paper: 72.2%).",
    lower_bound=0.0, upper_bound=1.0,
)

DEFAULTS = {"train_steps": 3_000_000, "batch_size": 32, "eval_every": 10_000}


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
        values["jit_compile"] and values["sync_batch_norm"]
        and values["distribution_strategy"] in ("mirrored", "multi_worker_mirrored")
    )


def build_model(recipe, *, image_size, sync_batch_norm, sync_group_size=None):
    return inception_model.build_inception(
        image_size=image_size, num_classes=imagenet_data.NUM_CLASSES,
        batch_norm=recipe.batch_norm, activation=recipe.activation, lrn=recipe.lrn,
        dropout=recipe.dropout, weight_decay=recipe.weight_decay, sync_batch_norm=sync_batch_norm,
        sync_group_size=sync_group_size,
    )


def make_evaluator(strategy, model):
    """Returns `evaluate(dataset, eval_steps) -> (top1, top5)`, traced once.

    Single-crop accuracy in inference mode over at most `eval_steps` batches
    (all of `dataset` when None).
    """

    @tf.function
    def replica_eval(x, y):
        logits = model(x, training=False)
        y = tf.cast(y, tf.int32)
        top1 = tf.reduce_sum(tf.cast(tf.math.in_top_k(y, logits, 1), tf.float32))
        top5 = tf.reduce_sum(tf.cast(tf.math.in_top_k(y, logits, 5), tf.float32))
        return tf.stack([top1, top5, tf.cast(tf.shape(y)[0], tf.float32)])

    def evaluate(dataset, eval_steps):
        totals = np.zeros(3)
        for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(dataset)):
            if eval_steps is not None and i == eval_steps:
                break
            totals += strategy.reduce("SUM", strategy.run(replica_eval, args=(x, y)), axis=None).numpy()
        return totals[0] / totals[2], totals[1] / totals[2]

    return evaluate


def steps_to_target(evals, target_accuracy):
    """The first evaluated step whose top-1 reached the target, else None."""
    return next((e["step"] for e in evals if e["top1"] >= target_accuracy), None)


@dataclasses.dataclass(frozen=True)
class Config(strategy_lib.DistributionConfig):
    """Everything one run uses: the variant's recipe (flags applied) and every flag.

    Made once in `main` from the flags and logged whole (TensorBoard text
    "config" and `summary.json`), so no flag can go unrecorded.
    """

    variant: str
    recipe: inception_recipes.Recipe
    model_dir: str
    data_dir: Optional[str]
    seed: int
    train_steps: int
    batch_size: int
    eval_every: int
    eval_steps: Optional[int]
    image_size: int
    use_fake_data: bool
    steps_per_execution: int
    mixed_precision: bool
    jit_compile: bool
    target_accuracy: float


def config_from_flags():
    """The `Config` of the parsed flags (called by `main` only)."""
    holders = [
        run_flags.MODEL_DIR, run_flags.DATA_DIR, run_flags.SEED, training_flags.TRAIN_STEPS,
        training_flags.BATCH_SIZE, training_flags.EVAL_EVERY, VARIANT, IMAGE_SIZE, USE_FAKE_DATA,
        STEPS_PER_EXECUTION, MIXED_PRECISION, JIT_COMPILE, EVAL_STEPS, TARGET_ACCURACY,
        *distribution_flags.HOLDERS,
    ]
    # --learning_rate, --dropout, --weight_decay and --lr_decay_steps override
    # the recipe, where they are recorded.
    recipe = inception_recipes.resolve(
        VARIANT.value, learning_rate=training_flags.LEARNING_RATE.value, dropout=DROPOUT.value,
        weight_decay=WEIGHT_DECAY.value, decay_steps=DECAY_STEPS.value,
    )
    values = summaries.with_defaults(summaries.flag_values(holders), DEFAULTS)
    return Config(recipe=recipe, **values)


def train_and_evaluate(config, strategy):
    """Trains and evaluates one variant under `strategy`; returns its history dict.

    The step at which top-1 first reaches `config.target_accuracy` is derived
    from the evaluation records, so a resumed run never keeps one from
    evaluations after its checkpoint.

    Raises:
        ValueError: if the global batch does not split evenly over the
            replicas, or the sync group size does not divide their number.
    """
    recipe, batch_size = config.recipe, config.batch_size
    replicas = strategy.num_replicas_in_sync
    if batch_size % replicas:
        raise ValueError(
            f"The global batch must split evenly over {replicas} replicas. Received: batch_size={batch_size}"
        )
    distribution_flags.check_sync_group_size(config.sync_group_size, replicas)
    logging.info("Global batch %d = %d replicas × %d per replica", batch_size, replicas, batch_size // replicas)
    keras.utils.set_random_seed(config.seed)
    with strategy.scope():
        model = build_model(
            recipe, image_size=config.image_size, sync_batch_norm=config.sync_batch_norm,
            sync_group_size=config.sync_group_size,
        )
        schedule = keras.optimizers.schedules.ExponentialDecay(
            recipe.learning_rate, recipe.decay_steps, inception_recipes.DECAY_RATE, staircase=True
        )
        optimizer = keras.optimizers.SGD(schedule, momentum=inception_recipes.MOMENTUM)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    run = loops.RunState(
        config.model_dir, step, config_values(config), max_to_keep=3,
        is_chief=distribution.is_chief(strategy), model=model, optimizer=optimizer,
    )
    with run:
        data_kwargs = dict(
            data_dir=config.data_dir, image_size=config.image_size, distortion=recipe.distortion,
            thorough_shuffle=recipe.thorough_shuffle, use_fake_data=config.use_fake_data,
        )
        # A resumed run reseeds its shuffle with the step, so it does not replay
        # the examples the interrupted run already saw in the same order.
        train_data = imagenet_data.make_dataset(
            split="train", batch_size=batch_size, seed=config.seed + run.start, **data_kwargs
        )
        eval_data = imagenet_data.make_dataset(
            split="validation", batch_size=batch_size, seed=config.seed, **data_kwargs
        )
        iterator = iter(strategy.experimental_distribute_dataset(train_data))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        multi_step = loops.make_multi_step(
            strategy, model, optimizer, loss_fn, batch_size,
            config.jit_compile and config.distribution_strategy != "tpu",
        )
        evaluator = make_evaluator(strategy, model)
        # BN health on a fixed evaluation batch, aggregated per stage: worst
        # and median train/inference gap, per-stage weight histograms.
        monitor = None
        if recipe.batch_norm:
            probe_images = next(iter(eval_data))[0]
            monitor = keras_bn.BatchNormMonitor(None, probe_images, group_by=inception_model.bn_stage)

        def evaluate(step, interval):
            top1, top5 = evaluator(eval_data, config.eval_steps)
            return {
                "step": step,
                "train_loss": interval["train_loss"],
                "top1": float(top1),
                "top5": float(top5),
                "learning_rate": float(schedule(step - 1)),
                "images_per_sec": batch_size * interval["steps"] / interval["seconds"],
            }

        def write_summaries(record, history):
            tf.summary.scalar("train/loss", record["train_loss"])
            tf.summary.scalar("train/learning_rate", record["learning_rate"])
            tf.summary.scalar("eval/top1", record["top1"])
            tf.summary.scalar("eval/top5", record["top5"])
            tf.summary.scalar("train/images_per_sec", record["images_per_sec"])
            reached = steps_to_target(history["evals"], config.target_accuracy)
            if reached is not None:
                tf.summary.scalar("eval/steps_to_target", reached)
            if monitor is not None:
                monitor.write_summaries(model, record["step"])

        return loops.train_and_log(
            run, train_steps=config.train_steps, eval_every=config.eval_every,
            steps_per_execution=config.steps_per_execution,
            run_steps=lambda n: multi_step(iterator, tf.constant(n)),
            evaluate=evaluate, write_summaries=write_summaries, name=config.variant,
        )


def config_values(config):
    """The config as a flat dict (recipe fields prefixed "recipe.") for logging."""
    values = dataclasses.asdict(config)
    recipe = values.pop("recipe")
    values.update({f"recipe.{k}": v for k, v in recipe.items()})
    return values


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = config_from_flags()
    # The strategy comes first: datasets and variables are created under it.
    strategy = config.create_strategy()
    if config.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    tf.io.gfile.makedirs(config.model_dir)
    history = train_and_evaluate(config, strategy)
    if not distribution.is_chief(strategy):
        return  # Only the chief writes the run's results.
    evals = history["evals"]
    summaries.write_json(os.path.join(config.model_dir, "summary.json"), {
        "variant": config.variant, "steps": history["steps"],
        "final": evals[-1] if evals else None,
        "best_top1": max((e["top1"] for e in evals), default=None),
        "steps_to_target": steps_to_target(evals, config.target_accuracy),
        "paper": inception_recipes.PAPER_RESULTS[config.variant], "config": config_values(config),
    })


if __name__ == "__main__":
    app.run(main)
