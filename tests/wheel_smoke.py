"""The installed keras_bn wheel, without TensorFlow, under JAX or PyTorch.

Run by `.ci/wheel_check.sh` inside a virtual environment that holds the
wheel, Keras and one backend (no system site packages, no TensorFlow), from
outside the checkout so that `import keras_bn` finds the installed wheel:

    KERAS_BACKEND=jax python tests/wheel_smoke.py
    KERAS_BACKEND=torch python tests/wheel_smoke.py

It trains a keras_bn model on the backend; under JAX also with
`synchronized=True` under `keras.distribution.DataParallel` over 8 host
devices, checking that the moving variance is the global batch's (local
statistics give the replicas' average variance instead); it checks that
`BatchNormMonitor` raises an ImportError naming the `[tensorflow]` extra, and
that TensorFlow was never imported. Exits non-zero on any failure.
"""

import os
import sys

BACKEND = os.environ.get("KERAS_BACKEND")
if BACKEND not in ("jax", "torch"):
    sys.exit(f"Set KERAS_BACKEND to jax or torch, not {BACKEND!r}.")
REPLICAS = 8
if BACKEND == "jax":
    # Before JAX starts: the host CPU shows as 8 devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={REPLICAS}"
    ).strip()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_bn  # noqa: E402


class OneStepInFlight(keras.callbacks.Callback):
    """Makes `fit` wait for each step (8 emulated devices on 2 cores)."""

    def on_train_batch_end(self, batch, logs=None):
        del batch, logs


def check_installed_wheel():
    site = os.path.dirname(os.path.dirname(os.path.abspath(keras_bn.__file__)))
    assert os.path.basename(site) == "site-packages", (
        f"keras_bn imported from {keras_bn.__file__}, not a wheel"
    )
    for name in ("trainers", "flags", "tests"):
        assert not os.path.exists(os.path.join(site, name)), f"{name} installed into {site}"
    leftovers = [
        f for f in os.listdir(os.path.dirname(keras_bn.__file__)) if f.endswith("_test.py")
    ]
    assert not leftovers, f"test modules in the wheel: {leftovers}"
    assert keras.backend.backend() == BACKEND, keras.backend.backend()


def train_local():
    rng = np.random.RandomState(0)
    x = rng.randn(256, 12).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, use_bias=False),
            keras_bn.BatchNormalization(),
            keras.layers.Activation("sigmoid"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0).history
    assert np.all(np.isfinite(history["loss"])), history
    assert history["loss"][-1] < history["loss"][0], history["loss"]
    moving_mean = keras.ops.convert_to_numpy(model.layers[1].moving_mean)
    assert np.any(moving_mean != 0), "moving statistics not updated"
    print(
        f"{BACKEND}: local statistics trained, "
        f"loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f}"
    )


def train_synchronized_data_parallel():
    import jax

    devices = jax.devices()
    assert len(devices) == REPLICAS, devices
    batch = 64
    rng = np.random.RandomState(1)
    # Each replica's slice has its own offset, so local and global variances differ.
    offsets = np.repeat(np.arange(REPLICAS) * 3.0, batch // REPLICAS)[:, None]
    x = (rng.randn(batch, 4) + offsets).astype("float32")
    y = rng.randn(batch, 1).astype("float32")
    global_variance = x.astype("float64").var(axis=0)
    local_variance = x.astype("float64").reshape(REPLICAS, -1, 4).var(axis=1).mean(axis=0)

    distribution = keras.distribution.DataParallel(devices=devices)
    variances = {}
    for synchronized in (True, False):
        with distribution.scope():
            model = keras.Sequential(
                [
                    keras.Input((4,)),
                    keras_bn.BatchNormalization(momentum=0.0, synchronized=synchronized),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(keras.optimizers.SGD(0.01), "mse")
            model.fit(
                x,
                y,
                batch_size=batch,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[OneStepInFlight()],
            )
        variances[synchronized] = keras.ops.convert_to_numpy(model.layers[0].moving_variance)
    np.testing.assert_allclose(variances[True], global_variance, rtol=1e-4)
    np.testing.assert_allclose(variances[False], local_variance, rtol=1e-4)
    print(
        f"jax: synchronized=True under DataParallel over {REPLICAS} devices "
        "took the global batch's variance"
    )


def check_monitor_needs_tensorflow():
    try:
        keras_bn.BatchNormMonitor("unused_log_dir", probe_data=np.zeros((4, 12), "float32"))
    except ImportError as error:
        assert 'pip install "keras-bn[tensorflow]"' in str(error), str(error)
        print(f"{BACKEND}: BatchNormMonitor without TensorFlow: ImportError: {error}")
    else:
        raise AssertionError(
            "BatchNormMonitor was constructed without TensorFlow; expected an ImportError"
        )


def main():
    check_installed_wheel()
    train_local()
    if BACKEND == "jax":
        train_synchronized_data_parallel()
    check_monitor_needs_tensorflow()
    assert "tensorflow" not in sys.modules, "tensorflow was imported"
    print(f"{BACKEND}: tensorflow never imported")


if __name__ == "__main__":
    main()
