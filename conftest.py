"""Pytest set-up: split the CPU before any test initialises TensorFlow.

Multi-replica tests need several logical CPU devices, and TensorFlow fixes
its devices at first use, so the split happens once, here. Under another
Keras backend (the backend tests' own processes) TensorFlow is left alone,
and under JAX the host CPU shows as 8 devices for `keras.distribution`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import pytest  # noqa: E402

from tests import host_devices  # noqa: E402
from tests import sync_fixtures  # noqa: E402

if keras.backend.backend() == "tensorflow":
    sync_fixtures.split_cpu(4)
elif keras.backend.backend() == "jax":
    # Eight host devices for the keras.distribution tests.
    host_devices.emulate_host_devices(8)


# The tiers' order in a run that selects several: longest tests first.
_TIER_ORDER = {"soak": 0, "slow": 1, "integration": 2}


def pytest_collection_modifyitems(config, items):
    """Checks each test's tier and puts the soak tier first, then the slow and integration tiers.

    A test marked with more than one of `slow`, `integration` and `soak` is an
    error: a run of one tier alone (CONTRIBUTING.md) must not repeat it. A run of several tiers
    (CI's slow and soak run and its JAX trainer suite, on two pytest-xdist
    workers with `--dist loadgroup --no-loadscope-reorder`) hands out the
    longest tests first, so
    that no minutes-long test starts while the other worker has nothing left:
    within a tier, a class that one worker runs whole (marked `xdist_group`,
    as its setUpClass trains once) first. The order is otherwise the
    collection's.
    """
    tiers = {"slow", "integration", "soak"}
    both = [item.nodeid for item in items if len(tiers & _marks(item)) > 1]
    if both:
        raise pytest.UsageError(f"marked with more than one of slow, integration, soak: {both}")
    items.sort(key=_start_rank)


def _start_rank(item):
    marks = _marks(item)
    tier = min((_TIER_ORDER.get(mark, 3) for mark in marks), default=3)
    return tier, "xdist_group" not in marks


def _marks(item):
    return {mark.name for mark in item.iter_markers()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Moves the conformance rows a cell recorded into its report.

    A report reaches the process that prints the summary also from a
    pytest-xdist worker, where the module's own list stays behind.
    """
    outcome = yield
    rows = getattr(item.module, "RESULTS", None)
    if call.when == "call" and rows:
        report = outcome.get_result()
        for cell, status, detail, keras_error in rows:
            cells = (cell.path, cell.dtype, cell.layout, cell.transform)
            report.user_properties.append(("conformance", (*cells, status, detail, keras_error)))
        rows.clear()


def pytest_terminal_summary(terminalreporter):
    """Prints the conformance matrix (keras_bn/conformance_test.py) when it ran."""
    rows = sorted(
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        for name, value in getattr(report, "user_properties", ())
        if name == "conformance"
    )
    if not rows:
        return
    terminalreporter.section(f"conformance matrix ({keras.backend.backend()})")
    terminalreporter.write_line(
        f"{'path':<14}{'dtype':<16}{'layout':<8}{'transform':<12}{'result':<9}"
        f"{'keras_bn error':<16}Keras' layer"
    )
    for path, dtype, layout, transform, status, detail, keras_error in rows:
        ours = f"{detail:.1e}" if isinstance(detail, float) else ""
        theirs = f"{keras_error:.1e}" if isinstance(keras_error, float) else keras_error or ""
        if not ours:
            theirs = detail  # The reason a cell is refused or not run.
        terminalreporter.write_line(
            f"{path:<14}{dtype:<16}{layout:<8}{transform:<12}{status:<9}{ours:<16}{theirs}"
        )
