"""A SIGTERM that reaches one worker while a multi-worker job starts stops every worker.

And a second Ctrl-C to one process of a JAX job ends it at once, its peer in
one line (`trainers.engines.lost_peers.leave_job`); a peer lost while a JAX
job ends is one line too, not an abort at JAX's shutdown barrier.

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
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import data_dirs
from tests import multi_worker

_TIMEOUT_S = 300


def _run_two_workers(engine, model_dir, faults, timeout_s=_TIMEOUT_S):
    """Runs the MNIST trainer on two workers, `faults` (the fault hook's) for worker 0 only."""
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
    return multi_worker.run_workers(
        "trainers.mnist_sigmoid",
        [args, args],
        timeout_s,
        env={"KERAS_BACKEND": engine, "KERAS_BN_FAULT": json.dumps(faults)},
        cluster_env=lambda addresses, index: {
            **cluster(addresses, index),
            **({} if index == 0 else {"KERAS_BN_FAULT": "[]"}),
        },
    )


@pytest.mark.slow
# One worker runs the tests that start several trainer processes (soak_test.py).
@pytest.mark.xdist_group("several_processes")
class MultiWorkerSignalsTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        if not os.path.isdir(os.path.join(data_dirs.SHARED_DATA, "mnist")):
            self.skipTest(f"real MNIST not at {data_dirs.SHARED_DATA}")

    @parameterized.parameters("tensorflow", "jax")
    def test_a_sigterm_at_start_up_stops_every_worker_at_step_0(self, engine):
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        fault = [{"point": "rename trainer.json", "count": 1, "action": "SIGTERM"}]
        # The fault for worker 0 only: worker 1 must stop with it.
        results = _run_two_workers(engine, model_dir, fault)
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

    def test_a_second_ctrl_c_ends_one_jax_process_at_once_and_the_other_in_one_line(self):
        # Found by the long soak: the interrupted process waited 5 minutes at JAX's
        # shutdown barrier for its peer, itself waiting for it in a collective,
        # then aborted with status 134.
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        sigint = {"point": "evaluation", "count": 1, "action": "SIGINT"}
        began = time.monotonic()
        results = _run_two_workers("jax", model_dir, [sigint, sigint], timeout_s=150)
        self.assertLess(time.monotonic() - began, 150)
        (code_0, output_0), (code_1, output_1) = results
        self.assertEqual(code_0, 130, output_0[-3000:])
        self.assertNotIn("Traceback", output_0)
        self.assertRegex(output_0, r"mnist_sigmoid: .*interrupted")
        self.assertEqual(code_1, 1, output_1[-3000:])
        self.assertNotIn("Traceback", output_1)
        last = [line for line in output_1.splitlines() if line.strip()][-1]
        self.assertRegex(last, r"^mnist_sigmoid: error: lost process 0 \(the coordinator")

    def test_a_peer_lost_at_the_end_ends_the_other_jax_process_in_one_line(self):
        # Found by the long soak: the survivor of a peer killed while the run ended
        # aborted at JAX's shutdown barrier, at exit, with status 134 and a dump.
        model_dir = os.path.join(tempfile.mkdtemp(), "run")
        kill = {"point": "run end", "count": 1, "action": "SIGKILL"}
        (code_0, output_0), (code_1, output_1) = _run_two_workers("jax", model_dir, [kill])
        self.assertEqual(code_0, -9, output_0[-3000:])
        self.assertEqual(code_1, 1, output_1[-3000:])
        self.assertNotIn("Traceback", output_1)
        last = [line for line in output_1.splitlines() if line.strip()][-1]
        self.assertRegex(last, r"^mnist_sigmoid: error: lost process 0 \(the coordinator")


if __name__ == "__main__":
    absltest.main()
