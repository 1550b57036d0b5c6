r"""Overhead of keras_bn.BatchNormMonitor on `fit` of the MNIST BN network.

The paper's MNIST BN network (784-100-100-100-10, sigmoid, keras_bn layers;
trainers/mnist/model.build_model) is trained with `model.fit` on random
MNIST-shaped data, batches of 60, for --steps steps per sample, with and
without the monitor (default every_n_steps=100, a --probe_size probe batch),
in one process. The batches are one `tf.data` pipeline built once, so a fit
times training, not the copy of NumPy arrays into a new pipeline. Each round
times both fits back to back, alternating which goes first, and the overhead
is the median over rounds of the pair's ratio: slow drifts of a shared
machine hit both fits of a pair alike, where a ratio of separate medians
moved by ±20% here between runs.

Run:
    python -m benchmarks.monitor_overhead
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tempfile  # noqa: E402
import time  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_bn  # noqa: E402
from trainers import mnist_sigmoid  # noqa: E402
from trainers.mnist import model as mnist_model  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 1000, "Training steps per timed sample.", lower_bound=100)
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed samples of each.", lower_bound=1)
_EVERY = flags.DEFINE_integer(
    "every_n_steps", 100, "The monitor's logging interval.", lower_bound=1
)
_SPE = flags.DEFINE_integer(
    "steps_per_execution",
    1,
    "Keras' steps per compiled call (batch hooks run once per call).",
    lower_bound=1,
)


def main(argv):
    del argv
    rng = np.random.RandomState(0)
    x = rng.rand(_STEPS.value * 60, 784).astype(np.float32)
    y = rng.randint(0, 10, len(x))
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(60).cache()
    model, _ = mnist_model.build_model("batch_norm", 0.1, 0)
    model.compile(
        keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=_SPE.value,
    )
    monitor = keras_bn.BatchNormMonitor(
        tempfile.mkdtemp(), x[: mnist_sigmoid.PROBE_SIZE.value], every_n_steps=_EVERY.value
    )

    def fit(callbacks):
        start = time.perf_counter()
        model.fit(batches, epochs=1, callbacks=callbacks, verbose=0)
        return time.perf_counter() - start

    inside = []
    write_summaries = monitor.write_summaries

    def timed_write_summaries(model, step):
        start = time.perf_counter()
        write_summaries(model, step)
        inside.append(time.perf_counter() - start)

    monitor.write_summaries = timed_write_summaries
    fit([monitor])  # Warm-up: tracing, the probe model, the writer, the cache.
    fit([])
    inside.clear()
    ratios, times = [], {"without": [], "with": []}
    for round_index in range(_ROUNDS.value):
        order = ("without", "with") if round_index % 2 == 0 else ("with", "without")
        pair = {name: fit([monitor] if name == "with" else []) for name in order}
        for name, seconds in pair.items():
            times[name].append(seconds)
        ratios.append(pair["with"] / pair["without"])
    without = np.median(times["without"])
    print(
        f"Keras {keras.__version__}, {_STEPS.value} steps of batch 60 "
        f"(steps_per_execution={_SPE.value}), monitor every "
        f"{_EVERY.value} steps with a {mnist_sigmoid.PROBE_SIZE.value}-example probe"
    )
    overhead = 100 * (np.asarray(ratios) - 1)
    low, high = np.percentile(overhead, [25, 75])
    print(
        f"fit without monitor {without:.3f} s, with monitor {np.median(times['with']):.3f} s "
        f"(medians of {_ROUNDS.value}), overhead {np.median(overhead):.1f}% "
        f"(median of {_ROUNDS.value} paired ratios; quartiles {low:.1f}% to {high:.1f}%)"
    )
    per_fit = sum(inside) / _ROUNDS.value
    print(
        f"inside the monitor {per_fit:.3f} s per fit ({len(inside) // _ROUNDS.value} logs), "
        f"{100 * per_fit / without:.1f}% of the fit without it"
    )


if __name__ == "__main__":
    app.run(main)
