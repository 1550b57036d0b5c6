"""Table 2 and Figure 2 of the paper in miniature: every variant in turn, one summary.

`python -m trainers.inception_bn --variant=all …` trains the five Table 2
variants (optionally also Inception at ×5, `--with_inception_x5`) one after
the other with the same seed, data order and steps, each with its recipe
and the decay interval scaled to the run's length
(`inception_recipes.scaled_to`), each in `<model_dir>/<variant>`. After
each variant it rewrites, at the model_dir root:
- `summary.json`: per variant the best top-1, the step of it, and the
  steps to reach the Inception variant's best top-1 (the paper's
  "steps to 72.2%"), next to the paper's numbers;
- `table2.md`: the same as a Markdown table;
and at the end `figure2.png`, top-1 against steps for all variants (the
paper's Figure 2), also logged as a TensorBoard image. A custom-scalars
chart at the root draws every variant's eval/top1 on one chart.
"""

import dataclasses
import os

import tensorflow as tf

from trainers import inception_recipes
from trainers import summaries
from trainers import tb_report

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


def variant_config(config, variant):
    """The one-variant config of an `all` config: its recipe scaled, its own directory."""
    recipe = inception_recipes.scaled_to(inception_recipes.RECIPES[variant], config.train_steps)
    return dataclasses.replace(
        config, variant=variant, recipe=recipe, model_dir=os.path.join(config.model_dir, variant)
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


def _count(value, scale=1):
    return "—" if value is None else f"{value / scale:g}"


def markdown(table):
    """The Table 2 dict as Markdown, measured next to the paper's columns."""
    reference = _percent(table["reference_top1"])
    lines = [
        f"| variant | steps to {reference} | max top-1 | paper: steps to 72.2% | paper: max |",
        "|---|---|---|---|---|",
    ]
    for variant, row in table["rows"].items():
        paper = row["paper"]
        lines.append(
            f"| {variant} | {_count(row['steps_to_reference'])} | {_percent(row['max_top1'])} "
            f"| {_count(paper['steps_to_72.2%'], 1e6)}·10⁶ | {_percent(paper['max_accuracy'])} |"
        )
    return "\n".join(lines).replace("| —·10⁶ |", "| — |") + "\n"


def plot_figure(evals_by_variant, table, path):
    """Figure 2: top-1 against steps per variant, reference accuracy dashed; returns the PNG."""
    plt = tb_report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, evals in evals_by_variant.items():
        ax.plot([e["step"] for e in evals], [e["top1"] for e in evals], label=variant)
    if table["reference_top1"] is not None:
        ax.axhline(table["reference_top1"], color="gray", linestyle="--", linewidth=0.8)
    ax.set(xlabel="training step", ylabel="test top-1", ylim=(0.0, 1.0))
    ax.set_title("Test accuracy against steps (paper Figure 2, in miniature)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")  # Early steps: the lines are still low there.
    fig.tight_layout()
    return tb_report.save_figure(fig, path)


def write_results(model_dir, evals_by_variant, extra):
    """Rewrites summary.json and table2.md at `model_dir` from the runs so far."""
    table = table2(evals_by_variant)
    summaries.write_json(os.path.join(model_dir, "summary.json"), {**table, **extra})
    summaries.write_text(os.path.join(model_dir, "table2.md"), markdown(table))
    return table


def run(config, train_variant, config_values, writes=True):
    """Trains every variant of an `all` config in turn with `train_variant(variant_config)`.

    Args:
        config: the invocation's config (`variant == "all"`).
        train_variant: trains one variant's config and returns its history.
        config_values: config → flat dict, recorded in summary.json.
        writes: whether this process writes the results (the chief only).

    Returns:
        The Table 2 dict of all variants.
    """
    tf.io.gfile.makedirs(config.model_dir)
    writer = summaries.root_writer(config.model_dir) if writes else None
    if writes:
        tb_report.write_custom_scalars(writer, "Table 2", CHARTS)
    names = variants(config.with_inception_x5)
    evals_by_variant, extra = {}, {"config": config_values(config), "variants": {}}
    for variant in names:
        one = variant_config(config, variant)
        history = train_variant(one)
        evals_by_variant[variant] = history["evals"]
        extra["variants"][variant] = {
            "wall_time_s": round(history["wall_time_s"], 1),
            "decay_steps": one.recipe.decay_steps,
        }
        table = table2(evals_by_variant)
        if writes:
            write_results(config.model_dir, evals_by_variant, extra)
    if not writes:
        return table
    png = plot_figure(evals_by_variant, table, os.path.join(config.model_dir, "figure2.png"))
    tb_report.write_image(
        writer,
        "figure2",
        png,
        config.train_steps,
        "Paper Figure 2 in miniature: test top-1 against steps, every variant.",
    )
    return table
