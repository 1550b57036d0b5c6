"""Emulated JAX host devices for `keras.distribution` tests and benchmarks."""

import os

_HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def emulate_host_devices(num_devices):
    """Makes JAX's CPU platform show `num_devices` devices (`XLA_FLAGS`).

    For `keras.distribution` on one host. JAX reads the flag when its backend
    starts, at the first device use, so this must run before that (importing
    Keras or JAX is fine). A count already in `XLA_FLAGS` is kept.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _HOST_DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_HOST_DEVICE_FLAG}={num_devices}".strip()
