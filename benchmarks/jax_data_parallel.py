r"""The MNIST BN network under Keras 3's JAX `DataParallel`: keras_bn vs Keras' layer.

Trains the paper's MNIST BN network (784-100-100-100-10, sigmoid;
`trainers/mnist/model.py`) with `model.fit` under
`keras.distribution.DataParallel` over 8 host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set here before JAX
starts), with the same initial kernels and data order, once per BN layer:

    keras_bn         keras_bn.BatchNormalization() (each replica's own batch)
    keras_bn_global  keras_bn.BatchNormalization(synchronized=True)
    keras            keras.layers.BatchNormalization() (the global batch on
                     this engine)

Each trains --chunk steps once to compile, then --rounds more chunks timed
round-robin against the others (one step in flight at a time, see
`tests.jax_programs.OneStepInFlight`: 8 emulated devices on a few cores
deadlock otherwise); it prints the test accuracy on the 10k test
images (inference mode) and the median steps/s, and each keras_bn run's
ratio of steps/s to Keras' (above 1.0: faster). MNIST is read by a separate
process (TFDS needs TensorFlow), so this process imports no TensorFlow; the
last line says whether that held.

Run:
    python -m benchmarks.jax_data_parallel --data_dir=../shared/data/tensorflow_datasets
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tests import host_devices  # noqa: E402  (after KERAS_BACKEND, before JAX's first device use)

host_devices.emulate_host_devices(8)

import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    None,
    "TFDS data directory holding mnist (default: TFDS's own, downloading it).",
)
_REPLICAS = flags.DEFINE_integer("replicas", 8, "Devices on the batch axis.", lower_bound=2)
_BATCH = flags.DEFINE_integer(
    "global_batch", 64, "Global batch size (a multiple of --replicas).", lower_bound=2
)
_CHUNK = flags.DEFINE_integer("chunk", 200, "Training steps per timed sample.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer(
    "rounds", 5, "Timed samples per layer (after one untimed chunk).", lower_bound=1
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 0.5, "SGD learning rate (the MNIST trainer's).", lower_bound=0.0
)
_SEED = flags.DEFINE_integer("seed", 0, "Kernel initialisation and data order.", lower_bound=0)

_LOAD = (
    "import sys, numpy as np\n"
    "from trainers.mnist import data as mnist_data\n"
    "data_dir = sys.argv[1] if sys.argv[1] != 'None' else None\n"
    "train, test = (mnist_data.load_mnist(data_dir, s) for s in ('train', 'test'))\n"
    "np.savez(sys.argv[2], x=train[0], y=train[1], x_test=test[0], y_test=test[1])\n"
)


def load_mnist(data_dir):
    """MNIST as NumPy arrays, read by a TensorFlow process of its own."""
    path = os.path.join(tempfile.mkdtemp(), "mnist.npz")
    subprocess.run([sys.executable, "-c", _LOAD, str(data_dir), path], check=True)
    data = np.load(path)
    return (data["x"], data["y"]), (data["x_test"], data["y_test"])


def main(argv):
    del argv
    if _BATCH.value % _REPLICAS.value:
        raise app.UsageError(
            "--global_batch must be a multiple of --replicas. "
            f"Received: global_batch={_BATCH.value}, "
            f"replicas={_REPLICAS.value}"
        )
    (x, y), (x_test, y_test) = load_mnist(_DATA_DIR.value)
    import jax
    import keras

    from benchmarks import timing
    import keras_bn
    from tests import jax_programs
    from trainers.mnist import model as mnist_model

    if jax.device_count() < _REPLICAS.value:
        raise RuntimeError(f"JAX sees {jax.device_count()} devices; XLA_FLAGS was set too late.")
    distribution = keras.distribution.DataParallel(devices=jax.devices()[: _REPLICAS.value])
    steps = _CHUNK.value * (_ROUNDS.value + 1)
    order = np.concatenate(
        [
            np.random.RandomState(_SEED.value + epoch).permutation(len(x))
            for epoch in range(-(-steps * _BATCH.value // len(x)))
        ]
    )[: steps * _BATCH.value]
    layers = {
        "keras_bn": (keras_bn.BatchNormalization, False),
        "keras_bn_global": (keras_bn.BatchNormalization, True),
        "keras": (keras.layers.BatchNormalization, False),
    }
    models, cursors = {}, {}
    with distribution.scope():
        for name, (layer, sync) in layers.items():
            model, _ = mnist_model.build_model(
                "batch_norm", 0.1, _SEED.value, sync_batch_norm=sync, batch_norm_layer=layer
            )
            model.compile(
                keras.optimizers.SGD(_LEARNING_RATE.value),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            models[name], cursors[name] = model, 0

    def train_chunk(name):
        def run():
            rows = order[
                cursors[name] * _BATCH.value : (cursors[name] + _CHUNK.value) * _BATCH.value
            ]
            with distribution.scope():
                models[name].fit(
                    x[rows],
                    y[rows],
                    batch_size=_BATCH.value,
                    epochs=1,
                    shuffle=False,
                    verbose=0,
                    callbacks=[jax_programs.OneStepInFlight()],
                )
            cursors[name] += _CHUNK.value

        return run

    seconds = timing.time_interleaved(
        {name: train_chunk(name) for name in models}, warmup=1, repeats=1, rounds=_ROUNDS.value
    )
    print(
        f"JAX {jax.__version__}, Keras {keras.__version__}, DataParallel over {_REPLICAS.value} "
        f"{jax.devices()[0].platform.upper()} devices, global batch {_BATCH.value}, "
        f"{steps} steps each"
    )
    rates = {}
    for name, model in models.items():
        with distribution.scope():
            logits = model.predict(x_test, batch_size=1000, verbose=0)
        accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
        rates[name] = _CHUNK.value / seconds[name]
        print(f"{name}: test accuracy {100 * accuracy:.2f}%, {rates[name]:.1f} steps/s")
    for name in ("keras_bn", "keras_bn_global"):
        print(f"ratio {name}/keras steps/s {rates[name] / rates['keras']:.3f}")
    print(f"tensorflow imported in this process: {'tensorflow' in sys.modules}")


if __name__ == "__main__":
    app.run(main)
