"""Bad --model_dir, data or flags end a trainer with one error line, fast, no traceback."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized

from trainers import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIMIT_S = 15
# TensorFlow's own C++ log lines (for example a failed CUDA probe on a machine
# without a GPU), which are not the trainer's output.
_RUNTIME_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


def _fake_mnist(splits=("train", "test")):
    """A TFDS data dir whose mnist/3.0.1 has dataset_info.json and the shards of `splits`."""
    data_dir = tempfile.mkdtemp()
    version_dir = os.path.join(data_dir, "mnist", "3.0.1")
    os.makedirs(version_dir)
    info = {
        "fileFormat": "tfrecord",
        "splits": [
            {"name": "train", "shardLengths": ["60000"]},
            {"name": "test", "shardLengths": ["10000"]},
        ],
    }
    with open(os.path.join(version_dir, "dataset_info.json"), "w") as f:
        json.dump(info, f)
    for split in splits:
        open(os.path.join(version_dir, f"mnist-{split}.tfrecord-00000-of-00001"), "w").close()
    return data_dir


def _unwritable_dir():
    if os.geteuid() == 0:
        return "/sys/keras_bn_model_dir"  # Root passes permission checks; sysfs refuses mkdir.
    parent = tempfile.mkdtemp()
    os.chmod(parent, 0o500)
    return os.path.join(parent, "model_dir")


def _owned_by(trainer):
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, preflight.MARKER), "w") as f:
        json.dump({"trainer": trainer}, f)
    return model_dir


def _existing_file():
    return tempfile.mkstemp()[1]


def _locked_by_another_launch():
    """A run directory whose lock another process holds until the test process ends."""
    model_dir = tempfile.mkdtemp()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); f.write('pid 1 on test\\n');"
            " f.flush(); fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True);"
            " time.sleep(60)",
            os.path.join(model_dir, "trainer.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    _HOLDERS.append(holder)
    return model_dir


_HOLDERS = []


def _with_empty_marker():
    """A run directory whose marker a kill left empty (as a non-atomic write could)."""
    model_dir = tempfile.mkdtemp()
    open(os.path.join(model_dir, "trainer.json"), "w").close()
    return model_dir


class InputErrorTest(parameterized.TestCase):
    def tearDown(self):
        while _HOLDERS:  # The lock holders end with their test.
            holder = _HOLDERS.pop()
            holder.kill()
            holder.wait(timeout=10)
        super().tearDown()

    def _fails_in_one_line(self, module, args, pattern):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        start = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        elapsed = time.monotonic() - start
        self.assertNotEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertNotIn("Traceback", result.stderr)
        errors = [
            line
            for line in result.stderr.splitlines()
            if "error" in line.lower() and not _RUNTIME_LOG.match(line)
        ]
        self.assertLen(errors, 1, result.stderr[-2000:])
        self.assertRegex(errors[0], pattern)
        self.assertLess(elapsed, _LIMIT_S)

    @parameterized.named_parameters(
        (
            "model_dir_is_a_file",
            lambda: [f"--model_dir={_existing_file()}"],
            r"mnist_sigmoid: error: --model_dir=.* is an existing file",
        ),
        (
            "model_dir_not_writable",
            lambda: [f"--model_dir={_unwritable_dir()}"],
            r"mnist_sigmoid: error: --model_dir=.* is not writable",
        ),
        (
            "model_dir_of_another_trainer",
            lambda: [f"--model_dir={_owned_by('trainers.inception_bn')}"],
            r"mnist_sigmoid: error: --model_dir=.* holds a run of trainers.inception_bn",
        ),
        (
            "data_dir_missing",
            lambda: [f"--data_dir={tempfile.mkdtemp()}"],
            r"mnist was not found under --data_dir=.*/mnist/<version>/dataset_info.json\. "
            r"To get MNIST, omit --data_dir and TFDS downloads it",
        ),
        (
            "data_dir_incomplete",
            lambda: [f"--data_dir={_fake_mnist(splits=('train',))}"],
            r"mnist under --data_dir=.* is incomplete: .*3.0.1 lacks "
            r"mnist-test.tfrecord-00000-of-00001\. To get MNIST",
        ),
        (
            "bad_flag_value",
            lambda: ["--batch_size=0"],
            r"--batch_size=0: 0 is not a positive integer",
        ),
        (
            "unexpected_argument",
            lambda: ["stray"],
            r"mnist_sigmoid: error: Unexpected arguments: \['stray'\]",
        ),
        (
            "busy_model_dir",
            lambda: [f"--model_dir={_locked_by_another_launch()}"],
            r"mnist_sigmoid: error: --model_dir=.* is in use by pid 1 on test, which holds "
            r"trainer.lock",
        ),
        (
            "empty_marker",
            lambda: [f"--model_dir={_with_empty_marker()}"],
            r"mnist_sigmoid: error: .*trainer.json is not a trainer marker \(0 bytes",
        ),
        (
            "nan_init_std",
            lambda: ["--init_std=nan"],
            r"--init_std must be a finite number >= 0",
        ),
        (
            "infinite_learning_rate",
            lambda: ["--learning_rate=inf"],
            r"--learning_rate must be a finite number > 0",
        ),
    )
    def test_mnist(self, make_args, pattern):
        args = make_args()
        if not any(a.startswith("--model_dir") for a in args):
            args.append(f"--model_dir={tempfile.mkdtemp()}")
        self._fails_in_one_line("trainers.mnist_sigmoid", args, pattern)

    @parameterized.named_parameters(
        (
            "model_dir_of_another_trainer",
            lambda: [f"--model_dir={_owned_by('trainers.mnist_sigmoid')}", "--use_fake_data"],
            r"inception_bn: error: --model_dir=.* holds a run of trainers.mnist_sigmoid",
        ),
        (
            "imagenet_missing",
            lambda: [f"--model_dir={tempfile.mkdtemp()}", f"--data_dir={tempfile.mkdtemp()}"],
            r"inception_bn: error: imagenet2012 was not found under --data_dir=.*"
            r"TFDS cannot download ImageNet.*--use_fake_data",
        ),
        (
            "jit_compile_with_sync_batch_norm",
            lambda: ["--jit_compile", "--sync_batch_norm", "--distribution_strategy=mirrored"],
            r"--jit_compile cannot be combined with --sync_batch_norm",
        ),
        (
            "batch_not_splitting_over_replicas",
            lambda: [
                f"--model_dir={tempfile.mkdtemp()}",
                "--use_fake_data",
                "--batch_size=3",
                "--distribution_strategy=mirrored",
                "--num_cpu_devices=2",
            ],
            r"inception_bn: error: The global batch must split evenly over 2 replicas",
        ),
    )
    def test_inception(self, make_args, pattern):
        self._fails_in_one_line("trainers.inception_bn", make_args(), pattern)

    def test_marker_records_the_trainer_and_admits_it_again(self):
        model_dir = tempfile.mkdtemp()
        preflight.claim_model_dir(model_dir, "trainers.mnist_sigmoid")
        self.assertEqual(preflight.model_dir_owner(model_dir), "trainers.mnist_sigmoid")
        preflight.check_model_dir(model_dir, "trainers.mnist_sigmoid")
        with self.assertRaisesRegex(preflight.InputError, r"holds a run of trainers.mnist_sigmoid"):
            preflight.check_model_dir(model_dir, "trainers.inception_bn")

    def test_complete_data_passes(self):
        preflight.check_tfds_data(_fake_mnist(), "mnist", ("train", "test"), "")


if __name__ == "__main__":
    absltest.main()
