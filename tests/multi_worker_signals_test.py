"""A SIGTERM that reaches one worker while a multi-worker job starts stops every worker.

TensorFlow's multi-worker runtime and JAX's distributed client each install a
SIGTERM handler of their own in C++ when they start, which only records the
signal: a preemption notice during start-up went unheard and the job trained
on. The trainers take SIGTERM back once the runtime has started
(`trainers.run.preemption.reclaim`); the signal is sent to worker 0 right
after that, where it claims --model_dir (the fault point "rename
trainer.json", through the test-only hook). Both engines' jobs run from any
suite: each worker's Keras backend is set in its environment.
"""

import json
import os
import re
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import data_dirs
from tests import multi_worker

_TIMEOUT_S = 300


@pytest.mark.slow
# One worker runs the tests that start several trainer processes (soak_test.py).
@pytest.mark.xdist_group("several_processes")
class MultiWorkerSignalsTest(parameterized.TestCase):
    @parameterized.parameters("tensorflow", "jax")
    def test_a_sigterm_at_start_up_stops_every_worker_at_step_0(self, engine):
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not at {data_dirs.SHARED_DATA}")
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        args = [
            "--norm=batch_norm",
            "--train_subset=600",
            "--train_steps=8",
            "--eval_every=4",
            "--batch_size=20",
            "--probe_size=50",
            "--sync_batch_norm",
            f"--data_dir={data_dirs.SHARED_DATA}",
            f"--model_dir={model_dir}",
        ]
        if engine == "tensorflow":
            args.append("--distribution_strategy=multi_worker_mirrored")
            cluster = multi_worker.tf_config_env
        else:
            args += ["--distribution_strategy=data_parallel", "--num_cpu_devices=1"]
            cluster = multi_worker.keras_distribution_env
        fault = [{"point": "rename trainer.json", "count": 1, "action": "SIGTERM"}]
        results = multi_worker.run_workers(
            "trainers.mnist_sigmoid",
            [args, args],
            _TIMEOUT_S,
            env={"KERAS_BACKEND": engine, "KERAS_BN_FAULT": json.dumps(fault)},
            cluster_env=lambda addresses, index: {
                **cluster(addresses, index),
                # The fault for worker 0 only: worker 1 must stop with it.
                **({} if index == 0 else {"KERAS_BN_FAULT": "[]"}),
            },
        )
        for code, output in results:
            self.assertEqual(code, 143, output[-3000:])
            self.assertNotIn("Traceback", output)
            last = [line for line in output.splitlines() if line.strip()][-1]
            self.assertRegex(
                last,
                r"^mnist_sigmoid: batch_norm seed 0: stopped at step 0 on SIGTERM; nothing "
                r"trained yet; relaunch the same command to resume$",
            )
        self.assertFalse(
            [n for n in os.listdir(model_dir) if re.match(r"summary\.json|figure1\.png", n)]
        )


if __name__ == "__main__":
    absltest.main()
