"""Pytest set-up: split the CPU before any test initialises TensorFlow.

Multi-replica tests need several logical CPU devices, and TensorFlow fixes
its devices at first use, so the split happens once, here.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_bn import devices  # noqa: E402

devices.split_device("CPU", 4)
