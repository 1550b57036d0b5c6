"""The real input path on small prepared TFDS data (no network, no ImageNet) and on Fashion-MNIST.

The pipeline reads a data set's shards itself, so its tests read prepared
files: `TinyImages`, built once per test process into a temporary
directory, stands in for ImageNet with colour JPEG images of varied sizes
and 1000 classes over several shards, so decoding, cropping, flipping,
photometric distortion, batching, the evaluation crop and the epochs'
order all run; grayscale PNG images come from the Fashion-MNIST copy in
`../shared/data` beside the checkout when it is there.
"""

import os
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tests import data_dirs
from tests import flag_state
from trainers import inception_bn
from trainers.inception import data as image_data
from trainers.inception import recipes as inception_recipes
from trainers.inception import task as inception_task
from trainers.run import data_checks
from trainers.run import errors

FASHION_MNIST_DIR = data_dirs.SHARED_DATA
# Fashion-MNIST's spec, as dataset_spec derives it from the prepared copy.
FASHION_MNIST = image_data.DatasetSpec("fashion_mnist", 10, "test")
# TinyImages read as ImageNet is: its crops and evaluation crop.
TINY = image_data.DatasetSpec(
    "tiny_images", image_data.NUM_CLASSES, "validation", min_crop_area=0.08, eval_crop=0.875
)
TINY_EXAMPLES = 24

_MEAN = np.array((0.485, 0.456, 0.406))  # The standardisation of image_data.
_STD = np.array((0.229, 0.224, 0.225))


