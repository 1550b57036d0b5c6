r"""Forward+backward speed of keras_bn.BatchNormalization vs Keras' layer.

Both layers run in the same process, inside the same compiled `tf.function`
train-mode step (forward, loss, gradients w.r.t. inputs, γ and β), measured
round-robin. The ratio is ours / Keras (below 1.0 means ours is faster);
"guard" is ours / ours with `skip_nonfinite_updates=False`, the cost of the
non-finite guard on the moving statistics.
GB/s counts the minimal float32 traffic of a step: read x and write y
forward, read x and dy and write dx backward (5 tensors of the input's size).

Run:
    python -m benchmarks.layer_speed            # graph mode
    python -m benchmarks.layer_speed --jit_compile
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

_SHAPES = ((256, 100), (64, 28, 28, 64), (32, 14, 14, 256))

_JIT = flags.DEFINE_bool("jit_compile", False, "Compile the step with XLA.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed samples per layer.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 10, "Steps per sample.", lower_bound=1)


def make_step(layer, shape, jit_compile):
    """A compiled train-mode step of `layer` on a fixed input of `shape`."""
    x = tf.constant(np.random.RandomState(0).randn(*shape).astype(np.float32))
    weights = tf.constant(np.random.RandomState(1).randn(*shape).astype(np.float32))
    layer.build(shape)

    @tf.function(jit_compile=jit_compile)
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * weights)
        return tape.gradient(loss, [x, layer.gamma, layer.beta])

    return step  # Eager calls of a tf.function on the CPU block until done.


def main(argv):
    del argv
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"jit_compile={_JIT.value}, CPU threads={os.cpu_count()}"
    )
    print(
        f"{'shape':>20} {'ours ms':>9} {'keras ms':>9} {'ratio':>6} {'guard':>6} "
        f"{'ours GB/s':>10} {'keras GB/s':>10}"
    )
    for shape in _SHAPES:
        times = timing.time_interleaved(
            {
                "ours": make_step(keras_bn.BatchNormalization(), shape, _JIT.value),
                "unguarded": make_step(
                    keras_bn.BatchNormalization(skip_nonfinite_updates=False), shape, _JIT.value
                ),
                "keras": make_step(keras.layers.BatchNormalization(), shape, _JIT.value),
            },
            warmup=3,
            repeats=_REPEATS.value,
            rounds=_ROUNDS.value,
        )
        gigabytes = 5 * np.prod(shape) * 4 / 1e9
        print(
            f"{str(shape):>20} {times['ours'] * 1e3:9.3f} {times['keras'] * 1e3:9.3f} "
            f"{times['ours'] / times['keras']:6.2f} {times['ours'] / times['unguarded']:6.2f} "
            f"{gigabytes / times['ours']:10.2f} {gigabytes / times['keras']:10.2f}"
        )


if __name__ == "__main__":
    app.run(main)
