"""Bad --model_dir, data or flags end a trainer with one error line, fast, no traceback."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import data_dirs
from trainers.run import data_checks
from trainers.run import errors
from trainers.run import model_dirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = data_dirs.SHARED_DATA
IMAGENET_SPLITS = ("train", "validation")
# TensorFlow's own C++ log lines (for example a failed CUDA probe on a machine
# without a GPU), which are not the trainer's output.
_RUNTIME_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


# TFDS's features.json of a data set with one feature, the label.
_FEATURES = {
    "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
    "featuresDict": {
        "features": {
            "label": {
                "pythonClassName": (
                    "tensorflow_datasets.core.features.class_label_feature.ClassLabel"
                ),
                "classLabel": {"numClasses": "10"},
            }
        }
    },
}


def _fake_tfds(name, splits, present=None, damage=None):
    """A TFDS data dir whose `name`/3.0.1 has dataset_info.json and the shards of `present`.

    Each shard holds 10 TFRecords of 100 bytes; `damage(path)` may then
    alter the first shard of the first split.
    """
    import tensorflow as tf  # Writes the TFRecord framing and checksums.

    data_dir = tempfile.mkdtemp()
    version_dir = os.path.join(data_dir, name, "3.0.1")
    os.makedirs(version_dir)
    info = {
        "name": name,
        "version": "3.0.1",
        "fileFormat": "tfrecord",
        "splits": [{"name": split, "shardLengths": ["10"], "numBytes": "1000"} for split in splits],
    }
    with open(os.path.join(version_dir, "dataset_info.json"), "w") as f:
        json.dump(info, f)
    with open(os.path.join(version_dir, "features.json"), "w") as f:
        json.dump(_FEATURES, f)
    shards = [
        os.path.join(version_dir, f"{name}-{split}.tfrecord-00000-of-00001")
        for split in (splits if present is None else present)
    ]
    for shard in shards:
        with tf.io.TFRecordWriter(shard) as writer:
            for i in range(10):
                writer.write(bytes([i]) * 100)
    if damage:
        damage(shards[0])
    return data_dir


def _fake_mnist(splits=("train", "test"), damage=None):
    return _fake_tfds("mnist", ("train", "test"), present=splits, damage=damage)


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 10)


def _garbage(path):
    with open(path, "wb") as f:
        f.write(os.urandom(1160))  # The size of 10 framed records of 100 bytes.


def _checksum_error(path):
    """Flips a byte of record 3's data: the size and framing stay whole."""
    with open(path, "r+b") as f:
        f.seek(3 * 116 + 12 + 50)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _fashion_mnist(damage):
    """A copy of the shared Fashion-MNIST with its train shard altered by `damage(path)`."""
    data_dir = tempfile.mkdtemp()
    shutil.copytree(
        os.path.join(SHARED_DATA, "fashion_mnist"), os.path.join(data_dir, "fashion_mnist")
    )
    for root, _, files in os.walk(data_dir):  # The shared copy is read-only.
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    damage(glob.glob(os.path.join(data_dir, "fashion_mnist", "*", "*-train.tfrecord-*"))[0])
    return data_dir


def _unwritable_dir():
    if os.geteuid() == 0:
        return "/sys/keras_bn_model_dir"  # Root passes permission checks; sysfs refuses mkdir.
    parent = tempfile.mkdtemp()
    os.chmod(parent, 0o500)
    return os.path.join(parent, "model_dir")


