"""Table 2 and Figure 2 of the paper in miniature: every variant in turn, one summary.

`python -m trainers.inception_bn --variant=all …` trains the five Table 2
variants (optionally also Inception at ×5, `--with_inception_x5`) one after
the other with the same seed, data order and steps, each with its recipe
and the decay interval scaled to the run's length
(`inception_recipes.scaled_to`), each in `<model_dir>/<variant>`; with
`--num_seeds` N > 1, every variant for seed `--seed`, then every variant
for the next seed, …, each in `<model_dir>/<variant>/seed_<s>`. After each
run it rewrites, at the model_dir root:
- `summary.json`: per variant the best top-1, the step of it, and the
  steps to reach the Inception variant's best top-1 (the paper's
  "steps to 72.2%"), next to the paper's numbers; with several seeds the
  same per seed (`per_seed`, each seed's reference its own Inception run's
  best top-1), and per variant the mean, std (population, ddof 0), min and
  max over seeds of the best top-1 and of the steps to the reference, with
  the number of seeds that never reached it;
- `table2.md`: the same as a Markdown table (mean ± std over seeds);
and at the end `figure2.png`, top-1 against steps for all variants (the
paper's Figure 2; with several seeds each variant's mean over seeds with a
min–max band), also logged as a TensorBoard image. A custom-scalars chart
at the root draws every run's eval/top1 on one chart.
"""

import dataclasses
import os

import numpy as np
import tensorflow as tf

from flags import run_flags as run_flags
from trainers.inception import recipes as inception_recipes
from trainers.reporting import figures
from trainers.reporting import tensorboard_writers
from trainers.run import json_files

REFERENCE = "inception"  # Table 2's "steps to" threshold is this variant's best top-1.
# The root's custom-scalars charts: each variant's run is one line.
CHARTS = {
    "test top-1, all variants (paper Figure 2)": [r"^eval/top1$"],
    "train loss, all variants": [r"^train/loss$"],
    "learning rate, all variants": [r"^train/learning_rate$"],
}


def variants(with_inception_x5):
    extra = ("inception_x5",) if with_inception_x5 else ()
    return inception_recipes.TABLE2_VARIANTS + extra


def variant_config(config, variant, seed=None):
    """The one-variant config of an `all` config: its recipe scaled, its own directory.

    `seed` (default: the config's) picks the run; with several seeds it is in
    `<model_dir>/<variant>/seed_<seed>`.
    """
    seed = config.seed if seed is None else seed
    recipe = inception_recipes.scaled_to(inception_recipes.RECIPES[variant], config.train_steps)
    model_dir = run_flags.seed_dir(os.path.join(config.model_dir, variant), seed, config.num_seeds)
    return dataclasses.replace(
        config, variant=variant, recipe=recipe, model_dir=model_dir, seed=seed
    )


def first_step_reaching(evals, accuracy):
    """The first evaluated step whose top-1 reached `accuracy`, else None."""
    return next((e["step"] for e in evals if e["top1"] >= accuracy), None)


def table2(evals_by_variant):
    """Table 2 of the runs so far: `{"reference_top1": …, "rows": {variant: row}}`.

    Args:
        evals_by_variant: variant → its evaluation records (`step`, `top1`).

    Each row holds the variant's best top-1 (`max_top1`) and its step, and
    the first step at which it reached the Inception variant's best top-1
    (`steps_to_reference`; None if it never did, or Inception has not run).
    """
    best = {
        v: max(evals, key=lambda e: e["top1"]) for v, evals in evals_by_variant.items() if evals
    }
    reference = best[REFERENCE]["top1"] if REFERENCE in best else None
    rows = {}
    for variant, evals in evals_by_variant.items():
        rows[variant] = {
            "max_top1": best[variant]["top1"] if evals else None,
            "max_step": best[variant]["step"] if evals else None,
            "steps": evals[-1]["step"] if evals else 0,
            "steps_to_reference": (
                None if reference is None else first_step_reaching(evals, reference)
            ),
            "paper": inception_recipes.PAPER_RESULTS[variant],
        }
    return {"reference_variant": REFERENCE, "reference_top1": reference, "rows": rows}


def _percent(value):
    return "—" if value is None else f"{100 * value:.1f}%"


def _count(value):
    return "—" if value is None else f"{value:g}"


