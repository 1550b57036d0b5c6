"""The real ImageNet input path on TFDS mock data (no network, no ImageNet).

`tfds.testing.mock_data` serves random JPEG-encoded examples through the
real `tfds.load("imagenet2012")` call, so decoding, cropping, flipping,
photometric distortion, batching and the evaluation central crop all run.
"""

import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from trainers import imagenet_data
from trainers import inception_recipes

_MEAN = np.array((0.485, 0.456, 0.406))  # The standardisation of imagenet_data.
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
        return imagenet_data.make_dataset(**kwargs)


def _raw(split, num_examples=24):
    with tfds.testing.mock_data(num_examples=num_examples):
        dataset = tfds.load(
            "imagenet2012", split=split, as_supervised=True, data_dir=tempfile.mkdtemp()
        )
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
        self.assertTrue(
            np.all((labels.numpy() >= 0) & (labels.numpy() < imagenet_data.NUM_CLASSES))
        )
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
        plain = imagenet_data.preprocess_train(raw, 48, distortion=0.0)
        tf.random.set_seed(0)
        distorted = imagenet_data.preprocess_train(raw, 48, distortion=1.0)
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


if __name__ == "__main__":
    absltest.main()
