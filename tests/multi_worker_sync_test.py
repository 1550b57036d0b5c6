"""Synchronised moments across two MultiWorkerMirroredStrategy processes."""

import os
import tempfile

from absl.testing import absltest
import numpy as np
import pytest

from tests import multi_worker
from tests import multi_worker_monitor_worker
from tests import multi_worker_worker
from tests import tensorboard_events

_TIMEOUT_S = 120


@pytest.mark.integration
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

    def test_monitor_probes_on_the_chief_only_without_blocking_workers(self):
        # Reading a sync-on-read moving statistic across workers is a
        # collective; the monitor probes in the chief's local replica instead,
        # so the other worker never waits for it (a hang fails the bound).
        out_dir = tempfile.mkdtemp()
        results = multi_worker.run_workers(
            "tests.multi_worker_monitor_worker", [[out_dir]] * 2, timeout_s=_TIMEOUT_S
        )
        for code, output in results:
            self.assertEqual(code, 0, output[-3000:])
            self.assertIn("done", output)
        self.assertFalse(os.path.exists(os.path.join(out_dir, "worker_1")))
        tags = tensorboard_events.read_events(os.path.join(out_dir, "worker_0"))
        steps = list(
            range(
                multi_worker_monitor_worker.EVERY,
                multi_worker_monitor_worker.STEPS + 1,
                multi_worker_monitor_worker.EVERY,
            )
        )
        for name in ("train_inference_gap", "mean_drift", "variance_drift", "moving_mean", "gamma"):
            self.assertEqual([s for s, _ in tags[f"bn_a/{name}"]], steps, name)
        self.assertTrue(all(np.isfinite(v) for _, v in tags["bn_a/train_inference_gap"]))


if __name__ == "__main__":
    absltest.main()
