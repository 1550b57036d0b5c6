"""Pytest set-up: split the CPU before any test initialises TensorFlow.

Multi-replica tests need several logical CPU devices, and TensorFlow fixes
its devices at first use, so the split happens once, here. Under another
Keras backend (the backend tests' own processes) TensorFlow is left alone,
and under JAX the host CPU shows as 8 devices for `keras.distribution`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402

from tests import host_devices  # noqa: E402
from trainers import devices  # noqa: E402

if keras.backend.backend() == "tensorflow":
    devices.split_device("CPU", 4)
elif keras.backend.backend() == "jax":
    # Eight host devices for the keras.distribution tests.
    host_devices.emulate_host_devices(8)
