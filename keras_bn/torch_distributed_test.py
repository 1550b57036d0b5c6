"""`synchronized=True` on PyTorch: ranks of torch.distributed, launched by torch's own launcher.

`python -m torch.distributed.run --standalone --nproc_per_node=N` starts N
CPU processes (gloo) of `tests/torch_sync_worker.py`, which compares each
rank's synchronised layer with one layer on the whole global batch: forward
outputs, input gradients, γ's and β's gradients (summed over the ranks) and
the moving statistics, for equal, unequal and empty ranks, a mask, a conv
map, `torch.compile`, replica groups, virtual batches over groups of ranks,
ghost batches within a rank and `accumulation_steps`; a
`DistributedDataParallel` model trained a few SGD steps; and
`estimate_population_statistics` over every rank's batches. Runs under
`KERAS_BACKEND=torch` (CI's PyTorch suite); skipped elsewhere.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOLERANCE = 1e-6  # Largest error relative to the largest reference value, float32.
_CASES = {
    "equal",
    "unequal",
    "empty_rank",
    "mask",
    "conv",
    "compiled",
    "ghost_batches",
    "ddp",
    "accumulation",
    "own_batch",
    "own_batch_virtual",
    "second_order",
    "unequal_virtual_batches",
    "population",
    "population_synchronized",
}
_TIMEOUT_S = 300


def _torchrun(ranks, *args, monitor_interval_s=None):
    """Runs the worker on `ranks` processes; returns `(exit status, output, seconds)`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={ranks}"]
    if monitor_interval_s is not None:
        command.append(f"--monitor-interval={monitor_interval_s}")
    command += ["-m", "tests.torch_sync_worker", *args]
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=_ROOT)
    began = time.monotonic()
    done = subprocess.run(
        command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


@pytest.mark.integration
class TorchDistributedTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        if keras.backend.backend() != "torch":
            self.skipTest("synchronised ranks of torch.distributed (KERAS_BACKEND=torch)")

    @parameterized.parameters(2, 4)
    def test_ranks_equal_one_process_on_the_global_batch(self, ranks):
        out_dir = tempfile.mkdtemp()
        code, output, _ = _torchrun(ranks, f"--out_dir={out_dir}")
        self.assertEqual(code, 0, output[-4000:])
        results = []
        for rank in range(ranks):
            with open(os.path.join(out_dir, f"rank{rank}.jsonl")) as f:
                results += [json.loads(line) for line in f]
        cases = _CASES | ({"groups", "virtual_groups"} if ranks % 2 == 0 else set())
        self.assertEqual({r["case"] for r in results}, cases)
        self.assertLen(results, len(cases) * ranks)
        for result in results:
            for quantity, error in result["errors"].items():
                self.assertLessEqual(error, _TOLERANCE, (result["case"], result["rank"], quantity))

    def test_a_lost_rank_ends_the_others_in_one_line(self):
        # The launcher stops the other ranks itself once it sees one fail; it looks
        # every 5 s here, so that the survivor's own call is what ends it.
        code, output, seconds = _torchrun(2, "--lose_rank", monitor_interval_s=5)
        self.assertNotEqual(code, 0, output[-4000:])
        lost = re.search(r"LOST after ([\d.]+) s: (.*)", output)
        self.assertIsNotNone(lost, output[-4000:])
        self.assertLess(float(lost.group(1)), 30.0)
        self.assertRegex(
            lost.group(2),
            r"^keras_bn\.BatchNormalization\(synchronized=True\): the all-reduce of the "
            r"moments across 2 ranks failed on rank 0, as when a rank is lost \(.*\)$",
        )
        self.assertNotIn("NOT LOST", output)
        self.assertLess(seconds, 120)


if __name__ == "__main__":
    absltest.main()
