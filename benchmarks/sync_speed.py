r"""Synchronised train step: keras_bn vs keras.layers.BatchNormalization.

The same small conv net (conv → BN → ReLU, twice, then pooling and a dense
head) is trained under one `MirroredStrategy` over `--replicas` logical CPU
devices, once with `keras_bn.BatchNormalization(synchronized=True)` and once
with `keras.layers.BatchNormalization(synchronized=True)`, in one process,
measured round-robin. Ratio = ours / Keras per paired round, its median and
quartiles (below 1.0 means ours is faster).

With `--payload` it instead counts the all-reduce traffic of one layer's
training step (forward and input gradient) for R in {2, 8, 64, 1024} replicas
and groups K in {R, 8, 2} (K <= R), C = 256 channels, by running the layer's
training call under a counting stand-in replica context (replica 0 of R), and
prints one line per case.

With `--hlo` it prints the all-reduces XLA compiles into one layer's
training step under Keras 3's `keras.distribution.DataParallel` on JAX over
8 host devices, for Keras' layer and for local, ghost, global and grouped
statistics (`benchmarks/hlo_traffic.py`, run in its own process because
JAX must start with the XLA flag).

Run:
    python -m benchmarks.sync_speed
    python -m benchmarks.sync_speed --payload
    python -m benchmarks.sync_speed --hlo
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags

from benchmarks import sync_models
from tests import sync_fixtures
from trainers.engines import devices

_REPLICAS = flags.DEFINE_integer("replicas", 2, "Logical devices (replicas).", lower_bound=2)
_DEVICE = flags.DEFINE_enum(
    "device",
    "CPU",
    ["CPU", "GPU"],
    "Device type the replicas run on: the first one is split into --replicas logical devices "
    "unless that many physical devices exist.",
)
_BATCH = flags.DEFINE_integer("global_batch", 64, "Global batch size.", lower_bound=2)
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed samples per model.", lower_bound=1)
_SYNC = flags.DEFINE_bool(
    "synchronized", True, "Synchronise the moments (False: local-moment baseline)."
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Steps per sample.", lower_bound=1)
_PAYLOAD = flags.DEFINE_bool(
    "payload", False, "Print the counted all-reduce payloads instead of timing."
)
_HLO = flags.DEFINE_bool(
    "hlo",
    False,
    "Print the all-reduces of the compiled JAX training step under DataParallel instead of timing.",
)

PAYLOAD_REPLICAS = (2, 8, 64, 1024)
PAYLOAD_CHANNELS = 256


def payload_lines(replica_counts=PAYLOAD_REPLICAS, channels=PAYLOAD_CHANNELS):
    """One line per (R, K) case with the counted collectives and floats."""
    import numpy as np

    import keras_bn

    x = np.random.RandomState(0).randn(8, 4, 4, channels).astype(np.float32)
    lines = []
    for replicas in replica_counts:
        for group in sorted({replicas, 8, 2}, reverse=True):
            if group > replicas:
                continue
            layer = keras_bn.BatchNormalization(
                synchronized=True, sync_group_size=None if group == replicas else group
            )
            forward, backward = sync_fixtures.count_all_reduces(layer, x, replicas)
            lines.append(
                f"payload replicas={replicas} group={group} channels={channels} "
                f"forward_collectives={len(forward)} forward_floats={sum(forward)} "
                f"backward_collectives={len(backward)} backward_floats={sum(backward)}"
            )
    return lines


def make_step(strategy, bn_factory, global_batch):
    import keras
    import numpy as np
    import tensorflow as tf

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = sync_models.conv_net(bn_factory)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    rng = np.random.RandomState(0)
    x = rng.randn(global_batch, 32, 32, 16).astype(np.float32)
    y = rng.randint(0, 10, global_batch)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset.unbatch().batch(global_batch)))
    batch = next(iterator)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def replica_step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(inputs, training=True)) / global_batch
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        return strategy.run(replica_step, args=batch)

    return step


def main(argv):
    del argv
    if _HLO.value:
        import subprocess
        import sys

        # JAX reads XLA_FLAGS when it starts: a process of its own.
        subprocess.run([sys.executable, "-m", "benchmarks.hlo_traffic"], check=True)
        return
    if _PAYLOAD.value:
        print("\n".join(payload_lines()))
        return
    import keras
    import numpy as np
    import tensorflow as tf

    if len(tf.config.list_physical_devices(_DEVICE.value)) >= _REPLICAS.value:
        names = [d.name for d in tf.config.list_logical_devices(_DEVICE.value)]
    else:
        names = devices.split_device(_DEVICE.value, _REPLICAS.value)

    from benchmarks import timing
    import keras_bn

    strategy = tf.distribute.MirroredStrategy(names[: _REPLICAS.value])
    steps = {
        "ours": make_step(
            strategy, lambda: keras_bn.BatchNormalization(synchronized=_SYNC.value), _BATCH.value
        ),
        "keras": make_step(
            strategy,
            lambda: keras.layers.BatchNormalization(synchronized=_SYNC.value),
            _BATCH.value,
        ),
    }
    samples = timing.time_rounds(steps, warmup=3, repeats=_REPEATS.value, rounds=_ROUNDS.value)
    ours, theirs = (np.asarray(samples[name]) for name in ("ours", "keras"))
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"{_REPLICAS.value} {_DEVICE.value} replicas, global batch {_BATCH.value}"
    )
    q1, ratio, q3 = np.percentile(ours / theirs, [25, 50, 75])
    print(
        f"ours {np.median(ours) * 1e3:.2f} ms/step, keras {np.median(theirs) * 1e3:.2f} ms/step, "
        f"ratio (median of {_ROUNDS.value} paired rounds) {ratio:.3f} [q1–q3 {q1:.3f}–{q3:.3f}]"
    )


if __name__ == "__main__":
    app.run(main)
