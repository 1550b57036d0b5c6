"""One worker of the BatchNormMonitor multi-worker test (run as a subprocess).

Reads TF_CONFIG, builds a small model with synchronised keras_bn layers under
MultiWorkerMirroredStrategy and trains it for 8 steps with the trainers' loop
(`trainers.engines.loops.make_multi_step`), calling a `keras_bn.BatchNormMonitor`'s
hooks as `fit` would (logging every 2 steps into argv[1]/worker_<index>): Keras
3.15's own `fit` fails under this strategy before its first step (its
symbolic build reduces a PerReplica batch with `strategy.reduce`). Only the
chief may write; the run must not hang (the test bounds it).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_bn  # noqa: E402
from trainers.engines import loops  # noqa: E402

STEPS, EVERY = 8, 2


def main(out_dir):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.RandomState(0)
    x = (rng.randn(STEPS * 16, 6) * 3 + 5).astype(np.float32)
    y = (x.sum(1) > 30).astype(np.float32)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(5, use_bias=False),
                keras_bn.BatchNormalization(synchronized=True, name="bn_a"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.SGD(0.01), "mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    run = loops.make_multi_step(
        strategy,
        model,
        model.optimizer,
        lambda labels, out: tf.reduce_sum((out[:, 0] - labels) ** 2),
        16,
    )
    log_dir = os.path.join(out_dir, f"worker_{strategy.cluster_resolver.task_id}")
    monitor = keras_bn.BatchNormMonitor(log_dir, x[:32], every_n_steps=EVERY)
    monitor.set_model(model)
    monitor.set_params({"epochs": 1, "steps": STEPS})
    monitor.on_train_begin()
    for step in range(STEPS):
        run(iterator, tf.constant(1))
        monitor.on_train_batch_end(step)
    monitor.on_epoch_end(0)
    monitor.on_train_end()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
