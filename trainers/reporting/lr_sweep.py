"""Learning-rate sweeps (--lr_sweep): each network at several multiples of its base rate.

A trainer hands `run` a `Sweep` and a function training one (network,
multiplier) run to its history; `run` trains every multiplier's networks in
turn (each in `<model_dir>/<network>/lr_x<m>`, resumed from its checkpoint
by a relaunch) and after each run rewrites, at the model_dir root:
- `lr_sweep.json`: per network and multiplier the learning rate, final and
  best accuracy, final train loss and whether the run diverged; per network
  the best multiplier (the highest final accuracy among the runs that did
  not diverge) and the largest one that did not diverge;
- `lr_sweep.md`: the same as Markdown tables;
- `lr_sweep.png`: final accuracy against learning rate on a log axis, one
  line per network, diverged runs marked ×;
so a partial sweep leaves what finished. At the end the figure is also
logged as the root's TensorBoard image `lr_sweep`.

A run has diverged when the trainer found it so (`trainers.run.divergence`:
with `--on_divergence=stop`, the default, it ends there), or when the mean
train loss of its last evaluation interval is not finite or at least
ln(number of classes): the cross-entropy of a uniform prediction, which any
network that learned something beats.
"""

import dataclasses
import math
import os

from trainers.reporting import figures
from trainers.reporting import tensorboard_writers
from trainers.run import json_files


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What one sweep trains and how its runs are read.

    Attributes:
        model_dir: the sweep's root directory.
        networks: the networks' names, in training order.
        multipliers: the multipliers of the base learning rates, in training order.
        base_learning_rates: network → its learning rate at multiplier 1.
        num_classes: the classes of the data set (the divergence threshold is
            ln num_classes).
        accuracy_key: the evaluation record's accuracy (e.g. "test_accuracy", "top1").
        config: the invocation's configuration, recorded in lr_sweep.json.
    """

    model_dir: str
    networks: tuple
    multipliers: tuple
    base_learning_rates: dict
    num_classes: int
    accuracy_key: str
    config: dict


def run_name(multiplier):
    """The run directory's name of a multiplier: `lr_x<m>` (`lr_x5`, `lr_x0.5`)."""
    return f"lr_x{multiplier:g}"


def run_dir(model_dir, network, multiplier):
    """`<model_dir>/<network>/lr_x<m>`."""
    return os.path.join(model_dir, network, run_name(multiplier))


def diverged(train_loss, num_classes):
    """Whether a final train loss is non-finite or no better than a uniform prediction's."""
    return not math.isfinite(train_loss) or train_loss >= math.log(num_classes)


def point(history, learning_rate, num_classes, accuracy_key):
    """One run's row: its rate, final and best accuracy, final train loss, divergence."""
    evals = history["evals"]
    final = evals[-1]
    return {
        "learning_rate": learning_rate,
        "final_accuracy": final[accuracy_key],
        "max_accuracy": max(e[accuracy_key] for e in evals),
        "final_train_loss": final["train_loss"],
        "diverged": "diverged" in history or diverged(final["train_loss"], num_classes),
        "steps": history["steps"],
        "wall_time_s": round(history["wall_time_s"], 1),
    }


def summarize(points):
    """Per network: its runs by multiplier, the best and the largest stable multiplier.

    Args:
        points: network → {multiplier: `point(...)`} of the runs so far.

    Returns:
        network → dict with "runs" (multiplier → point, in the order run),
        "best_multiplier" (the highest final accuracy among the runs that did
        not diverge; None if all diverged), "largest_stable_multiplier" (the
        largest multiplier that did not diverge; None if all did) and the
        learning rates of those two.
    """
    out = {}
    for network, runs in points.items():
        stable = {m: p for m, p in runs.items() if not p["diverged"]}
        best = max(stable, key=lambda m: stable[m]["final_accuracy"], default=None)
        largest = max(stable, default=None)
        out[network] = {
            "runs": {f"{m:g}": p for m, p in runs.items()},
            "best_multiplier": best,
            "best_learning_rate": None if best is None else stable[best]["learning_rate"],
            "largest_stable_multiplier": largest,
            "largest_stable_learning_rate": (
                None if largest is None else stable[largest]["learning_rate"]
            ),
        }
    return out


