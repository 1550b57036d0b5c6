"""Restores a run whose newest orbax checkpoint is cut, several times; run under JAX.

    KERAS_BACKEND=jax python -m tests.damaged_orbax_restore

Saves steps 1 and 2 of a small model with `OrbaxCheckpointer`, cuts the
largest data file of step 2 to half, then restores `ROUNDS` times, each with a
fresh model: each passes over step 2 (its reads of the other arrays
abandoned) and prints the step it resumed at. Then collects the garbage for a
second, when the abandoned reads end (`tests/checkpoints_test.py`).
"""

import gc
import glob
import os
import sys
import tempfile
import time

import keras

from trainers.run import checkpoints

ROUNDS = 6


def _model_and_optimizer():
    layers = [keras.layers.Dense(200) for _ in range(6)] + [keras.layers.Dense(10)]
    model = keras.Sequential([keras.Input((784,)), *layers])
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def main(argv):
    def checkpointer(run_dir):
        return checkpoints.OrbaxCheckpointer(run_dir, 5, *_model_and_optimizer())

    run_dir = tempfile.mkdtemp()
    saver = checkpointer(run_dir)
    saver.save(1)
    saver.save(2)
    saver.close()
    shards = glob.glob(os.path.join(run_dir, "checkpoints", "2", "default", "ocdbt.*", "d", "*"))
    largest = max(shards, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)
    for _ in range(ROUNDS):
        print(f"resumed at step {checkpointer(run_dir).restore()}", flush=True)
    for _ in range(10):
        gc.collect()
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1:])
