r"""Sigmoid MNIST network with and without Batch Normalization (paper §4.1, Fig. 1).

A 784-100-100-100-10 network with sigmoid hidden units, trained with plain
SGD on mini-batches of 60 for 50,000 steps. The baseline computes
y = sigmoid(Wu + b); the BN network y = sigmoid(BN(Wu)) with
keras_bn.BatchNormalization (β replaces the bias). Every --eval_every steps it
logs the test accuracy over the full 10k test set (inference mode), the
15th/50th/85th percentiles of the input to one sigmoid of the last hidden layer
over a fixed probe batch (Fig. 1 b, c), histograms of every hidden layer's
pre-activations, the train loss and the learning rate to TensorBoard under
--model_dir/<run>, and checkpoints; a killed run resumes from its last
checkpoint with the same --model_dir. At the end it writes figure1.png (the
three panels of Fig. 1) and summary.json to --model_dir.

Run (both networks, same seed and data order, on the real MNIST copy here):

    python -m trainers.mnist_sigmoid --data_dir=../shared/data/tensorflow_datasets \
        --model_dir=runs/mnist

Expected result (measured here, see README): the BN network reaches a higher
test accuracy sooner and ends higher than the baseline (98.08% vs 97.78%
after 50,000 steps; 93.4% vs 82.8% after 500), and its sigmoid-input
percentiles stay stable while the baseline's drift, as in the paper's
Figure 1. Both runs together take about 1.5 minutes on 2 CPU cores.
"""

import os
import time

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
import tensorflow as tf

import keras_bn
from flags import distribution_flags as distribution_flags
from flags import run_flags as run_flags
from flags import training_flags as training_flags
from trainers import loops
from trainers import mnist_data
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
TRAIN_SUBSET = flags.DEFINE_integer(
    "train_subset", None,
    "Use only the first N training examples (smoke runs).", lower_bound=1,
)

DEFAULTS = {"train_steps": 50_000, "batch_size": 60, "learning_rate": 0.5, "eval_every": 500}
RUN_NAMES = {"none": "baseline", "batch_norm": "batch_norm"}
HIDDEN_UNITS = (100, 100, 100)
PROBE_UNIT = 0  # The "typical sigmoid" of the last hidden layer that Fig. 1 b, c follows.
PERCENTILES = (15, 50, 85)


def build_model(norm, init_std, seed, sync_batch_norm=False, sync_group_size=None):
    """Returns `(model, probe)`: the classifier and its pre-activation outputs.

    `model` maps 784 inputs to 10 logits; `probe` maps them to the inputs of
    the three sigmoid layers (the pre-activations). The BN layers synchronise
    their moments across replicas with `sync_batch_norm`, over groups of
    `sync_group_size` replicas when that is set.
    """
    initializer = lambda i: keras.initializers.RandomNormal(stddev=init_std, seed=seed + i)
    inputs = keras.Input((784,), name="image")
    h = inputs
    pre_activations = []
    for i, units in enumerate(HIDDEN_UNITS, start=1):
        h = keras.layers.Dense(
            units, use_bias=norm == "none", kernel_initializer=initializer(i), name=f"dense_{i}"
        )(h)
        if norm == "batch_norm":
            h = keras_bn.BatchNormalization(
                synchronized=sync_batch_norm, sync_group_size=sync_group_size, name=f"bn_{i}"
            )(h)
        pre_activations.append(h)
        h = keras.layers.Activation("sigmoid", name=f"sigmoid_{i}")(h)
    logits = keras.layers.Dense(10, kernel_initializer=initializer(0), name="logits")(h)
    model = keras.Model(inputs, logits, name=f"mnist_{RUN_NAMES[norm]}")
    return model, keras.Model(inputs, pre_activations, name="probe")


def train_and_evaluate(
    *, norm, train, test, run_dir, train_steps, batch_size, learning_rate,
    init_std, seed, eval_every, probe_size, strategy, flag_values,
    sync_batch_norm=False, sync_group_size=None,
):
    """Trains one network, logging and checkpointing every `eval_every` steps.

    Resumes from the last checkpoint in `run_dir`. Returns the run's history:
    a dict with "evals" (one record per evaluation), "steps" and "wall_time_s".
    """
    distribution_flags.check_sync_group_size(sync_group_size, strategy.num_replicas_in_sync)
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model, probe = build_model(norm, init_std, seed, sync_batch_norm, sync_group_size)
        optimizer = keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    run = loops.RunState(
        run_dir, step, flag_values, max_to_keep=2, is_chief=strategy_lib.is_chief(strategy),
        model=model, optimizer=optimizer,
    )
    with run:
        history, start = run.history, run.start
        if start >= train_steps:
            return history

        images, labels = train
        dataset = mnist_data.make_dataset(images, labels, batch_size, seed, start, train_steps)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        run_steps = loops.make_multi_step(strategy, model, optimizer, loss_fn, batch_size)
        test_images, test_labels = tf.constant(test[0]), test[1]
        probe_images = tf.constant(test[0][:probe_size])
        evaluate = tf.function(lambda x: model(x, training=False))
        pre_activations = tf.function(lambda x: probe(x, training=False))

        began = time.time() - history["wall_time_s"]
        while start < train_steps:
            n = min(eval_every - start % eval_every, train_steps - start)
            train_loss = float(run_steps(iterator, tf.constant(n)))
            start += n
            accuracy = float(np.mean(np.argmax(evaluate(test_images), -1) == test_labels))
            probes = [p.numpy() for p in pre_activations(probe_images)]
            quantiles = np.percentile(probes[-1][:, PROBE_UNIT], PERCENTILES)
            record = {"step": start, "test_accuracy": accuracy, "train_loss": train_loss}
            record.update({f"p{q}": float(v) for q, v in zip(PERCENTILES, quantiles)})
            history["evals"].append(record)
            with run.writer.as_default(step=start):
                tf.summary.scalar("train/loss", train_loss)
                tf.summary.scalar("train/learning_rate", learning_rate)
                tf.summary.scalar("eval/test_accuracy", accuracy)
                for q, v in zip(PERCENTILES, quantiles):
                    tf.summary.scalar(f"sigmoid_input/p{q}", v)
                for i, values in enumerate(probes, start=1):
                    tf.summary.histogram(f"pre_activation/layer_{i}", values)
            run.writer.flush()
            run.save(start, time.time() - began)
            logging.info(
                "%s step %d/%d: loss %.4f, test accuracy %.4f, sigmoid input p15/50/85 %.3f/%.3f/%.3f",
                RUN_NAMES[norm], start, train_steps, train_loss, accuracy, *quantiles,
            )
        return history