def _value(value, spec):
    return "—" if value is None else format(value, spec)


def markdown(summary, divergence_loss):
    """The summary as Markdown: one row per run, then one per network."""
    lines = [
        "| network | × | learning rate | final accuracy | max accuracy | final train loss "
        "| diverged |",
        "|---|---|---|---|---|---|---|",
    ]
    for network, entry in summary.items():
        for multiplier, p in entry["runs"].items():
            lines.append(
                f"| {network} | {multiplier} | {p['learning_rate']:.4g} "
                f"| {100 * p['final_accuracy']:.1f}% | {100 * p['max_accuracy']:.1f}% "
                f"| {p['final_train_loss']:.4g} | {'yes' if p['diverged'] else 'no'} |"
            )
    lines += [
        "",
        "| network | best × (final accuracy, not diverged) | largest stable × |",
        "|---|---|---|",
    ]
    for network, entry in summary.items():
        lines.append(
            f"| {network} | {_value(entry['best_multiplier'], 'g')} "
            f"| {_value(entry['largest_stable_multiplier'], 'g')} |"
        )
    lines += [
        "",
        f"Diverged: the last interval's mean train loss is not finite or is ≥ ln(classes) "
        f"= {divergence_loss:.3f}, the loss of a uniform prediction.",
    ]
    return "\n".join(lines) + "\n"


def plot_figure(summary, path):
    """Final accuracy against learning rate (log x), one line per network; returns the PNG."""
    plt = figures.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for network, entry in summary.items():
        runs = sorted(entry["runs"].values(), key=lambda p: p["learning_rate"])
        rates = [p["learning_rate"] for p in runs]
        line = ax.plot(rates, [p["final_accuracy"] for p in runs], marker="o", label=network)[0]
        bad = [p for p in runs if p["diverged"]]
        ax.scatter(
            [p["learning_rate"] for p in bad],
            [p["final_accuracy"] for p in bad],
            marker="x",
            s=120,
            color=line.get_color(),
            zorder=3,
            label=f"{network}: diverged" if bad else None,
        )
    ax.set(xscale="log", xlabel="learning rate", ylabel="final accuracy", ylim=(0.0, 1.0))
    ax.set_title("Final accuracy against learning rate (× = diverged)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    return figures.save_figure(fig, path)


def write_results(sweep, points):
    """Rewrites lr_sweep.json, lr_sweep.md and lr_sweep.png from the runs so far; the PNG back."""
    summary = summarize(points)
    divergence_loss = math.log(sweep.num_classes)
    json_files.write_json(
        os.path.join(sweep.model_dir, "lr_sweep.json"),
        {
            "networks": summary,
            "multipliers": list(sweep.multipliers),
            "base_learning_rates": sweep.base_learning_rates,
            "accuracy": sweep.accuracy_key,
            "divergence_loss": divergence_loss,
            "config": sweep.config,
        },
    )
    json_files.write_text(
        os.path.join(sweep.model_dir, "lr_sweep.md"), markdown(summary, divergence_loss)
    )
    return plot_figure(summary, os.path.join(sweep.model_dir, "lr_sweep.png"))


def run(sweep, train_one, writes):
    """Trains the sweep's runs with `train_one(network, multiplier) -> history`.

    Every network at one multiplier, then the next multiplier; results are
    rewritten after each run (see the module docstring).

    Args:
        sweep: the `Sweep`.
        train_one: trains (or resumes, or finds finished) one run; returns
            its history.
        writes: whether this process writes the results (the chief).

    Returns:
        The summary (`summarize`) of all runs.
    """
    points = {network: {} for network in sweep.networks}
    png = None
    for multiplier in sweep.multipliers:
        for network in sweep.networks:
            history = train_one(network, multiplier)
            rate = sweep.base_learning_rates[network] * multiplier
            points[network][multiplier] = point(
                history, rate, sweep.num_classes, sweep.accuracy_key
            )
            if writes:
                png = write_results(sweep, points)
    if png is not None:
        steps = max(p["steps"] for runs in points.values() for p in runs.values())
        with tensorboard_writers.root_events(sweep.model_dir, "figures") as writer:
            figures.write_image(
                writer,
                "lr_sweep",
                png,
                steps,
                "Final accuracy against learning rate per network; × marks a diverged run.",
            )
    return summarize(points)
