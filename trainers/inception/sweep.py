"""The Inception trainer's --lr_sweep: inception and bn_baseline at multiples of their rates.

`run` trains the sweep through `trainers.reporting.lr_sweep`; the trainer
refuses the --lr_sweep combinations it cannot honour
(`trainers.inception_bn.check_seeds_and_sweep`).
"""

import dataclasses

from trainers.inception import recipes as inception_recipes
from trainers.inception import table2 as inception_table2
from trainers.reporting import lr_sweep

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
        config=config.flat_values(),
    )
    return lr_sweep.run(sweep, lambda v, m: train_variant(sweep_config(config, v, m)), writes)