def _paper_cells(paper):
    """The tables' last two cells: the paper's steps to 72.2% (in millions) and max top-1."""
    steps = paper["steps_to_72.2%"]
    steps = "—" if steps is None else f"{steps / 1e6:g}·10⁶"
    return f"| {steps} | {_percent(paper['max_accuracy'])} |"


def markdown(table):
    """The Table 2 dict as Markdown, measured next to the paper's columns."""
    reference = _percent(table["reference_top1"])
    lines = [
        f"| variant | steps to {reference} | max top-1 | paper: steps to 72.2% | paper: max |",
        "|---|---|---|---|---|",
    ]
    for variant, row in table["rows"].items():
        lines.append(
            f"| {variant} | {_count(row['steps_to_reference'])} | {_percent(row['max_top1'])} "
            + _paper_cells(row["paper"])
        )
    return "\n".join(lines) + "\n"


def spread(values):
    """Mean, std (population, ddof 0), min and max of the non-None `values`, and their count.

    The statistics are None when no value is given.
    """
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "count": 0}
    return {
        "mean": float(np.mean(values)),
        "std": float(np.std(values)),
        "min": min(values),
        "max": max(values),
        "count": len(values),
    }


def over_seeds(tables):
    """Table 2 over seeds: per variant the spread of its best top-1 and steps to the reference.

    Args:
        tables: seed → `table2(...)` of that seed's runs so far (each seed's
            reference is its own Inception run's best top-1).

    Returns:
        dict with "seeds" (those given), "reference_variant", "reference_top1"
        (the spread of the seeds' references), "per_seed" (the tables) and
        "rows": variant → {"seeds": the seeds that trained it, "max_top1" and
        "steps_to_reference": their `spread` over those seeds (the steps over
        the seeds that reached the reference), "never_reached": how many of
        those seeds with a reference never reached it, "paper"}.
    """
    rows = {}
    for table in tables.values():
        for variant, row in table["rows"].items():
            if row["max_top1"] is not None:
                rows.setdefault(variant, []).append((row, table["reference_top1"] is not None))
    return {
        "seeds": list(tables),
        "reference_variant": REFERENCE,
        "reference_top1": spread([t["reference_top1"] for t in tables.values()]),
        "per_seed": tables,
        "rows": {
            variant: {
                "seeds": len(seed_rows),
                "max_top1": spread([row["max_top1"] for row, _ in seed_rows]),
                "steps_to_reference": spread([row["steps_to_reference"] for row, _ in seed_rows]),
                "never_reached": sum(
                    has_reference and row["steps_to_reference"] is None
                    for row, has_reference in seed_rows
                ),
                "paper": inception_recipes.PAPER_RESULTS[variant],
            }
            for variant, seed_rows in rows.items()
        },
    }


def _spread_text(stats, value):
    """A `spread` as mean ± std (min–max), each number formatted by `value`."""
    if not stats["count"]:
        return "—"
    text = f"{value(stats['mean'])} ± {value(stats['std'])}"
    if stats["count"] > 1:
        text += f" ({value(stats['min'])}–{value(stats['max'])})"
    return text


