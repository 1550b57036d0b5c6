"""Pytest set-up: split the CPU before any test initialises TensorFlow.

Multi-replica tests need several logical CPU devices, and TensorFlow fixes
its devices at first use, so the split happens once, here. Under another
Keras backend (the backend tests' own processes) TensorFlow is left alone.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from keras_bn import devices  # noqa: E402

if keras.backend.backend() == "tensorflow":
    devices.split_device("CPU", 4)
