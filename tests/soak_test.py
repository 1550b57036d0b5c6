"""The fault soak's CI tier: seeded soaks of the MNIST trainer on both engines, one and two workers.

Each runs `tests.soak` (its module docstring says what a soak does and
checks): the uninterrupted run, then the same command under faults drawn
from its seed, and the faulted run's end state compared bit for bit. The
seeds are fixed, so CI replays the same draws; a soak of at least as many
faults as its categories draws each category once, so the two engines
together cover every category, the lost or stopped worker with two
TensorFlow workers. The long tier (CONTRIBUTING.md) runs the same soak with
more faults, more seeds, Inception, and two JAX processes.
"""

import collections
import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import data_dirs
from tests import soak
from tests import soak_faults


def _soak(test, engine, workers, faults, seed):
    """Runs one seeded soak of the MNIST trainer; asserts its faults and their categories."""
    if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
        test.skipTest(f"real MNIST not at {data_dirs.SHARED_DATA}")
    work_dir = tempfile.mkdtemp(prefix="keras_bn_soak_")
    scenario = soak.scenario_for("mnist", engine, workers, faults)
    struck = soak.Soak(scenario, faults, seed, work_dir).run()  # Raises at a failed check.
    shutil.rmtree(work_dir, ignore_errors=True)
    test.assertGreaterEqual(len(struck), faults)
    categories = collections.Counter(f.category for f in struck)
    wanted = soak_faults.SINGLE_WORKER if workers == 1 else soak_faults.SEVERAL_WORKERS
    if os.geteuid() != 0:
        wanted = tuple(c for c in wanted if c != soak_faults.STORAGE)
    test.assertEqual(set(wanted) - set(categories), set(), categories)


@pytest.mark.soak
class SoakTest(parameterized.TestCase):
    @parameterized.named_parameters(("tensorflow", "tensorflow", 6, 1), ("jax", "jax", 6, 2))
    def test_faults_lose_nothing(self, engine, faults, seed):
        _soak(self, engine, 1, faults, seed)


@pytest.mark.soak
# With --dist loadgroup (CI), one worker runs the tests that start several
# trainer processes at once, one after another.
@pytest.mark.xdist_group("several_processes")
class TwoWorkerSoakTest(absltest.TestCase):
    def test_faults_lose_nothing_tensorflow(self):
        _soak(self, "tensorflow", 2, 4, 3)


if __name__ == "__main__":
    absltest.main()
