r"""Training speed of the MNIST BN network on each engine: TensorFlow vs JAX, one device.

Times the trainers' own step machinery (`trainers.engines.tf_runner.DistributeRunner`
and `trainers.engines.jax_runner.JaxRunner`, `run_steps(n)` as `trainers.run.skeleton`
calls it) on the paper's MNIST BN network (batch 60, SGD 0.5), the data
from the trainer's tf.data pipeline. Each engine lives in a process of its
own (`KERAS_BACKEND` is fixed per process), started once: it loads MNIST,
builds the network and trains one untimed chunk (tracing, compilation), then
times one chunk of --chunk steps per request. Rounds are paired: each round
times both engines, in alternating order, so both see the same machine
state. Prints per engine the median and quartiles of steps/s, and the
ratio of the medians.

Run:
    python -m benchmarks.engine_speed --data_dir=../shared/data/tensorflow_datasets
"""

import os
import subprocess
import sys

from absl import app
from absl import flags
import numpy as np

_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "TFDS data directory holding mnist (offline: ../shared/data/...)."
)
_CHUNK = flags.DEFINE_integer(
    "chunk", 500, "Steps per timed sample (the trainer's --eval_every).", lower_bound=1
)
_ROUNDS = flags.DEFINE_integer("rounds", 10, "Paired timed rounds.", lower_bound=1)
_WORKER = flags.DEFINE_bool("worker", False, "Internal: serve timing requests on stdin.")

ENGINES = ("tensorflow", "jax")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(data_dir, chunk, rounds):
    """The worker: trains `chunk` steps per line read on stdin and prints their seconds."""
    import time

    import keras

    from trainers.engines import strategy as strategy_lib
    from trainers.mnist import data as mnist_data
    from trainers.mnist import model as mnist_model

    images, labels = mnist_data.load_mnist(data_dir, "train")
    settings = dict(tpu=None, num_cpu_devices=None, num_gpu_devices=None, sync_group_size=None)
    runner = strategy_lib.DistributionConfig(
        distribution_strategy="off", sync_batch_norm=False, **settings
    ).create_runner()
    keras.utils.set_random_seed(0)
    model, optimizer = runner.build(
        lambda: (mnist_model.build_model("batch_norm", 0.1, 0)[0], keras.optimizers.SGD(0.5))
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    steps = chunk * (rounds + 1)
    dataset = mnist_data.make_dataset(images, labels, 60, 0, 0, steps)
    run_steps = runner.train_function(dataset, model, optimizer, loss_fn, 60)
    loss = float(run_steps(chunk))  # Untimed: tracing and compilation.
    print(f"ready {keras.backend.backend()} {keras.version()} loss {loss:.4f}", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        float(run_steps(chunk))  # float(): waits for the chunk's result.
        print(f"{time.perf_counter() - start:.6f}", flush=True)


def main(argv):
    del argv
    if _WORKER.value:
        serve(_DATA_DIR.value, _CHUNK.value, _ROUNDS.value)
        return
    workers = {}
    try:
        for engine in ENGINES:
            env = dict(os.environ, KERAS_BACKEND=engine, TF_CPP_MIN_LOG_LEVEL="2")
            command = [sys.executable, "-m", "benchmarks.engine_speed", "--worker"]
            command += [f"--data_dir={_DATA_DIR.value}", f"--chunk={_CHUNK.value}"]
            command += [f"--rounds={_ROUNDS.value}"]
            workers[engine] = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        for engine, worker in workers.items():
            line = worker.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError(f"The {engine} worker did not start (exit {worker.poll()}).")
            print(line.strip())
        rates = {engine: [] for engine in ENGINES}
        for i in range(_ROUNDS.value):
            for engine in ENGINES if i % 2 == 0 else ENGINES[::-1]:
                workers[engine].stdin.write("go\n")
                workers[engine].stdin.flush()
                rates[engine].append(_CHUNK.value / float(workers[engine].stdout.readline()))
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    print(f"MNIST BN network, batch 60, one device, {_CHUNK.value} steps per sample, ", end="")
    print(f"{_ROUNDS.value} paired rounds (steps/s: median [25th, 75th percentile]):")
    for engine in ENGINES:
        q1, median, q3 = np.percentile(rates[engine], [25, 50, 75])
        print(f"{engine}: {median:.0f} [{q1:.0f}, {q3:.0f}] steps/s")
    ratio = np.median(rates["jax"]) / np.median(rates["tensorflow"])
    print(f"ratio jax/tensorflow of the medians: {ratio:.2f}")


if __name__ == "__main__":
    app.run(main)
