"""Figure 1, the results summary and the TensorBoard dashboards of the MNIST runs.

Runs are keyed by network name ("baseline", "batch_norm") and hold one
history per seed (see `trainers.mnist_sigmoid`). TensorBoard gets:
- at the model_dir root: a custom-scalars layout (one chart per network with
  its p15/p50/p85 sigmoid-input lines, one test-accuracy chart with both
  networks), the HParams experiment (the runs' identity settings: network,
  seed, batch size, learning rate, ...; final and best test accuracy and the
  first step at ≥ 97%), and
  the Figure 1 image at the end;
- in each run: its hyperparameters and, when it finishes, its metrics.
"""

import numpy as np
from tensorboard.plugins.hparams import api as hp
import tensorflow as tf

from trainers.reporting import figures
from trainers.reporting import tensorboard_writers

PERCENTILES = (15, 50, 85)
TARGET_ACCURACY = 0.97
METRICS = {
    "final_test_accuracy": "Test accuracy after the last step.",
    "best_test_accuracy": "Best test accuracy over the evaluations.",
    "first_step_97": "First evaluated step with test accuracy ≥ 97% (−1: never).",
}
SCALAR_DESCRIPTIONS = {
    "train/loss": "Mean cross-entropy over the training steps since the previous evaluation.",
    "train/learning_rate": "SGD learning rate.",
    "eval/test_accuracy": "Accuracy on the full 10,000-image MNIST test set, inference mode.",
}


def percentile_description(q):
    return (
        f"The {q}th percentile of the input to sigmoid unit 0 of the last hidden layer over the "
        "fixed probe batch of test images (paper Figure 1 b, c)."
    )


def percentile_tag(network, q):
    return f"sigmoid_input/{network}/p{q}"


def write_dashboards(model_dir, networks, hparams):
    """The model_dir root's custom-scalars layout and HParams experiment (its "dashboards" part).

    `hparams` names the runs' identity settings.
    """
    with tensorboard_writers.root_events(model_dir, "dashboards") as writer:
        _write_dashboards(writer, networks, hparams)


def _write_dashboards(writer, networks, hparams):
    charts = {"test accuracy, both networks": [r"^eval/test_accuracy$"]}
    charts.update(
        {
            f"{network}: sigmoid input p15/p50/p85": [rf"^sigmoid_input/{network}/p\d+$"]
            for network in networks
        }
    )
    tensorboard_writers.write_custom_scalars(writer, "Figure 1", charts)
    with writer.as_default():
        hp.hparams_config(
            hparams=[hp.HParam(name) for name in hparams],
            metrics=[hp.Metric(f"hparams/{name}", description=d) for name, d in METRICS.items()],
        )
    writer.flush()


def write_run_hparams(writer, identity, trial_id):
    """The run's hyperparameters, its identity (HParams' session start), once per fresh run."""
    with writer.as_default():
        # HParams takes numbers, strings and booleans: an unset setting is left out.
        hp.hparams({k: v for k, v in identity.items() if v is not None}, trial_id=trial_id)


def run_metrics(history):
    """Final, best (and its step) test accuracy, the first step at ≥ 97%, any divergence."""
    evals = history["evals"]
    best = max(evals, key=lambda e: e["test_accuracy"])
    reached = next((e["step"] for e in evals if e["test_accuracy"] >= TARGET_ACCURACY), None)
    return {
        "final_test_accuracy": evals[-1]["test_accuracy"],
        "best_test_accuracy": best["test_accuracy"],
        "best_step": best["step"],
        "first_step_97": reached,
        "steps": history["steps"],
        "wall_time_s": round(history["wall_time_s"], 1),
        "diverged": history.get("diverged"),
    }


def write_run_metrics(writer, history):
    metrics = run_metrics(history)
    with writer.as_default(step=history["steps"]):
        for name, description in METRICS.items():
            value = metrics[name]
            tf.summary.scalar(
                f"hparams/{name}", -1 if value is None else value, description=description
            )
    writer.flush()


def summarize(runs, seeds):
    """Per network: per-seed metrics and mean ± std over seeds.

    With one seed the top-level values are that seed's. `first_step_97` is
    averaged over the seeds that reached 97% (`seeds_reaching_97` of them).
    """
    out = {}
    for network, histories in runs.items():
        per_seed = {seed: run_metrics(h) for seed, h in zip(seeds, histories)}
        entry = {"per_seed": per_seed, "seeds": len(per_seed)}
        for name in ("final_test_accuracy", "best_test_accuracy", "first_step_97"):
            values = [m[name] for m in per_seed.values() if m[name] is not None]
            entry[name] = float(np.mean(values)) if values else None
            entry[f"{name}_std"] = float(np.std(values)) if values else None
        entry["seeds_reaching_97"] = sum(m["first_step_97"] is not None for m in per_seed.values())
        entry["steps"] = min(m["steps"] for m in per_seed.values())
        entry["wall_time_s"] = round(sum(m["wall_time_s"] for m in per_seed.values()), 1)
        # The first seed's divergence (each seed's is in per_seed), or None.
        entry["diverged"] = next(
            ({"seed": seed, **m["diverged"]} for seed, m in per_seed.items() if m["diverged"]),
            None,
        )
        if len(per_seed) == 1:
            entry["best_step"] = next(iter(per_seed.values()))["best_step"]
        out[network] = entry
    return out


def plot_figure(runs, path):
    """Figure 1: (a) test accuracy, then the sigmoid-input percentiles per network.

    Each line is the mean over seeds, with a min–max band when there are
    several. Returns the PNG bytes (also written to `path`).
    """
    plt = figures.pyplot()
    names = list(runs)
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(5 * (1 + len(names)), 4))

    def band(ax, histories, key, label):
        steps = [e["step"] for e in histories[0]["evals"]]
        values = np.array([[e[key] for e in h["evals"]] for h in histories])
        line = ax.plot(steps, values.mean(0), label=label)[0]
        if len(histories) > 1:
            ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.25)

    seeds = len(runs[names[0]])
    suffix = f" (mean, min–max over {seeds} seeds)" if seeds > 1 else ""
    for name in names:
        band(axes[0], runs[name], "test_accuracy", name)
    axes[0].set(title="(a) test accuracy" + suffix, xlabel="step", ylim=(0.7, 1.0))
    axes[0].legend()
    for ax in axes[2:]:
        ax.sharey(axes[1])  # Percentile panels on one scale, as in the paper.
    for ax, name, letter in zip(axes[1:], names, "bc"):
        for q in PERCENTILES:
            band(ax, runs[name], f"p{q}", f"{q}th")
        ax.set(title=f"({letter}) sigmoid input, {name}", xlabel="step")
        ax.legend()
    fig.tight_layout()
    return figures.save_figure(fig, path)


def write_figure(model_dir, png, step):
    """Logs Figure 1 as the root's image `figure1` (its "figures" part)."""
    description = "Paper Figure 1: test accuracy and sigmoid-input percentiles of both networks."
    with tensorboard_writers.root_events(model_dir, "figures") as writer:
        figures.write_image(writer, "figure1", png, step, description)
