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

# Run as a program, a SIGTERM or Ctrl-C during the imports below (seconds) asks the run to stop
# once it has started, as at any later point (trainers/run/preemption.py).
if __name__ == "__main__":
    from trainers.run import preemption

    preemption.defer_from_start()

import dataclasses

from absl import app
from absl import flags
import keras

from flags import batch_norm_flags as batch_norm_flags
from flags import distribution_flags as distribution_flags
from flags import inception_flags as inception_flags
from flags import run_flags as run_flags
from flags import training_flags as training_flags
from trainers.engines import strategy as strategy_lib
from trainers.inception import data as image_data
from trainers.inception import recipes as inception_recipes
from trainers.inception import sweep as inception_sweep
from trainers.inception import table2 as inception_table2
from trainers.inception import task as inception_task
from trainers.reporting import console
from trainers.run import data_checks
from trainers.run import program
from trainers.run import run_config
from trainers.run import skeleton

# --help lists this trainer's own flags first.
flags.adopt_module_key_flags(inception_flags)

TRAINER = "trainers.inception_bn"  # Recorded in --model_dir (see trainers/run/model_dirs.py).


@dataclasses.dataclass(frozen=True)
class Config(strategy_lib.DistributionConfig):
    """Everything one invocation runs with: every flag's value, the recipe resolved.

    Made once in `main` from the flags and logged whole (TensorBoard text
    "config", and `summary.json`), so no flag can go unrecorded. The fields
    declared `run_config.identity_field()` are the run's identity: what a
    resumed run must share with its checkpoint.
    """

    variant: str = run_config.identity_field()
    # None for variant "all": each variant has its own.
    recipe: inception_recipes.Recipe | None = run_config.identity_field()
    model_dir: str
    data_dir: str | None
    dataset: str = run_config.identity_field()
    with_inception_x5: bool
    seed: int = run_config.identity_field()
    num_seeds: int
    lr_sweep: tuple | None
    train_steps: int
    batch_size: int = run_config.identity_field(changeable=True)
    eval_every: int
    eval_steps: int | None
    image_size: int = run_config.identity_field()
    width_multiplier: float = run_config.identity_field()
    use_fake_data: bool = run_config.identity_field()
    steps_per_execution: int
    mixed_precision: bool = run_config.identity_field()
    jit_compile: bool
    target_accuracy: float
    bn_momentum_warmup: bool = run_config.identity_field()
    allow_config_change: bool
    deterministic: bool
    eval_bn_statistics: str
    precise_bn_batches: int
    on_divergence: str

    def loop(self):
        """The `skeleton.LoopConfig` of the run."""
        return skeleton.LoopConfig.of(
            self, name=self.variant, run_dir=self.model_dir, max_to_keep=3
        )

    def create_runner(self):
        """The engine's runner of these settings (`jit_compile` off on TPUs: XLA anyway)."""
        jit_compile = self.jit_compile and self.distribution_strategy != "tpu"
        return super().create_runner(jit_compile)


