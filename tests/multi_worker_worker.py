"""One worker of the MultiWorkerMirroredStrategy test (run as a subprocess).

Reads TF_CONFIG, takes its shard of a fixed global batch, runs one
synchronised training step of keras_bn.BatchNormalization and writes the
layer's moving statistics (momentum 0, so the batch moments) and its output
to the .npz path given as argv[1].
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_bn  # noqa: E402

# Shards of unequal size, the features with a large mean (stability check).
SHARDS = (5, 11)
FEATURES = 3


def global_batch():
    rng = np.random.RandomState(0)
    return (1e3 + rng.randn(sum(SHARDS), FEATURES) * 2).astype(np.float32)


def main(out_path):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    start = sum(SHARDS[:task])
    shard = global_batch()[start : start + SHARDS[task]]
    with strategy.scope():
        layer = keras_bn.BatchNormalization(synchronized=True, momentum=0.0)
        layer.build((None, FEATURES))

    @tf.function
    def step(x):
        return strategy.run(lambda v: layer(v, training=True), args=(x,))

    y = step(tf.constant(shard))
    np.savez(
        out_path,
        mean=layer.moving_mean.numpy(),
        variance=layer.moving_variance.numpy(),
        y=strategy.experimental_local_results(y)[0].numpy(),
        task=task,
    )


if __name__ == "__main__":
    main(sys.argv[1])
