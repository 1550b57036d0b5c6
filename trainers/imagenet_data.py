"""ImageNet input pipelines (TFDS imagenet2012) and a fake-data stand-in.

TFDS cannot download ImageNet: place ILSVRC2012_img_train.tar and
ILSVRC2012_img_val.tar in <data_dir>/downloads/manual/ and run
`tfds build imagenet2012 --data_dir=<data_dir>` once (or let the first
`tfds.load` prepare it, which takes hours); then pass --data_dir.
"""

import tensorflow as tf
import tensorflow_datasets as tfds

from trainers import preflight

NUM_CLASSES = 1000
SPLITS = ("train", "validation")
HOW_TO_GET = (
    "TFDS cannot download ImageNet: put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar "
    "in DIR/downloads/manual/, run `tfds build imagenet2012 --data_dir=DIR` and pass "
    "--data_dir=DIR; or pass --use_fake_data for a smoke run."
)
_MEAN_RGB = (0.485, 0.456, 0.406)
_STDDEV_RGB = (0.229, 0.224, 0.225)


def _standardize(image):
    return (image - _MEAN_RGB) / _STDDEV_RGB


def preprocess_train(image, image_size, distortion):
    """Random-size crop, flip and photometric distortion scaled by `distortion`."""
    image = tf.image.convert_image_dtype(image, tf.float32)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=0.08,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(0.08, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.slice(image, begin, size)
    image = tf.image.resize(image, (image_size, image_size))
    image = tf.image.random_flip_left_right(image)
    if distortion > 0:
        image = tf.image.random_brightness(image, 32.0 / 255.0 * distortion)
        image = tf.image.random_saturation(image, 1 - 0.5 * distortion, 1 + 0.5 * distortion)
        image = tf.image.random_hue(image, 0.2 * distortion)
        image = tf.image.random_contrast(image, 1 - 0.5 * distortion, 1 + 0.5 * distortion)
        image = tf.clip_by_value(image, 0.0, 1.0)
    return _standardize(image)


def preprocess_eval(image, image_size):
    """Single central crop of 87.5% of the image, resized."""
    image = tf.image.convert_image_dtype(image, tf.float32)
    image = tf.image.central_crop(image, 0.875)
    image = tf.image.resize(image, (image_size, image_size))
    return _standardize(image)


def check_prepared(data_dir):
    """Checks, without TensorFlow work, that both ImageNet splits are prepared under `data_dir`.

    Raises:
        preflight.MissingDataError: naming where it looked and how to prepare ImageNet.
    """
    preflight.check_tfds_data(data_dir, "imagenet2012", SPLITS, HOW_TO_GET)


def make_dataset(
    *, split, data_dir, batch_size, image_size, distortion, thorough_shuffle, seed, use_fake_data
):
    """Batched (images, labels) for `split` ("train" repeats forever).

    Raises:
        preflight.MissingDataError (a FileNotFoundError): when imagenet2012 is
            not prepared under `data_dir` (the message names --data_dir and
            --use_fake_data).
    """
    training = split == "train"
    if use_fake_data:
        return make_fake_dataset(batch_size, image_size, seed, repeat=training)
    try:
        dataset = tfds.load(
            "imagenet2012",
            split=split,
            data_dir=data_dir,
            download=False,
            shuffle_files=training and thorough_shuffle,
            as_supervised=True,
        )
    except (AssertionError, FileNotFoundError, tfds.core.registered.DatasetNotFoundError) as error:
        raise preflight.MissingDataError(
            f"ImageNet (TFDS 'imagenet2012') was not found under --data_dir={data_dir!r}. "
            f"{HOW_TO_GET} TFDS said: {error}"
        ) from error
    if training:
        # "Within-shard shuffling": shuffled file order and a 10× buffer.
        buffer = 10_000 if thorough_shuffle else 1_000
        dataset = dataset.repeat().shuffle(buffer, seed=seed)
        fn = lambda image, label: (preprocess_train(image, image_size, distortion), label)
    else:
        fn = lambda image, label: (preprocess_eval(image, image_size), label)
    return (
        dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(batch_size, drop_remainder=training)
        .prefetch(tf.data.AUTOTUNE)
    )


def make_fake_dataset(batch_size, image_size, seed, repeat, num_batches=4):
    """Random images and labels of the real shapes (smoke runs, benchmarks)."""
    shape = (num_batches * batch_size, image_size, image_size, 3)
    images = tf.random.stateless_normal(shape, seed=(seed, 0))
    labels = tf.random.stateless_uniform(
        (num_batches * batch_size,), seed=(seed, 1), maxval=NUM_CLASSES, dtype=tf.int32
    )
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    dataset = dataset.batch(batch_size, drop_remainder=True)
    return dataset.repeat() if repeat else dataset