class TinyImages(tfds.core.GeneratorBasedBuilder):
    """24 random colour JPEG images per split, 40 to 90 pixels a side, labelled 0 … 23."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg"),
                    "label": tfds.features.ClassLabel(num_classes=image_data.NUM_CLASSES),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Generated, not downloaded.
        return {"train": self._generate_examples(0), "validation": self._generate_examples(1)}

    def _generate_examples(self, seed):
        rng = np.random.RandomState(seed)
        for i in range(TINY_EXAMPLES):
            height, width = rng.randint(40, 90, size=2)
            image = rng.randint(0, 256, (height, width, 3), dtype=np.uint8)
            yield i, {"image": image, "label": i}


_TINY_DIR = []  # The prepared copy, made on first use.


def tiny_dir():
    """A data dir holding TinyImages, 3 shards a split (prepared once per process)."""
    if not _TINY_DIR:
        data_dir = tempfile.mkdtemp()
        TinyImages(data_dir=data_dir).download_and_prepare(
            download_config=tfds.download.DownloadConfig(num_shards=3)
        )
        _TINY_DIR.append(data_dir)
    return _TINY_DIR[0]


def _dataset(split, spec=TINY, data_dir=None, **overrides):
    kwargs = dict(
        split=split,
        data_dir=data_dir or tiny_dir(),
        batch_size=4,
        image_size=48,
        distortion=1.0,
        thorough_shuffle=False,
        seed=0,
        use_fake_data=False,
        spec=spec,
    )
    kwargs.update(overrides)
    return image_data.make_dataset(**kwargs)


def _batches(dataset, count):
    return [(images.numpy(), labels.numpy()) for images, labels in dataset.take(count)]


def _raw(split, name="tiny_images", data_dir=None):
    dataset = tfds.load(name, split=split, as_supervised=True, data_dir=data_dir or tiny_dir())
    return [(image.numpy(), int(label)) for image, label in dataset]


class ImagenetInputTest(parameterized.TestCase):
    @parameterized.parameters(*inception_recipes.RECIPES)
    def test_train_batches_per_variant(self, variant):
        recipe = inception_recipes.RECIPES[variant]
        dataset = _dataset(
            "train", distortion=recipe.distortion, thorough_shuffle=recipe.thorough_shuffle
        )
        images, labels = next(iter(dataset))
        self.assertEqual(images.shape, (4, 48, 48, 3))
        self.assertEqual(images.dtype, tf.float32)
        self.assertEqual(labels.dtype, tf.int64)
        self.assertTrue(np.all((labels.numpy() >= 0) & (labels.numpy() < image_data.NUM_CLASSES)))
        # Standardised [0, 1] pixels: within the range the mean/std map [0, 1] to.
        pixels = images.numpy() * _STD + _MEAN
        self.assertGreaterEqual(pixels.min(), -1e-5)
        self.assertLessEqual(pixels.max(), 1 + 1e-5)
        self.assertGreater(pixels.std(), 0.01)

    def test_train_is_endless_and_eval_is_one_pass(self):
        self.assertLen(list(_dataset("validation").take(100)), 6)  # 24 examples / 4.
        self.assertLen(list(_dataset("train").take(10)), 10)  # Repeats past 24 examples.

    def test_distortions_are_drawn_from_the_seed(self):
        raw = _raw("train")[0][0]
        seed = tf.constant([7, 3], tf.int64)
        plain = image_data.preprocess_train(raw, seed, 48, distortion=0.0)
        distorted = image_data.preprocess_train(raw, seed, 48, distortion=1.0)
        self.assertEqual(plain.shape, distorted.shape)
        self.assertGreater(float(tf.reduce_max(tf.abs(plain - distorted))), 1e-3)
        again = image_data.preprocess_train(raw, seed, 48, distortion=1.0)
        np.testing.assert_array_equal(distorted.numpy(), again.numpy())
        other = image_data.preprocess_train(raw, seed + 1, 48, distortion=1.0)
        self.assertGreater(float(tf.reduce_max(tf.abs(other - distorted))), 1e-3)

    def test_eval_is_the_central_crop(self):
        images, labels = next(iter(_dataset("validation")))
        raw = _raw("validation")[:4]
        for image, (raw_image, raw_label), label in zip(images.numpy(), raw, labels.numpy()):
            self.assertEqual(label, raw_label)
            height, width = raw_image.shape[:2]
            top, left = int((height - height * 0.875) / 2), int((width - width * 0.875) / 2)
            crop = raw_image[top : height - top, left : width - left].astype(np.float32) / 255.0
            expected = tf.image.resize(crop, (48, 48)).numpy()
            np.testing.assert_allclose(image * _STD + _MEAN, expected, atol=1e-5)

    @parameterized.parameters(False, True)
    def test_each_epoch_is_the_whole_split_reshuffled(self, thorough):
        labels = np.concatenate(
            [y for _, y in _batches(_dataset("train", thorough_shuffle=thorough), 12)]
        )
        first, second = labels[:TINY_EXAMPLES], labels[TINY_EXAMPLES:]
        np.testing.assert_array_equal(np.sort(first), np.arange(TINY_EXAMPLES))
        np.testing.assert_array_equal(np.sort(second), np.arange(TINY_EXAMPLES))
        self.assertFalse(np.array_equal(first, second))

    def test_within_shard_shuffling_changes_the_order(self):
        order = lambda thorough, seed=0: np.concatenate(
            [y for _, y in _batches(_dataset("train", thorough_shuffle=thorough, seed=seed), 6)]
        )
        standard, thorough = order(False), order(True)
        self.assertEqual(standard.shape, (24,))
        self.assertFalse(np.array_equal(standard, thorough))
        np.testing.assert_array_equal(standard, order(False))  # Seeded: repeatable.
        self.assertFalse(np.array_equal(standard, order(False, seed=1)))

    @parameterized.parameters(
        (False, 1.0, 4), (True, 0.5, 4), (False, 1.0, 5), (True, 0.5, 5), (True, 0.5, 7)
    )
    def test_resumed_batches_equal_uninterrupted_ones(self, thorough, distortion, batch_size):
        """From step k on, a dataset started at k gives an uninterrupted run's batches.

        Batches of 5 and 7 cross the 24-example epochs; 12 steps reach the third epoch.
        """
        make = lambda start_step: _dataset(
            "train",
            batch_size=batch_size,
            thorough_shuffle=thorough,
            distortion=distortion,
            seed=3,
            start_step=start_step,
        )
        uninterrupted = _batches(make(0), 12)
        for start in (1, 5, 6, 11):
            resumed = _batches(make(start), 12 - start)
            for step, (images, labels) in enumerate(resumed, start):
                np.testing.assert_array_equal(labels, uninterrupted[step][1], f"step {step}")
                np.testing.assert_array_equal(images, uninterrupted[step][0], f"step {step}")

    def test_fake_data_resumes_at_its_step(self):
        make = lambda start_step: _dataset("train", use_fake_data=True, start_step=start_step)
        uninterrupted = _batches(make(0), 7)
        for step, (images, labels) in enumerate(_batches(make(3), 4), 3):
            np.testing.assert_array_equal(images, uninterrupted[step][0])
            np.testing.assert_array_equal(labels, uninterrupted[step][1])


class InceptionRunDataTest(parameterized.TestCase):
    """`InceptionRun.train_dataset`, as the skeleton asks a fresh and a resumed run for it."""

    def setUp(self):
        super().setUp()
        flag_state.ensure_parsed()

    def _run(self, variant, **flags):
        values = dict(variant=variant, batch_size=5, image_size=32, seed=0, **flags)
        with flag_state.trainer_flags(inception_bn, **values):
            return inception_task.InceptionRun(inception_bn.config_from_flags(), TINY)

    @parameterized.parameters("inception", "bn_x5")  # Full and half distortion; thorough shuffle.
    def test_resumed_run_trains_on_the_uninterrupted_batches(self, variant):
        run = self._run(variant, data_dir=tiny_dir())
        tf.random.set_seed(0)  # As the skeleton sets it for --seed=0, the default.
        uninterrupted = _batches(run.train_dataset(0), 10)
        # Another global seed and other random work before: the data stays.
        tf.random.set_seed(5)
        tf.random.uniform([3])
        for step, (images, labels) in enumerate(_batches(run.train_dataset(6), 4), 6):
            np.testing.assert_array_equal(labels, uninterrupted[step][1])
            np.testing.assert_array_equal(images, uninterrupted[step][0])

    def test_fake_data_run_resumes_at_its_step(self):
        run = self._run("bn_x5", use_fake_data=True)
        uninterrupted = _batches(run.train_dataset(0), 6)
        for step, (images, _) in enumerate(_batches(run.train_dataset(5), 1), 5):
            np.testing.assert_array_equal(images, uninterrupted[step][0])


class DatasetSpecTest(parameterized.TestCase):
    def test_imagenet_is_known_without_its_data(self):
        spec = image_data.dataset_spec("imagenet2012", tempfile.mkdtemp())
        self.assertEqual(spec, image_data.IMAGENET_SPEC)
        self.assertEqual(
            (spec.num_classes, spec.eval_split, spec.min_crop_area, spec.eval_crop),
            (1000, "validation", 0.08, 0.875),
        )

    def test_fashion_mnist_spec_comes_from_its_info(self):
        if not os.path.isdir(os.path.join(FASHION_MNIST_DIR, "fashion_mnist")):
            self.skipTest(f"No fashion_mnist under {FASHION_MNIST_DIR}")
        spec = image_data.dataset_spec("fashion_mnist", FASHION_MNIST_DIR)
        self.assertEqual(spec, FASHION_MNIST)
        self.assertEqual(spec.splits, ("train", "test"))
        image_data.check_prepared(spec, FASHION_MNIST_DIR, 60_000)  # All there: no error.
        with self.assertRaisesRegex(
            errors.InputError,
            r"^A training batch cannot be larger than the 60000 training examples of "
            r"fashion_mnist's train split: pass --batch_size=60000 or less\. "
            r"Received: batch_size=60001$",
        ):
            image_data.check_prepared(spec, FASHION_MNIST_DIR, 60_001)

    @parameterized.named_parameters(
        ("unknown", "no_such_dataset_xyz", r"^--dataset=no_such_dataset_xyz is not a TFDS data "),
        ("misspelt", "fashion_mnst", r"^--dataset=fashion_mnst .*\(closest: fashion_mnist\)"),
        ("no_image_feature", "imdb_reviews", r"no 'image' and 'label' features.*'text'"),
    )
    def test_unusable_dataset_is_refused(self, name, message):
        with self.assertRaisesRegex(errors.MissingDataError, message) as caught:
            image_data.dataset_spec(name, tempfile.mkdtemp())
        self.assertLess(len(str(caught.exception)), 300)  # Not TFDS's list of every name.

    def test_unprepared_dataset_names_the_command(self):
        with self.assertRaisesRegex(errors.MissingDataError, r"tfds build fashion_mnist"):
            image_data.check_prepared(FASHION_MNIST, tempfile.mkdtemp(), 32)

    def test_fake_data_has_the_spec_classes(self):
        _, labels = next(iter(image_data.make_fake_dataset(64, 32, 0, False, num_classes=10)))
        self.assertEqual(labels.shape, (64,))
        self.assertEqual(set(labels.numpy()) <= set(range(10)), True)
        self.assertGreater(len(set(labels.numpy())), 5)


def _damaged_copy(damage, shard=1):
    """A copy of TinyImages whose train shard `shard` `damage(path)` altered; and that path."""
    data_dir = tempfile.mkdtemp()
    shutil.copytree(os.path.join(tiny_dir(), "tiny_images"), os.path.join(data_dir, "tiny_images"))
    path = image_data.shard_paths(TINY, data_dir)[shard]
    damage(path)
    return data_dir, path


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 100)


def _flip_a_data_byte(path):
    """Corrupts the data of the file's second record, keeping its size and framing."""
    with open(path, "r+b") as f:
        (length,) = np.frombuffer(f.read(8), "<u8")
        f.seek(12 + int(length) + 4 + 12 + 10)  # Past record 0 and record 1's header.
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


class CorruptDataTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("truncated", _truncate, r"record \d+ at byte \d+ claims \d+ bytes, past the end"),
        ("bad_checksum", _flip_a_data_byte, r"TensorFlow reads a corrupted record at \d+"),
    )
    def test_check_names_the_shard(self, damage, problem):
        data_dir, path = _damaged_copy(damage)
        with self.assertRaisesRegex(errors.CorruptDataError, problem) as caught:
            image_data.check_prepared(TINY, data_dir, 4)
        self.assertIn(f"has a corrupt shard, {path}: ", str(caught.exception))

    def test_large_data_sets_are_checked_by_size(self):
        """Above VERIFY_BYTES a truncation shows in the sizes; a bad checksum waits for reading."""
        truncated, path = _damaged_copy(_truncate)
        flipped, _ = _damaged_copy(_flip_a_data_byte)
        verify_bytes, data_checks.VERIFY_BYTES = data_checks.VERIFY_BYTES, 0
        try:
            with self.assertRaisesRegex(errors.CorruptDataError, f"corrupt shard, {path}: "):
                image_data.check_prepared(TINY, truncated, 4)
            image_data.check_prepared(TINY, flipped, 4)
        finally:
            data_checks.VERIFY_BYTES = verify_bytes

    def test_reading_error_names_the_shard(self):
        data_dir, path = _damaged_copy(_flip_a_data_byte, shard=2)
        with self.assertRaises(tf.errors.DataLossError) as caught:
            _batches(_dataset("train", data_dir=data_dir), 1)
        error = data_checks.corrupt_data_error(
            caught.exception, image_data.shard_paths(TINY, data_dir)
        )
        self.assertRegex(
            str(error),
            f"^The data file {path} is corrupt \\(TensorFlow: corrupted record at \\d+\\)",
        )