def _owned_by(trainer):
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, model_dirs.MARKER), "w") as f:
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

    def _fails_in_one_line(self, module, args, pattern, up_front=True):
        """Runs `python -m module *args` ("-c" for `module`: a program), checks its one error line.

        The run must fail with one error line matching `pattern` and no
        traceback; `up_front`, with nothing new in its --model_dir (unless it
        held a run already). How long it took is not asserted: the machine may
        be shared, and the `timeout` only bounds a run that hangs.
        """
        model_dirs = [a.split("=", 1)[1] for a in args if a.startswith("--model_dir=")]
        before = {d: os.listdir(d) if os.path.isdir(d) else [] for d in model_dirs}
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        result = subprocess.run(
            [sys.executable, *(["-c"] if module == "-c" else ["-m", module]), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        self.assertNotEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertNotIn("Traceback", result.stderr)
        errors = [
            line
            for line in result.stderr.splitlines()
            if "error" in line.lower() and not _RUNTIME_LOG.match(line)
        ]
        self.assertLen(errors, 1, result.stderr[-2000:])
        self.assertRegex(errors[0], pattern)
        for model_dir, listed in before.items() if up_front else ():
            if os.path.isdir(model_dir) and "trainer.json" not in listed:
                self.assertCountEqual(os.listdir(model_dir), listed, model_dir)
        return errors[0]

    def _needs_shared_data(self, name):
        if not os.path.isdir(os.path.join(SHARED_DATA, name)):
            self.skipTest(f"No {name} under {SHARED_DATA}")

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
        (
            "batch_larger_than_the_data",
            lambda: ["--batch_size=70000"],
            r"^mnist_sigmoid: error: A training batch cannot be larger than the 60000 training "
            r"examples of MNIST's train split: pass --batch_size=60000 or less\. "
            r"Received: batch_size=70000$",
        ),
        (
            "batch_larger_than_the_subset",
            lambda: ["--train_subset=100", "--batch_size=500"],
            r"^mnist_sigmoid: error: A training batch cannot be larger than the 100 training "
            r"examples of --train_subset=100: pass --batch_size=100 or less\. "
            r"Received: batch_size=500$",
        ),
        (
            "truncated_shard",
            lambda: [f"--data_dir={_fake_mnist(damage=_truncate)}"],
            r"^mnist_sigmoid: error: mnist under --data_dir=.* has a corrupt shard, "
            r"/.*/mnist-train.tfrecord-00000-of-00001: record 9 at byte 1044 claims 100 bytes, "
            r"past the end of the file \(1150 bytes\)\. Delete .*/mnist/3.0.1 and prepare it "
            r"again\. To get MNIST",
        ),
        (
            "shard_of_garbage",
            lambda: [f"--data_dir={_fake_mnist(damage=_garbage)}"],
            r"mnist_sigmoid: error: mnist under --data_dir=.* has a corrupt shard, "
            r"/.*/mnist-train.tfrecord-00000-of-00001: record 0 at byte 0 claims \d+ bytes, past "
            r"the end of the file \(1160 bytes\)",
        ),
        (
            "shard_with_a_bad_checksum",
            lambda: [f"--data_dir={_fake_mnist(damage=_checksum_error)}"],
            r"mnist_sigmoid: error: mnist under --data_dir=.* has a corrupt shard, "
            r"/.*/mnist-train.tfrecord-00000-of-00001: TensorFlow reads a corrupted record at "
            r"360\. Delete",
        ),
    )
    @pytest.mark.integration
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
            "unknown_dataset",
            lambda: [f"--model_dir={tempfile.mkdtemp()}", "--dataset=fashion_mnst"],
            r"^inception_bn: error: --dataset=fashion_mnst is not a TFDS data set \(closest: "
            r"fashion_mnist\)\. Pass the name of an image classification data set from "
            r"https://www.tensorflow.org/datasets/catalog\.$",
        ),
        (
            "imagenet_shard_of_garbage",
            lambda: [
                f"--model_dir={tempfile.mkdtemp()}",
                f"--data_dir={_fake_tfds('imagenet2012', IMAGENET_SPLITS, damage=_garbage)}",
            ],
            r"^inception_bn: error: imagenet2012 under --data_dir=.* has a corrupt shard, "
            r"/.*/imagenet2012-train.tfrecord-00000-of-00001: record 0 at byte 0 claims \d+ "
            r"bytes, past the end of the file \(1160 bytes\)\. Delete .* and prepare it again\. "
            r"TFDS cannot download ImageNet",
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
        (
            "seeds_of_one_variant",
            lambda: [f"--model_dir={tempfile.mkdtemp()}", "--num_seeds=2", "--variant=bn_x5"],
            r"^inception_bn: error: --num_seeds > 1 repeats Table 2 .*"
            r"Received: num_seeds=2, variant=bn_x5$",
        ),
    )
    @pytest.mark.integration
    def test_inception(self, make_args, pattern):
        self._fails_in_one_line("trainers.inception_bn", make_args(), pattern)

    @parameterized.named_parameters(
        (
            "batch_larger_than_the_train_split",
            lambda: f"--data_dir={SHARED_DATA}",
            "--batch_size=70000",
            r"^inception_bn: error: A training batch cannot be larger than the 60000 training "
            r"examples of fashion_mnist's train split: pass --batch_size=60000 or less\. "
            r"Received: batch_size=70000$",
        ),
        (
            "truncated_shard",
            lambda: f"--data_dir={_fashion_mnist(_truncate)}",
            "--batch_size=32",
            r"^inception_bn: error: fashion_mnist under --data_dir=.* has a corrupt shard, "
            r"/.*/fashion_mnist-train.tfrecord-00000-of-00001: record 59999 at byte \d+ claims "
            r"\d+ bytes, past the end of the file \(\d+ bytes\)\. Delete .*/fashion_mnist/3.0.1 "
            r"and prepare it again\. Run `tfds build fashion_mnist`\.$",
        ),
    )
    @pytest.mark.integration
    def test_inception_on_fashion_mnist(self, data_dir, batch_size, pattern):
        self._needs_shared_data("fashion_mnist")
        args = [f"--model_dir={tempfile.mkdtemp()}", "--dataset=fashion_mnist", data_dir()]
        self._fails_in_one_line("trainers.inception_bn", [*args, batch_size], pattern)

    @pytest.mark.integration
    def test_corrupt_record_read_later_is_one_line_naming_the_file(self):
        """What the checks cannot see (a bad checksum in a large data set) ends as one line too."""
        data_dir = _fake_mnist(damage=_checksum_error)
        test, shard = (
            glob.glob(os.path.join(data_dir, "mnist", "*", f"*-{split}.tfrecord-*"))[0]
            for split in ("test", "train")
        )
        program = (
            "import sys, tensorflow as tf\n"
            "from trainers.run import data_checks, program\n"
            "data_checks.reads_data_files(sys.argv[1:])\n"
            "with program.one_line_errors('reader'):\n"
            "    list(tf.data.TFRecordDataset(sys.argv[1:]))\n"
        )
        line = self._fails_in_one_line("-c", [program, test, shard], r"^reader: error: ")
        self.assertEqual(
            line,
            f"reader: error: The data file {shard} is corrupt (TensorFlow: corrupted record at "
            f"360): delete {os.path.dirname(shard)} and prepare the data set again.",
        )

    @pytest.mark.slow
    def test_inception_training_on_a_corrupt_shard_ends_in_one_line(self):
        """The trainer's own run: a checksum error met in training names the shard."""
        self._needs_shared_data("fashion_mnist")
        data_dir = _fashion_mnist(_checksum_error)
        program = (
            "from absl import app\n"
            "from trainers import inception_bn\n"
            "from trainers.run import data_checks\n"
            "data_checks.VERIFY_BYTES = 0  # As ImageNet: the checksums are not read up front.\n"
            "app.run(inception_bn.main)\n"
        )
        args = [
            f"--model_dir={tempfile.mkdtemp()}",
            "--dataset=fashion_mnist",
            f"--data_dir={data_dir}",
            "--image_size=32",
            "--batch_size=8",
            "--train_steps=4",
            "--eval_every=2",
            "--eval_steps=1",
        ]
        self._fails_in_one_line(
            "-c",
            [program, *args],
            r"^inception_bn: error: The data file /.*/fashion_mnist-train.tfrecord-00000-of-00001 "
            r"is corrupt \(TensorFlow: corrupted record at \d+\): delete",
            up_front=False,
        )

    def test_marker_records_the_trainer_and_admits_it_again(self):
        model_dir = tempfile.mkdtemp()
        model_dirs.claim_model_dir(model_dir, "trainers.mnist_sigmoid")
        self.assertEqual(model_dirs.model_dir_owner(model_dir), "trainers.mnist_sigmoid")
        model_dirs.check_model_dir(model_dir, "trainers.mnist_sigmoid")
        with self.assertRaisesRegex(errors.InputError, r"holds a run of trainers.mnist_sigmoid"):
            model_dirs.check_model_dir(model_dir, "trainers.inception_bn")

    def test_complete_data_passes(self):
        data_checks.check_tfds_data(_fake_mnist(), "mnist", ("train", "test"), "")

    def test_the_fingerprint_changes_with_the_content_not_only_the_size(self):
        def other_records(path):  # Other data of the same size and framing.
            import tensorflow as tf

            with tf.io.TFRecordWriter(path) as writer:
                for i in range(10):
                    writer.write(bytes([i + 1]) * 100)

        same, changed = _fake_mnist(), _fake_mnist(damage=other_records)
        prints = [data_checks.fingerprint(d, "mnist") for d in (_fake_mnist(), same, changed)]
        self.assertEqual(prints[0], prints[1])
        self.assertEqual(prints[0]["splits"]["test"], prints[2]["splits"]["test"])
        self.assertEqual(
            prints[0]["splits"]["train"]["bytes"], prints[2]["splits"]["train"]["bytes"]
        )
        self.assertNotEqual(
            prints[0]["splits"]["train"]["digest"], prints[2]["splits"]["train"]["digest"]
        )

    def test_shard_lacking_records_is_corrupt(self):
        data_dir = _fake_mnist()
        info_path = os.path.join(data_dir, "mnist", "3.0.1", "dataset_info.json")
        with open(info_path) as f:
            info = json.load(f)
        info["splits"][1]["shardLengths"] = ["11"]
        with open(info_path, "w") as f:
            json.dump(info, f)
        with self.assertRaisesRegex(
            errors.CorruptDataError,
            r"mnist-test.tfrecord-00000-of-00001: it holds 10 records where dataset_info.json "
            r"lists 11\.",
        ):
            data_checks.check_tfds_data(data_dir, "mnist", ("train", "test"), "")


if __name__ == "__main__":
    absltest.main()
