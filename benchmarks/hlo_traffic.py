r"""All-reduce traffic of one BN layer's training step, read from XLA's compiled program.

Under Keras 3's JAX backend with `keras.distribution.DataParallel` over 8
host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set here
before JAX starts), one layer's training step (C = 256 channels, global
batch 64: the training call, the gradients with respect to the input, γ and
β, and the updated moving statistics, jitted as one program; see
`tests.jax_programs.make_jax_training_step`) is lowered and compiled for each
setting, and the all-reduces of the compiled HLO are counted:

    keras   keras.layers.BatchNormalization()
    local   keras_bn.BatchNormalization()
    ghost   keras_bn.BatchNormalization(virtual_batch_size=4)
    global  keras_bn.BatchNormalization(synchronized=True)
    group2  keras_bn.BatchNormalization(synchronized=True, sync_group_size=2)
    group4  keras_bn.BatchNormalization(synchronized=True, sync_group_size=4)

`all_reduce_floats` sums each all-reduce's result elements as one device
sends them. Run it directly or as `python -m benchmarks.sync_speed --hlo`:

    python -m benchmarks.hlo_traffic
"""

import os

os.environ["KERAS_BACKEND"] = "jax"

from tests import host_devices  # noqa: E402  (after KERAS_BACKEND, before JAX's first device use)

REPLICAS, BATCH, CHANNELS = 8, 64, 256

host_devices.emulate_host_devices(REPLICAS)


def settings():
    import keras

    import keras_bn

    return {
        "keras": lambda: keras.layers.BatchNormalization(),
        "local": lambda: keras_bn.BatchNormalization(),
        "ghost": lambda: keras_bn.BatchNormalization(virtual_batch_size=4),
        "global": lambda: keras_bn.BatchNormalization(synchronized=True),
        "group2": lambda: keras_bn.BatchNormalization(synchronized=True, sync_group_size=2),
        "group4": lambda: keras_bn.BatchNormalization(synchronized=True, sync_group_size=4),
    }


def hlo_lines():
    """One line per setting: `hlo setting=S replicas=8 all_reduces=A all_reduce_floats=F`."""
    import jax
    import keras
    import numpy as np

    from tests import jax_programs

    if jax.device_count() < REPLICAS:
        raise RuntimeError(
            f"Needs {REPLICAS} JAX devices; JAX started before XLA_FLAGS was set. "
            f"Received: jax.device_count()={jax.device_count()}"
        )
    distribution = keras.distribution.DataParallel(devices=jax.devices()[:REPLICAS])
    rng = np.random.RandomState(0)
    arrays = [rng.randn(BATCH, CHANNELS).astype(np.float32) for _ in range(2)]
    x, upstream = (
        keras.distribution.distribute_tensor(a, distribution.get_data_layout(a.shape))
        for a in arrays
    )
    lines = []
    with distribution.scope():
        for name, make in settings().items():
            layer = make()
            layer.build((BATCH, CHANNELS))
            count, floats = jax_programs.hlo_all_reduces(
                jax_programs.jax_training_step_hlo(layer, x, upstream)
            )
            lines.append(
                f"hlo setting={name} replicas={REPLICAS} all_reduces={count} "
                f"all_reduce_floats={floats}"
            )
    return lines


if __name__ == "__main__":
    print("\n".join(hlo_lines()))
