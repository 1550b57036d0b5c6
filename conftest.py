"""Pytest set-up: split the CPU before any test initialises TensorFlow.

Multi-replica tests need several logical CPU devices, and TensorFlow fixes
its devices at first use, so the split happens once, here. Under another
Keras backend (the backend tests' own processes) TensorFlow is left alone,
and under JAX the host CPU shows as 8 devices for `keras.distribution`.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402

from tests import host_devices  # noqa: E402
from tests import sync_fixtures  # noqa: E402

if keras.backend.backend() == "tensorflow":
    sync_fixtures.split_cpu(4)
elif keras.backend.backend() == "jax":
    # Eight host devices for the keras.distribution tests.
    host_devices.emulate_host_devices(8)


def pytest_terminal_summary(terminalreporter):
    """Prints the conformance matrix (keras_bn/conformance_test.py) when it ran."""
    module = next((m for name, m in sys.modules.items() if name.endswith("conformance_test")), None)
    rows = getattr(module, "RESULTS", None)
    if not rows:
        return
    terminalreporter.section(f"conformance matrix ({keras.backend.backend()})")
    terminalreporter.write_line(
        f"{'path':<14}{'dtype':<16}{'layout':<8}{'transform':<12}{'result':<9}"
        f"{'keras_bn error':<16}Keras' layer"
    )
    for cell, status, detail, keras_error in rows:
        ours = f"{detail:.1e}" if isinstance(detail, float) else ""
        theirs = f"{keras_error:.1e}" if isinstance(keras_error, float) else keras_error or ""
        if not ours:
            theirs = detail  # The reason a cell is refused or not run.
        terminalreporter.write_line(
            f"{cell.path:<14}{cell.dtype:<16}{cell.layout:<8}{cell.transform:<12}{status:<9}"
            f"{ours:<16}{theirs}"
        )