def markdown_over_seeds(summary):
    """`over_seeds`' dict as Markdown: mean ± std (min–max) over seeds, the paper beside."""
    percent = lambda v: f"{100 * v:.1f}%"
    steps = lambda v: f"{v:.0f}"
    lines = [
        f"Over seeds {', '.join(map(str, summary['seeds']))}: mean ± std (population) "
        "(min–max). Each seed's reference is its inception run's best top-1: "
        f"{_spread_text(summary['reference_top1'], percent)}.",
        "",
        "| variant | seeds | steps to the reference | never reached | max top-1 "
        "| paper: steps to 72.2% | paper: max |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, row in summary["rows"].items():
        lines.append(
            f"| {variant} | {row['seeds']} | {_spread_text(row['steps_to_reference'], steps)} "
            f"| {row['never_reached']} | {_spread_text(row['max_top1'], percent)} "
            + _paper_cells(row["paper"])
        )
    return "\n".join(lines) + "\n"


def _mean_and_band(evals_per_seed):
    """The steps every seed evaluated, and top-1's mean, min and max over seeds there."""
    top1 = [{e["step"]: e["top1"] for e in evals} for evals in evals_per_seed]
    steps = sorted(set.intersection(*(set(by_step) for by_step in top1)))
    values = np.array([[by_step[s] for s in steps] for by_step in top1]).reshape(len(top1), -1)
    return steps, values.mean(0), values.min(0), values.max(0)


def plot_figure(runs, references, path):
    """Figure 2: top-1 against steps per variant, the reference dashed; returns the PNG.

    Args:
        runs: variant → its evaluation records per seed (a list, one per seed).
        references: the seeds' reference top-1s; their mean is drawn dashed.
        path: where the PNG goes.

    With several seeds each line is the mean over seeds, with a min–max band.
    """
    plt = figures.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seeds = max((len(per_seed) for per_seed in runs.values()), default=1)
    for variant, per_seed in runs.items():
        steps, mean, low, high = _mean_and_band(per_seed)
        line = ax.plot(steps, mean, label=variant)[0]
        if len(per_seed) > 1:
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    if references:
        ax.axhline(np.mean(references), color="gray", linestyle="--", linewidth=0.8)
    ax.set(xlabel="training step", ylabel="test top-1", ylim=(0.0, 1.0))
    title = "Test accuracy against steps (paper Figure 2, in miniature)"
    if seeds > 1:  # A second line: one line is cut off at the figure's width.
        title += f"\nmean over {seeds} seeds, min–max band"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")  # Early steps: the lines are still low there.
    fig.tight_layout()
    return figures.save_figure(fig, path)


def results(evals_by_seed):
    """The summary of the runs so far: `table2` with one seed, `over_seeds` with several.

    Args:
        evals_by_seed: seed → variant → its evaluation records.
    """
    tables = {seed: table2(evals) for seed, evals in evals_by_seed.items()}
    return next(iter(tables.values())) if len(tables) == 1 else over_seeds(tables)


def write_results(model_dir, evals_by_seed, extra):
    """Rewrites summary.json and table2.md at `model_dir` from the runs so far."""
    table = results(evals_by_seed)
    text = markdown(table) if len(evals_by_seed) == 1 else markdown_over_seeds(table)
    json_files.write_json(os.path.join(model_dir, "summary.json"), {**table, **extra})
    json_files.write_text(os.path.join(model_dir, "table2.md"), text)
    return table


def write_figure(model_dir, evals_by_seed, step):
    """figure2.png at `model_dir` and as the root's TensorBoard image `figure2` ("figures")."""
    runs = {}
    for evals in evals_by_seed.values():
        for variant, records in evals.items():
            runs.setdefault(variant, []).append(records)
    references = [t["reference_top1"] for t in map(table2, evals_by_seed.values())]
    references = [r for r in references if r is not None]
    png = plot_figure(runs, references, os.path.join(model_dir, "figure2.png"))
    with tensorboard_writers.root_events(model_dir, "figures") as writer:
        figures.write_image(
            writer,
            "figure2",
            png,
            step,
            "Paper Figure 2 in miniature: test top-1 against steps, every variant "
            "(with several seeds: the mean and min–max band over seeds).",
        )


def run(config, train_variant, writes=True):
    """Trains every variant of an `all` config for each seed with `train_variant(variant_config)`.

    All variants of seed `config.seed`, then those of the next seed, … (see
    the module docstring), the results rewritten after each run.

    Args:
        config: the invocation's config (`variant == "all"`).
        train_variant: trains one variant's config and returns its history.
        writes: whether this process writes the results (the chief only).

    Returns:
        The summary of all runs: the Table 2 dict with one seed, `over_seeds`'
        with several.
    """
    tf.io.gfile.makedirs(config.model_dir)
    if writes:
        with tensorboard_writers.root_events(config.model_dir, "dashboards") as writer:
            tensorboard_writers.write_custom_scalars(writer, "Table 2", CHARTS)
    names = variants(config.with_inception_x5)
    seeds = run_flags.seeds(config.seed, config.num_seeds)
    evals_by_seed = {seed: {} for seed in seeds}
    extra = {"config": config.flat_values(), "variants": {}}
    for seed in seeds:
        for variant in names:
            one = variant_config(config, variant, seed)
            history = train_variant(one)
            evals_by_seed[seed][variant] = history["evals"]
            entry = extra["variants"].setdefault(
                variant, {"wall_time_s": 0.0, "decay_steps": one.recipe.decay_steps}
            )
            # Summed over the seeds: the variant's share of the invocation's time.
            entry["wall_time_s"] = round(entry["wall_time_s"] + history["wall_time_s"], 1)
            if writes:
                write_results(config.model_dir, evals_by_seed, extra)
    if writes:
        write_figure(config.model_dir, evals_by_seed, config.train_steps)
    return results(evals_by_seed)