class GrayscaleDatasetTest(parameterized.TestCase):
    """fashion_mnist (28×28×1 PNG) through the same pipeline as ImageNet."""

    def setUp(self):
        super().setUp()
        if not os.path.isdir(os.path.join(FASHION_MNIST_DIR, "fashion_mnist")):
            self.skipTest(f"No fashion_mnist under {FASHION_MNIST_DIR}")

    def _dataset(self, split, **overrides):
        return _dataset(
            split, spec=FASHION_MNIST, data_dir=FASHION_MNIST_DIR, image_size=32, **overrides
        )

    @parameterized.parameters(*inception_recipes.RECIPES)
    def test_train_batches_are_rgb_at_image_size(self, variant):
        recipe = inception_recipes.RECIPES[variant]
        images, labels = next(
            iter(
                self._dataset(
                    "train", distortion=recipe.distortion, thorough_shuffle=recipe.thorough_shuffle
                )
            )
        )
        self.assertEqual(images.shape, (4, 32, 32, 3))
        pixels = images.numpy() * _STD + _MEAN
        # Grayscale repeated: the three channels agree up to the colour distortion,
        # which cannot colour a gray pixel (saturation and hue act on chroma only).
        np.testing.assert_allclose(pixels[..., 0], pixels[..., 2], atol=1e-5)
        self.assertTrue(np.all((labels.numpy() >= 0) & (labels.numpy() < 10)))

    def test_eval_is_the_whole_image_resized_labels_unshifted(self):
        images, labels = next(iter(self._dataset("test")))
        raw = _raw("test[:4]", name="fashion_mnist", data_dir=FASHION_MNIST_DIR)
        for image, (raw_image, raw_label), label in zip(images.numpy(), raw, labels.numpy()):
            self.assertEqual(raw_image.shape, (28, 28, 1))
            self.assertEqual(label, raw_label)  # TFDS labels as they are: no class offset.
            gray = tf.image.resize(raw_image.astype(np.float32) / 255.0, (32, 32)).numpy()
            np.testing.assert_allclose(image * _STD + _MEAN, np.repeat(gray, 3, -1), atol=1e-5)


if __name__ == "__main__":
    absltest.main()
