"""Synchronised moments across two MultiWorkerMirroredStrategy processes."""

import json
import os
import socket
import subprocess
import sys
import tempfile

from absl.testing import absltest
import numpy as np

from tests import multi_worker_worker

_TIMEOUT_S = 120


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class MultiWorkerTest(absltest.TestCase):

    def test_two_workers_share_global_moments(self):
        workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
        out_dir = tempfile.mkdtemp()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        processes = []
        try:
            for index in range(2):
                env = dict(os.environ)
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
                )
                env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
                env["CUDA_VISIBLE_DEVICES"] = ""
                processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.multi_worker_worker", os.path.join(out_dir, f"w{index}.npz")],
                        cwd=root,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                    )
                )
            for process in processes:
                output, _ = process.communicate(timeout=_TIMEOUT_S)
                self.assertEqual(process.returncode, 0, output.decode()[-3000:])
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()

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
