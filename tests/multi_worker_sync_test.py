"""Synchronised moments across two MultiWorkerMirroredStrategy processes."""

import os
import tempfile

from absl.testing import absltest
import numpy as np

from tests import multi_worker
from tests import multi_worker_worker

_TIMEOUT_S = 120


class MultiWorkerTest(absltest.TestCase):

    def test_two_workers_share_global_moments(self):
        out_dir = tempfile.mkdtemp()
        results = multi_worker.run_workers(
            "tests.multi_worker_worker",
            [[os.path.join(out_dir, f"w{index}.npz")] for index in range(2)],
            timeout_s=_TIMEOUT_S,
        )
        for code, output in results:
            self.assertEqual(code, 0, output[-3000:])

        x = multi_worker_worker.global_batch().astype(np.float64)
        mean, variance = x.mean(0), x.var(0)
        shards = np.split(x, np.cumsum(multi_worker_worker.SHARDS)[:-1])
        for index in range(2):
            result = np.load(os.path.join(out_dir, f"w{index}.npz"))
            np.testing.assert_allclose(result["mean"], mean, rtol=1e-6)
            np.testing.assert_allclose(result["variance"], variance, rtol=1e-4)
            expected_y = (shards[index] - mean) / np.sqrt(variance + 1e-3)
            np.testing.assert_allclose(result["y"], expected_y, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    absltest.main()
