"""A full disk ends a run in one line naming the cause, on TensorFlow and on JAX.

The run's --model_dir is on a 600 KiB tmpfs, which the first checkpoints
fill. Mounting needs root; elsewhere the test is skipped.
"""

import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import data_dirs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.integration
class FullDiskTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not present at {data_dirs.SHARED_DATA}")
        self.disk = tempfile.mkdtemp()
        mount = ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", self.disk]
        if subprocess.run(mount, capture_output=True).returncode != 0:
            self.skipTest("cannot mount a tmpfs here (needs root)")
        self.addCleanup(subprocess.run, ["umount", self.disk], capture_output=True)

    @parameterized.parameters("tensorflow", "jax")
    def test_a_full_disk_ends_in_one_line(self, engine):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainers.mnist_sigmoid",
                f"--data_dir={data_dirs.SHARED_DATA}",
                f"--model_dir={os.path.join(self.disk, 'run')}",
                "--norm=batch_norm",
                "--train_steps=2000",
                "--eval_every=100",
            ],
            cwd=_REPO,
            env=dict(os.environ, KERAS_BACKEND=engine),
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(done.returncode, 1, done.stderr[-3000:])
        self.assertNotIn("Traceback", done.stderr)
        self.assertRegex(
            done.stderr.strip().splitlines()[-1],
            r"^mnist_sigmoid: error: No space left on device.*: free space there \(or pass "
            r"another --model_dir\), then relaunch the same command to resume from the last "
            r"checkpoint\.$",
        )


if __name__ == "__main__":
    absltest.main()
