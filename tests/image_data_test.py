"""The real input path on TFDS mock data (no network, no ImageNet) and on Fashion-MNIST.

`tfds.testing.mock_data` serves random encoded examples through the real
`tfds.load` call, so decoding, cropping, flipping, photometric distortion,
batching and the evaluation crop all run; for imagenet2012 with JPEG
colour images, for fashion_mnist with PNG grayscale ones. The data set
specs of a prepared data set are read from the Fashion-MNIST copy in
`../shared/data` beside the checkout when it is there.
"""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tests import data_dirs
from trainers import image_data
from trainers import inception_recipes
from trainers import preflight

FASHION_MNIST_DIR = data_dirs.SHARED_DATA
# Fashion-MNIST's spec, as dataset_spec derives it from the prepared copy.
FASHION_MNIST = image_data.DatasetSpec("fashion_mnist", 10, "test")

_MEAN = np.array((0.485, 0.456, 0.406))  # The standardisation of image_data.
_STD = np.array((0.229, 0.224, 0.225))


def _dataset(split, num_examples=24, **overrides):
    kwargs = dict(
        split=split,
        data_dir=tempfile.mkdtemp(),
        batch_size=4,
        image_size=48,
        distortion=1.0,
        thorough_shuffle=False,
        seed=0,
        use_fake_data=False,
    )
    kwargs.update(overrides)
    with tfds.testing.mock_data(num_examples=num_examples):
        return image_data.make_dataset(**kwargs)


def _raw(split, num_examples=24, name="imagenet2012"):
    with tfds.testing.mock_data(num_examples=num_examples):
        dataset = tfds.load(name, split=split, as_supervised=True, data_dir=tempfile.mkdtemp())
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

    def test_photometric_distortion_changes_pixels(self):
        raw = _raw("train")[0][0]
        tf.random.set_seed(0)
        plain = image_data.preprocess_train(raw, 48, distortion=0.0)
        tf.random.set_seed(0)
        distorted = image_data.preprocess_train(raw, 48, distortion=1.0)
        self.assertEqual(plain.shape, distorted.shape)
        self.assertGreater(float(tf.reduce_max(tf.abs(plain - distorted))), 1e-3)

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

    def test_within_shard_shuffling_changes_the_order(self):
        order = lambda thorough: np.concatenate(
            [
                labels.numpy()
                for _, labels in _dataset(
                    "train", num_examples=1200, thorough_shuffle=thorough
                ).take(8)
            ]
        )
        standard, thorough = order(False), order(True)
        self.assertEqual(standard.shape, (32,))
        self.assertFalse(np.array_equal(standard, thorough))
        np.testing.assert_array_equal(standard, order(False))  # Seeded: repeatable.


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
        image_data.check_prepared(spec, FASHION_MNIST_DIR)  # Both splits there: no error.

    @parameterized.named_parameters(
        ("unknown", "no_such_dataset_xyz", r"--dataset=no_such_dataset_xyz"),
        ("no_image_feature", "imdb_reviews", r"no 'image' and 'label' features.*'text'"),
    )
    def test_unusable_dataset_is_refused(self, name, message):
        with self.assertRaisesRegex(preflight.MissingDataError, message):
            image_data.dataset_spec(name, tempfile.mkdtemp())

    def test_unprepared_dataset_names_the_command(self):
        with self.assertRaisesRegex(preflight.MissingDataError, r"tfds build fashion_mnist"):
            image_data.check_prepared(FASHION_MNIST, tempfile.mkdtemp())

    def test_fake_data_has_the_spec_classes(self):
        _, labels = next(iter(image_data.make_fake_dataset(64, 32, 0, False, num_classes=10)))
        self.assertEqual(labels.shape, (64,))
        self.assertEqual(set(labels.numpy()) <= set(range(10)), True)
        self.assertGreater(len(set(labels.numpy())), 5)


class GrayscaleDatasetTest(parameterized.TestCase):
    """fashion_mnist (28×28×1 PNG) through the same pipeline as ImageNet."""

    def _dataset(self, split, **overrides):
        return _dataset(split, spec=FASHION_MNIST, image_size=32, **overrides)

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
        raw = _raw("test", name="fashion_mnist")[:4]
        for image, (raw_image, raw_label), label in zip(images.numpy(), raw, labels.numpy()):
            self.assertEqual(raw_image.shape, (28, 28, 1))
            self.assertEqual(label, raw_label)  # TFDS labels as they are: no class offset.
            gray = tf.image.resize(raw_image.astype(np.float32) / 255.0, (32, 32)).numpy()
            np.testing.assert_allclose(image * _STD + _MEAN, np.repeat(gray, 3, -1), atol=1e-5)


if __name__ == "__main__":
    absltest.main()
