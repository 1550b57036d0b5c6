"""The Inception trainer's --lr_sweep: inception and bn_baseline at multiples of their rates.

`check_seeds_and_sweep` refuses the --num_seeds and --lr_sweep combinations
the trainer cannot honour; `run` trains the sweep through
`trainers.reporting.lr_sweep`.
"""

import dataclasses

from trainers.inception import recipes as inception_recipes
from trainers.inception import table2 as inception_table2
from trainers.reporting import lr_sweep
from trainers.reporting import tensorboard_writers
from trainers.run import errors
from trainers.run import run_config


def check_seeds_and_sweep(variant, num_seeds, lr_sweep, overrides, default_variant, engine):
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
        default_variant: --variant's default, which a sweep accepts.
        engine: the Keras backend the run trains on.
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
    if variant not in (default_variant, "all"):
        given.insert(0, f"variant={variant}")
    if given:
        raise errors.InputError(
            "--lr_sweep trains the inception and bn_baseline recipes as they are, each at its "
            "learning rate × each multiplier: drop --variant (or pass --variant=all), "
            "--learning_rate, --dropout, --weight_decay and --lr_decay_steps. "
            f"Received: {', '.join(given)}"
        )
    if engine != "tensorflow":
        raise errors.InputError(
            "--lr_sweep trains inception and bn_baseline, whose local response normalisation "
            "(tf.nn.local_response_normalization) builds on TensorFlow only: run the sweep "
            f"under KERAS_BACKEND=tensorflow. Received: engine={engine}"
        )


# --lr_sweep compares these two recipes, the same but for BN.
SWEEP_VARIANTS = ("inception", "bn_baseline")


def sweep_config(config, variant, multiplier):
    """One run of --lr_sweep: the variant's config of --variant=all, its rate × `multiplier`."""
    one = inception_table2.variant_config(config, variant)
    recipe = dataclasses.replace(one.recipe, learning_rate=one.recipe.learning_rate * multiplier)
    model_dir = lr_sweep.run_dir(config.model_dir, variant, multiplier)
    return dataclasses.replace(one, recipe=recipe, model_dir=model_dir)


def run(config, train_variant, num_classes, writes=True):
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
        config=run_config.flat_values(config),
    )
    writer = tensorboard_writers.root_writer(config.model_dir) if writes else None
    return lr_sweep.run(sweep, lambda v, m: train_variant(sweep_config(config, v, m)), writer)
