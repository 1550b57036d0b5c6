"""The sigmoid MNIST trainer's task: its evaluation, summaries, Figure 1 and summary.json.

`trainers/mnist_sigmoid.py` turns the flags into a `Config` and runs
`MnistRun` for each network and seed through the shared loop
(`trainers.run.skeleton`).
"""

import dataclasses
import os

import keras
import numpy as np
import tensorflow as tf

from trainers.mnist import data as mnist_data
from trainers.mnist import model as mnist_model
from trainers.mnist import report as mnist_report
from trainers.reporting import console
from trainers.reporting import tensorboard_writers
from trainers.run import data_checks
from trainers.run import json_files
from trainers.run import skeleton

RUN_NAMES = mnist_model.RUN_NAMES
PERCENTILES = mnist_report.PERCENTILES
PROBE_UNIT = 0  # The "typical sigmoid" of the last hidden layer that Fig. 1 b, c follows.
# With --eval_bn_statistics=precise, in each run: the two statistics' accuracies in one chart.
PRECISE_CHARTS = {
    "test accuracy, precise and moving BN statistics": [r"^eval/(moving_)?test_accuracy$"]
}


class MnistRun(skeleton.Task):
    """One network (`norm`: "none" or "batch_norm") trained with one seed.

    Evaluates on the whole test set and a fixed probe batch of it; the BN
    network's layers are also watched by `keras_bn.BatchNormMonitor` on the
    probe batch.
    """

    def __init__(self, config, norm, seed, train, test):
        # The run's config: the invocation's, with this run's network and seed.
        self.config = dataclasses.replace(config, norm=norm, seed=seed)
        self.norm, self.seed = norm, seed
        self.network = RUN_NAMES[norm]
        self.train, self.test = train, test
        self.latest_probes = []  # Histogram values of the last evaluation (not in the history).

    def build(self):
        config = self.config
        self.model, self.probe = mnist_model.build_model(
            self.norm,
            config.init_std,
            self.seed,
            config.sync_batch_norm,
            config.sync_group_size,
            momentum_warmup=config.bn_momentum_warmup and self.norm == "batch_norm",
        )
        return self.model, keras.optimizers.SGD(config.learning_rate)

    def prepare_evaluation(self, model, runner):
        # Evaluation runs on the whole test set in one call, not split over replicas.
        test_images, probe_size = self.test[0], self.config.probe_size
        self.test_images = test_images
        self.probe_images = test_images[:probe_size]
        self.predict = runner.compile(lambda x: model(x, training=False), model)
        self.pre_activations = runner.compile(lambda x: self.probe(x, training=False), model)
        self.monitor = None
        if self.norm == "batch_norm":
            self.monitor = tensorboard_writers.make_monitor(model, test_images[:probe_size])

    def write_start(self, writer):
        trial = os.path.relpath(self.config.run_dir(self.norm, self.seed), self.config.model_dir)
        mnist_report.write_run_hparams(writer, self.config.identity(), trial)
        if self.config.eval_bn_statistics == "precise":
            tensorboard_writers.write_custom_scalars(
                writer, "Precise BN statistics", PRECISE_CHARTS
            )

    def data_identity(self):
        return data_checks.fingerprint(self.config.data_dir, "mnist")

    def train_dataset(self, start_step):
        images, labels = self.train
        return mnist_data.make_dataset(
            images, labels, self.config.batch_size, self.seed, start_step, self.config.train_steps
        )

    def evaluate(self, step, interval):
        logits = self.predict(self.test_images)
        accuracy = float(np.mean(np.argmax(logits, -1) == self.test[1]))
        self.latest_probes = [np.asarray(p) for p in self.pre_activations(self.probe_images)]
        quantiles = np.percentile(self.latest_probes[-1][:, PROBE_UNIT], PERCENTILES)
        record = {"step": step, "test_accuracy": accuracy, "train_loss": interval["train_loss"]}
        record.update({f"p{q}": float(v) for q, v in zip(PERCENTILES, quantiles)})
        return record

    def statistics_metrics(self):
        return ("test_accuracy", *(f"p{q}" for q in PERCENTILES))

    def write_summaries(self, record, history):
        del history  # MNIST logs each evaluation on its own.
        described = {
            "train/loss": record["train_loss"],
            "train/learning_rate": self.config.learning_rate,
            "eval/test_accuracy": record["test_accuracy"],
        }
        for tag, value in described.items():
            tf.summary.scalar(tag, value, description=mnist_report.SCALAR_DESCRIPTIONS[tag])
        if "precise_bn_seconds" in record:  # --eval_bn_statistics=precise
            tf.summary.scalar(
                "eval/moving_test_accuracy",
                record["moving_test_accuracy"],
                description="Test accuracy with the moving BN statistics; eval/test_accuracy "
                "is with the precise ones.",
            )
            tf.summary.scalar(
                "eval/precise_bn_seconds",
                record["precise_bn_seconds"],
                description="Wall time of re-estimating the BN statistics for this evaluation.",
            )
        for q in PERCENTILES:
            tf.summary.scalar(
                mnist_report.percentile_tag(self.network, q),
                record[f"p{q}"],
                description=mnist_report.percentile_description(q),
            )
        for i, values in enumerate(self.latest_probes, start=1):
            tf.summary.histogram(
                f"pre_activation/layer_{i}",
                values,
                description=f"Inputs of the sigmoids of hidden layer {i} over the probe batch.",
            )
        if self.monitor is not None:
            self.monitor.write_summaries(self.model, record["step"])

    def write_end(self, writer, history):
        mnist_report.write_run_metrics(writer, history)


def load_data(config):
    """`(train, test)` MNIST arrays, the training set cut to `config.train_subset`."""
    train = mnist_data.load_mnist(config.data_dir, "train", limit=config.train_subset or None)
    test = mnist_data.load_mnist(config.data_dir, "test")
    return train, test


def write_results(config, runs):
    """Figure 1 (file and the root's TensorBoard image) and summary.json (the chief only)."""
    png = mnist_report.plot_figure(runs, os.path.join(config.model_dir, "figure1.png"))
    mnist_report.write_figure(config.model_dir, png, step=config.train_steps)
    summary = {
        "runs": mnist_report.summarize(runs, config.seeds),
        "config": config.flat_values(),
    }
    json_files.write_json(os.path.join(config.model_dir, "summary.json"), summary)
    num_seeds = len(config.seeds)
    any_diverged = any(run["diverged"] for run in summary["runs"].values())
    rows = []
    for name, run in summary["runs"].items():
        first = _step(run["first_step_97"])
        if num_seeds > 1 and first is not None:  # A mean over the seeds that reached 97%.
            first = f"{first} ({run['seeds_reaching_97']}/{num_seeds} seeds)"
        row = [name, run["final_test_accuracy"], run["best_test_accuracy"], first]
        if any_diverged:
            d = run["diverged"]
            row.append(f"at step {d['step']}: {d['reason']}" if d else "no")
        rows.append(row)
    headers = ["network", "final accuracy", "best accuracy", "first step at 97%"]
    if num_seeds > 1:
        headers = [headers[0]] + [f"{h}, mean of {num_seeds} seeds" for h in headers[1:]]
    if any_diverged:
        headers.append("diverged" if num_seeds == 1 else "diverged (first seed)")
    console.show(
        [""]
        + console.table(headers, rows)
        + [""]
        + console.result_paths(
            config.model_dir, {"summary": "summary.json", "figure 1": "figure1.png"}
        )
    )


def _step(value):
    """A step (a mean over seeds is a float) as a whole number; None stays None (never)."""
    return None if value is None else int(round(value))
