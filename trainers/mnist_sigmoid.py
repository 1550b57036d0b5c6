r"""Sigmoid MNIST network with and without Batch Normalization (paper §4.1, Fig. 1).

A 784-100-100-100-10 network with sigmoid hidden units, trained with plain
SGD on mini-batches of 60 for 50,000 steps. The baseline computes
y = sigmoid(Wu + b); the BN network y = sigmoid(BN(Wu)) with
keras_bn.BatchNormalization (β replaces the bias). Every --eval_every steps it
logs the test accuracy over the full 10k test set (inference mode), the
15th/50th/85th percentiles of the input to one sigmoid of the last hidden layer
over a fixed probe batch (Fig. 1 b, c), histograms of every hidden layer's
pre-activations, the train loss, the learning rate and the BN layers' health
(keras_bn.BatchNormMonitor) to TensorBoard under --model_dir/<network>
(--model_dir/<network>/seed_<s> with --num_seeds > 1), and checkpoints; a
killed run resumes from its last checkpoint with the same --model_dir. The
model_dir root holds the custom-scalars layout (Figure 1 as charts), the
HParams experiment and, at the end, the Figure 1 image; figure1.png (mean
and min–max band over seeds) and summary.json are written there too
(trainers/mnist_report.py).

Run (both networks, same seed and data order, on the real MNIST copy here):

    python -m trainers.mnist_sigmoid --data_dir=../shared/data/tensorflow_datasets \
        --model_dir=runs/mnist

Expected result (measured here, see README): the BN network reaches a higher
test accuracy sooner and ends higher than the baseline (98.08% vs 97.78%
after 50,000 steps; 90.45% vs 82.75% after 500), and its sigmoid-input
percentiles stay stable while the baseline's drift, as in the paper's
Figure 1. Both runs together took 3.5 minutes on this project's 2-core
machine (1.5 minutes on the machine of the first measurement).
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
from trainers import loops
from trainers import mnist_data
from trainers import mnist_model
from trainers import mnist_report
from trainers import strategy as strategy_lib
from trainers import summaries

NORM = flags.DEFINE_enum(
    "norm", "both", ["none", "batch_norm", "both"],
    "none: the sigmoid baseline; batch_norm: BN before every sigmoid; both: "
    "run the two in turn with the same seed and data order.",
)
INIT_STD = flags.DEFINE_float(
    "init_std", 0.1, "Std of the Gaussian weight initialisation.", lower_bound=0.0
)
PROBE_SIZE = flags.DEFINE_integer(
    "probe_size", 1000,
    "Test images in the fixed probe batch for the percentiles and histograms.",
    lower_bound=2,
)
NUM_SEEDS = flags.DEFINE_integer(
    "num_seeds", 1,
    "Train each network for seeds --seed … --seed+N−1 (each seed's data order and initial "
    "kernels shared by both networks), each seed a run of its own; the figure and "
    "summary.json give the mean and spread over seeds.",
    lower_bound=1,
)
TRAIN_SUBSET = flags.DEFINE_integer(
    "train_subset", None,
    "Use only the first N training examples (smoke runs).", lower_bound=1,
)

DEFAULTS = {"train_steps": 50_000, "batch_size": 60, "learning_rate": 0.5, "eval_every": 500}
RUN_NAMES = mnist_model.RUN_NAMES
PROBE_UNIT = 0  # The "typical sigmoid" of the last hidden layer that Fig. 1 b, c follows.
PERCENTILES = mnist_report.PERCENTILES


@dataclasses.dataclass(frozen=True)
class Config(strategy_lib.DistributionConfig):
    """Everything one invocation runs with: every flag, trainer defaults applied.

    Made once in `main` from the flags and logged whole (TensorBoard text
    "config" of each run, and `summary.json`), so no flag can go unrecorded.
    """

    model_dir: str
    data_dir: Optional[str]
    seed: int
    train_steps: int
    batch_size: int
    learning_rate: float
    eval_every: int
    norm: str
    init_std: float
    probe_size: int
    num_seeds: int
    train_subset: Optional[int]

    @property
    def networks(self):
        """The networks to train, as `norm` values."""
        return ["none", "batch_norm"] if self.norm == "both" else [self.norm]

    @property
    def seeds(self):
        return list(range(self.seed, self.seed + self.num_seeds))

    def run_dir(self, norm, seed):
        """`model_dir/<network>`, or `model_dir/<network>/seed_<seed>` with several seeds."""
        parts = [self.model_dir, RUN_NAMES[norm]] + ([f"seed_{seed}"] if self.num_seeds > 1 else [])
        return os.path.join(*parts)


def config_from_flags():
    """The `Config` of the parsed flags (called by `main` only)."""
    holders = [
        run_flags.MODEL_DIR, run_flags.DATA_DIR, run_flags.SEED, training_flags.TRAIN_STEPS,
        training_flags.BATCH_SIZE, training_flags.LEARNING_RATE, training_flags.EVAL_EVERY,
        NORM, INIT_STD, PROBE_SIZE, NUM_SEEDS, TRAIN_SUBSET, *distribution_flags.HOLDERS,
    ]
    return Config(**summaries.with_defaults(summaries.flag_values(holders), DEFAULTS))


def train_and_evaluate(config, strategy, norm, seed, train, test):
    """Trains one network (`norm`: "none" or "batch_norm") with `seed` under `strategy`.

    Logs and checkpoints every `config.eval_every` steps into
    `config.run_dir(norm, seed)` and resumes from the last checkpoint there.
    The BN network's layers are also watched by `keras_bn.BatchNormMonitor`
    on the probe batch.
    Returns the run's history: a dict with "evals" (one record per
    evaluation), "steps" and "wall_time_s".

    Raises:
        ValueError: if the global batch does not split evenly over the
            replicas, or the sync group size does not divide their number.
    """
    replicas = strategy.num_replicas_in_sync
    if config.batch_size % replicas:
        raise ValueError(
            f"The global batch must split evenly over {replicas} replicas. "
            f"Received: batch_size={config.batch_size}"
        )
    distribution_flags.check_sync_group_size(config.sync_group_size, replicas)
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model, probe = mnist_model.build_model(
            norm, config.init_std, seed, config.sync_batch_norm, config.sync_group_size
        )
        optimizer = keras.optimizers.SGD(config.learning_rate)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    network = RUN_NAMES[norm]
    run_dir = config.run_dir(norm, seed)
    tf.io.gfile.makedirs(run_dir)
    # The run's own configuration: its network and seed.
    run_config = {**dataclasses.asdict(dataclasses.replace(config, norm=norm, seed=seed)), "network": network}
    run = loops.RunState(
        run_dir, step, run_config, max_to_keep=2,
        is_chief=distribution.is_chief(strategy), model=model, optimizer=optimizer,
    )
    with run:
        fresh = run.start == 0
        if fresh:
            mnist_report.write_run_hparams(run.writer, network, config, seed, os.path.relpath(run_dir, config.model_dir))
        images, labels = train
        dataset = mnist_data.make_dataset(
            images, labels, config.batch_size, seed, run.start, config.train_steps
        )
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        multi_step = loops.make_multi_step(strategy, model, optimizer, loss_fn, config.batch_size)
        test_images, test_labels = tf.constant(test[0]), test[1]
        probe_images = tf.constant(test[0][: config.probe_size])
        predict = tf.function(lambda x: model(x, training=False))
        pre_activations = tf.function(lambda x: probe(x, training=False))
        latest_probes = {}  # Histogram values of the last evaluation (not kept in the history).
        monitored = norm == "batch_norm"
        monitor = keras_bn.BatchNormMonitor(None, test[0][: config.probe_size]) if monitored else None

        def evaluate(step, interval):
            accuracy = float(np.mean(np.argmax(predict(test_images), -1) == test_labels))
            probes = [p.numpy() for p in pre_activations(probe_images)]
            quantiles = np.percentile(probes[-1][:, PROBE_UNIT], PERCENTILES)
            record = {"step": step, "test_accuracy": accuracy, "train_loss": interval["train_loss"]}
            record.update({f"p{q}": float(v) for q, v in zip(PERCENTILES, quantiles)})
            latest_probes["layers"] = probes
            return record

        def write_summaries(record, history):
            del history  # MNIST logs each evaluation on its own.
            descriptions = mnist_report.SCALAR_DESCRIPTIONS
            tf.summary.scalar("train/loss", record["train_loss"], description=descriptions["train/loss"])
            tf.summary.scalar("train/learning_rate", config.learning_rate, description=descriptions["train/learning_rate"])
            tf.summary.scalar("eval/test_accuracy", record["test_accuracy"], description=descriptions["eval/test_accuracy"])
            for q in PERCENTILES:
                tf.summary.scalar(
                    mnist_report.percentile_tag(network, q), record[f"p{q}"],
                    description=mnist_report.percentile_description(q),
                )
            for i, values in enumerate(latest_probes["layers"], start=1):
                tf.summary.histogram(
                    f"pre_activation/layer_{i}", values,
                    description=f"Inputs of the sigmoids of hidden layer {i} over the probe batch.",
                )
            if monitor is not None:
                monitor.write_summaries(model, record["step"])

        trains = run.start < config.train_steps
        history = loops.train_and_log(
            run, train_steps=config.train_steps, eval_every=config.eval_every,
            steps_per_execution=None, run_steps=lambda n: multi_step(iterator, tf.constant(n)),
            evaluate=evaluate, write_summaries=write_summaries, name=f"{network} seed {seed}",
        )
        if trains:
            mnist_report.write_run_metrics(run.writer, history)
        return history


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = config_from_flags()
    # The strategy comes first: datasets and variables are created under it.
    strategy = config.create_strategy()
    chief = distribution.is_chief(strategy)
    train = mnist_data.load_mnist(config.data_dir, "train")
    test = mnist_data.load_mnist(config.data_dir, "test")
    if config.train_subset:
        train = (train[0][: config.train_subset], train[1][: config.train_subset])
    root = None
    if chief:
        tf.io.gfile.makedirs(config.model_dir)
        root = tf.summary.create_file_writer(config.model_dir)
        mnist_report.write_dashboards(root, [RUN_NAMES[n] for n in config.networks])
    runs = {RUN_NAMES[norm]: [] for norm in config.networks}
    for seed in config.seeds:  # Both networks of a seed, then the next seed.
        for norm in config.networks:
            runs[RUN_NAMES[norm]].append(train_and_evaluate(config, strategy, norm, seed, train, test))
    if not chief:
        return  # Only the chief writes the run's results.
    png = mnist_report.plot_figure(runs, os.path.join(config.model_dir, "figure1.png"))
    mnist_report.write_figure(root, png, step=config.train_steps)
    summary = {"runs": mnist_report.summarize(runs, config.seeds), "config": dataclasses.asdict(config)}
    summaries.write_json(os.path.join(config.model_dir, "summary.json"), summary)
    logging.info("Summary: %s", {k: {m: v for m, v in r.items() if m != "per_seed"} for k, r in summary["runs"].items()})


if __name__ == "__main__":
    app.run(main)