def plot_figure(histories, path):
    """Writes the three panels of Fig. 1: accuracy, and the percentiles per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(histories)
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(5 * (1 + len(names)), 4))
    for name in names:
        evals = histories[name]["evals"]
        axes[0].plot([e["step"] for e in evals], [e["test_accuracy"] for e in evals], label=name)
    axes[0].set(title="(a) test accuracy", xlabel="step", ylim=(0.7, 1.0))
    axes[0].legend()
    for ax in axes[2:]:
        ax.sharey(axes[1])  # Percentile panels on one scale, as in the paper.
    for ax, name, letter in zip(axes[1:], names, "bc"):
        evals = histories[name]["evals"]
        for q in PERCENTILES:
            ax.plot([e["step"] for e in evals], [e[f"p{q}"] for e in evals], label=f"{q}th")
        ax.set(title=f"({letter}) sigmoid input, {name}", xlabel="step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize(histories):
    """Final and best test accuracy, steps and wall time of each run."""
    out = {}
    for name, history in histories.items():
        evals = history["evals"]
        best = max(evals, key=lambda e: e["test_accuracy"])
        out[name] = {
            "final_test_accuracy": evals[-1]["test_accuracy"],
            "best_test_accuracy": best["test_accuracy"],
            "best_step": best["step"],
            "steps": history["steps"],
            "wall_time_s": round(history["wall_time_s"], 1),
        }
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    model_dir = run_flags.MODEL_DIR.value
    values = summaries.flag_values([
        run_flags.MODEL_DIR, run_flags.DATA_DIR, run_flags.SEED,
        training_flags.TRAIN_STEPS, training_flags.BATCH_SIZE,
        training_flags.LEARNING_RATE, training_flags.EVAL_EVERY,
        distribution_flags.DISTRIBUTION_STRATEGY, distribution_flags.TPU,
        distribution_flags.NUM_CPU_DEVICES, distribution_flags.NUM_GPU_DEVICES, distribution_flags.SYNC_BATCH_NORM,
        distribution_flags.SYNC_GROUP_SIZE, NORM, INIT_STD, PROBE_SIZE, TRAIN_SUBSET,
    ])
    settings = summaries.with_defaults(values, DEFAULTS)
    values.update(settings)
    strategy = strategy_lib.create_strategy(
        distribution_flags.DISTRIBUTION_STRATEGY.value,
        distribution_flags.TPU.value,
        distribution_flags.NUM_CPU_DEVICES.value, distribution_flags.NUM_GPU_DEVICES.value,
    )
    train = mnist_data.load_mnist(run_flags.DATA_DIR.value, "train")
    test = mnist_data.load_mnist(run_flags.DATA_DIR.value, "test")
    if TRAIN_SUBSET.value:
        train = (train[0][: TRAIN_SUBSET.value], train[1][: TRAIN_SUBSET.value])
    norms = ["none", "batch_norm"] if NORM.value == "both" else [NORM.value]
    histories = {}
    for norm in norms:
        histories[RUN_NAMES[norm]] = train_and_evaluate(
            norm=norm, train=train, test=test,
            run_dir=summaries.run_dir(model_dir, RUN_NAMES[norm]),
            train_steps=settings["train_steps"], batch_size=settings["batch_size"],
            learning_rate=settings["learning_rate"], init_std=INIT_STD.value,
            seed=run_flags.SEED.value, eval_every=settings["eval_every"],
            probe_size=PROBE_SIZE.value, strategy=strategy, flag_values=values,
            sync_batch_norm=distribution_flags.SYNC_BATCH_NORM.value,
            sync_group_size=distribution_flags.SYNC_GROUP_SIZE.value,
        )
    if not strategy_lib.is_chief(strategy):
        return  # Only the chief writes the run's results.
    plot_figure(histories, os.path.join(model_dir, "figure1.png"))
    summary = {"runs": summarize(histories), "flags": values}
    summaries.write_json(os.path.join(model_dir, "summary.json"), summary)
    logging.info("Summary: %s", summary["runs"])


if __name__ == "__main__":
    app.run(main)
