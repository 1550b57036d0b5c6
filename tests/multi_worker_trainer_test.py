"""The Inception trainer across two MultiWorkerMirroredStrategy processes.

Only the chief may write into --model_dir: one event file per launch, its
history and summary, its checkpoints. The other worker checkpoints into its
own temporary directory. A relaunch of both workers resumes at the chief's
checkpointed step. The chief logs the BN monitor's health while the other
worker trains on.
"""

import glob
import json
import os
import tempfile

from absl.testing import absltest
import numpy as np
import pytest
import tensorflow as tf

from tests import multi_worker
from tests import tensorboard_events
from trainers import inception_bn
from trainers import inception_recipes

_TIMEOUT_S = 300


def _launch(model_dir, train_steps):
    args = [
        "--use_fake_data",
        "--image_size=32",
        "--eval_every=1",
        "--eval_steps=1",
        "--batch_size=4",
        "--variant=bn_x5",
        "--distribution_strategy=multi_worker_mirrored",
        "--sync_batch_norm",
        f"--train_steps={train_steps}",
        f"--model_dir={model_dir}",
    ]
    return multi_worker.run_workers("trainers.inception_bn", [args, args], timeout_s=_TIMEOUT_S)


def _event_files(model_dir):
    return glob.glob(os.path.join(model_dir, "**", "events.out.tfevents.*"), recursive=True)


@pytest.mark.slow
class MultiWorkerTrainerTest(absltest.TestCase):
    def test_chief_alone_writes_and_relaunch_resumes(self):
        model_dir = tempfile.mkdtemp()
        for code, output in _launch(model_dir, train_steps=2):
            self.assertEqual(code, 0, output[-3000:])
        self.assertLen(_event_files(model_dir), 1)
        self.assertCountEqual(
            os.listdir(model_dir),
            ["checkpoints", "history.json", "summary.json", "trainer.json", "trainer.lock"]
            + [os.path.basename(f) for f in _event_files(model_dir)],
        )
        latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
        self.assertTrue(latest.endswith("-2"), latest)
        # The chief's checkpoint restores into a fresh model.
        model = inception_bn.build_model(
            inception_recipes.RECIPES["bn_x5"], image_size=32, sync_batch_norm=True
        )
        step = tf.Variable(0, dtype=tf.int64)
        tf.train.Checkpoint(step=step, model=model).restore(
            latest
        ).expect_partial().assert_existing_objects_matched()
        self.assertEqual(int(step.numpy()), 2)
        self.assertFalse(all(np.all(np.asarray(v) == 0) for v in model.non_trainable_variables))

        results = _launch(model_dir, train_steps=4)
        for code, output in results:
            self.assertEqual(code, 0, output[-3000:])
            self.assertIn("at step 2", output)  # Both workers resumed from the chief's checkpoint.
        with open(os.path.join(model_dir, "summary.json")) as f:
            self.assertEqual(json.load(f)["steps"], 4)
        with open(os.path.join(model_dir, "history.json")) as f:
            self.assertEqual([e["step"] for e in json.load(f)["evals"]], [1, 2, 3, 4])
        # One event file per launch, all the chief's: every step logged once.
        self.assertLen(_event_files(model_dir), 2)
        tags = tensorboard_events.read_events(model_dir)
        self.assertEqual([s for s, _ in tags["train/loss"]], [1, 2, 3, 4])
        # BN health, probed by the chief alone in its local replica.
        self.assertEqual([s for s, _ in tags["batch_norm/worst_train_inference_gap"]], [1, 2, 3, 4])


if __name__ == "__main__":
    absltest.main()
