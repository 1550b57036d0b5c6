r"""BN-Inception training throughput: keras_bn vs keras.layers.BatchNormalization.

The same BN-Inception (trainers/inception/model.py, BN-x5 settings) is built
twice in one process, once with each BN layer, and trained with SGD on a
fixed fake batch in a compiled step; images/sec are measured round-robin.
Ratio = ours / Keras in images/sec (above 1.0 means ours is faster).

Run:
    python -m benchmarks.inception_throughput
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

from benchmarks import timing
import keras_bn
from trainers.inception import model as inception_model

_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.", lower_bound=2)
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 128, "Image size.", lower_bound=32)
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed samples per model.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Steps per sample.", lower_bound=1)


def make_step(bn_layer, batch, image_size):
    keras.utils.set_random_seed(0)
    model = inception_model.build_inception(image_size=image_size, batch_norm_layer=bn_layer)
    optimizer = keras.optimizers.SGD(0.0075, momentum=0.9)
    optimizer.build(model.trainable_variables)
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(batch, image_size, image_size, 3).astype(np.float32))
    y = tf.constant(rng.randint(0, 1000, batch))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def main(argv):
    del argv
    batch, size = _BATCH.value, _IMAGE_SIZE.value
    times = timing.time_interleaved(
        {
            "ours": make_step(keras_bn.BatchNormalization, batch, size),
            "keras": make_step(keras.layers.BatchNormalization, batch, size),
        },
        warmup=2,
        repeats=_REPEATS.value,
        rounds=_ROUNDS.value,
    )
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, BN-Inception, "
        f"batch {batch}, {size}x{size}, CPU threads={os.cpu_count()}"
    )
    ours, theirs = batch / times["ours"], batch / times["keras"]
    print(f"ours {ours:.2f} images/s, keras {theirs:.2f} images/s, ratio {ours / theirs:.3f}")


if __name__ == "__main__":
    app.run(main)