def config_from_flags():
    """The `Config` of the parsed flags (called by `main` only).

    Raises:
        flags.ValidationError: for a refused --num_seeds or --lr_sweep
            combination (`check_seeds_and_sweep`); `program.run` ends it in
            one line.
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
        inception_flags.VARIANT,
        inception_flags.DATASET,
        inception_flags.WITH_INCEPTION_X5,
        inception_flags.IMAGE_SIZE,
        inception_flags.WIDTH_MULTIPLIER,
        inception_flags.USE_FAKE_DATA,
        inception_flags.STEPS_PER_EXECUTION,
        inception_flags.MIXED_PRECISION,
        inception_flags.JIT_COMPILE,
        inception_flags.EVAL_STEPS,
        inception_flags.TARGET_ACCURACY,
        run_flags.ALLOW_CONFIG_CHANGE,
        run_flags.DETERMINISTIC,
        training_flags.EVAL_BN_STATISTICS,
        training_flags.PRECISE_BN_BATCHES,
        training_flags.ON_DIVERGENCE,
        *batch_norm_flags.HOLDERS,
        *distribution_flags.HOLDERS,
    ]
    values = training_flags.values_with_defaults(holders, inception_flags.TRAINING_DEFAULTS)
    values["lr_sweep"] = training_flags.lr_multipliers()
    # --learning_rate, --dropout, --weight_decay and --lr_decay_steps override
    # the recipe, where they are recorded.
    overrides = {
        holder.name: holder.value
        for holder in (
            training_flags.LEARNING_RATE,
            inception_flags.DROPOUT,
            inception_flags.WEIGHT_DECAY,
            inception_flags.DECAY_STEPS,
        )
    }
    check_seeds_and_sweep(
        values["variant"],
        values["num_seeds"],
        values["lr_sweep"],
        overrides,
        inception_flags.VARIANT.default,
        distribution_flags.engine(),
    )
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


def check_seeds_and_sweep(variant, num_seeds, lr_sweep, overrides, default_variant, engine):
    """Raises `flags.ValidationError` for the --num_seeds and --lr_sweep combinations refused.

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
        default_variant: --variant's default, which a sweep accepts.
        engine: the Keras backend the run trains on.
    """
    if num_seeds > 1 and variant != "all":
        raise flags.ValidationError(
            "--num_seeds > 1 repeats Table 2 in miniature (--variant=all) over seeds; train one "
            "variant's seeds each with its own --seed and --model_dir. "
            f"Received: num_seeds={num_seeds}, variant={variant}"
        )
    if not lr_sweep:
        return
    given = [f"{name}={value}" for name, value in overrides.items() if value is not None]
    if variant not in (default_variant, "all"):
        given.insert(0, f"variant={variant}")
    if given:
        raise flags.ValidationError(
            "--lr_sweep trains the inception and bn_baseline recipes as they are, each at its "
            "learning rate × each multiplier: drop --variant (or pass --variant=all), "
            "--learning_rate, --dropout, --weight_decay and --lr_decay_steps. "
            f"Received: {', '.join(given)}"
        )
    if engine != "tensorflow":
        raise flags.ValidationError(
            "--lr_sweep trains inception and bn_baseline, whose local response normalisation "
            "(tf.nn.local_response_normalization) builds on TensorFlow only: run the sweep "
            f"under KERAS_BACKEND=tensorflow. Received: engine={engine}"
        )


def main(argv):
    program.run("inception_bn", TRAINER, argv, config_from_flags, train_runs)


def train_runs(config):
    """Trains what `config` asks for; returns the histories to check for divergence, or None."""
    spec = image_data.dataset_spec(config.dataset, config.data_dir)
    # The strategy comes first: datasets and variables are created under it,
    # and a multi-worker strategy must start before TensorFlow's runtime,
    # which the data checks (reading the shards) start.
    runner = config.create_runner()
    if not config.use_fake_data:
        image_data.check_prepared(spec, config.data_dir, config.batch_size)
        data_checks.reads_data_files(image_data.shard_paths(spec, config.data_dir))
    program.claim(config, TRAINER, config.loop(), runner)
    if config.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    train = lambda one: train_variant(one, spec, runner)
    if config.lr_sweep:
        inception_sweep.run(config, train, spec.num_classes, writes=runner.is_chief)
        return None
    if config.variant == "all":
        inception_table2.run(config, train, writes=runner.is_chief)
        if runner.is_chief:
            files = {"summary": "summary.json", "table 2": "table2.md"}
            console.show([""] + console.result_paths(config.model_dir, files))
        return None
    history = train(config)
    if runner.is_chief:
        show_result(config, history)
    return {config.variant: history}


def show_result(config, history):
    """The end of a one-variant run on the console: top-1, steps to the target, the paths."""
    evals = history["evals"]
    target = f"first step at top-1 {config.target_accuracy:.1%}"
    headers = ["variant", "final top-1", "best top-1", target]
    row = [
        config.variant,
        evals[-1]["top1"] if evals else None,
        max((e["top1"] for e in evals), default=None),
        inception_task.steps_to_target(evals, config.target_accuracy),
    ]
    if history.get("diverged"):
        diverged = history["diverged"]
        headers.append("diverged")
        row.append(f"at step {diverged['step']}: {diverged['reason']}")
    console.show([""] + console.table(headers, [row]))
    console.show([""] + console.result_paths(config.model_dir, {"summary": "summary.json"}))


def train_variant(config, spec, runner):
    """Trains one variant's `config` on `spec`'s data; returns its history."""
    keras.backend.clear_session()  # Variants of --variant=all share nothing but the runner.
    history = skeleton.train_and_evaluate(
        inception_task.InceptionRun(config, spec), config.loop(), runner
    )
    if runner.is_chief:  # Only the chief writes the run's results.
        inception_task.write_summary(config, history)
    return history


if __name__ == "__main__":
    training_flags.set_defaults(
        **inception_flags.TRAINING_DEFAULTS
    )  # Shown by --help; not at import.
    app.run(main)
