"""Image-classification input pipelines over TFDS (imagenet2012, fashion_mnist, …) and fake data.

Any TFDS data set with `image` and `label` features serves: TFDS decodes
the images (JPEG for ImageNet, PNG for Fashion-MNIST) and numbers the
labels from 0 (imagenet2012 has 1000 classes, no background class), so
one pipeline serves all. What differs between data sets is decided in
one place, `dataset_spec`: the number of classes (from the data set's
info), its evaluation split ("validation", else "test"), and how far the
random crops and the evaluation crop may cut into the image.

The pipeline reads a prepared data set's shards itself (TFDS's file list
and example decoding), so that the training data is a function of (seed,
step): epoch e reads the shards (their order shuffled with a seed drawn from
(seed, e) under thorough_shuffle) through a shuffle buffer seeded from
(seed, e), the epochs follow one another, step s takes examples
s·B … s·B + B − 1 of that stream, and example i's crop, flip and colour
distortion are drawn from (seed, i). A run resumed at step s therefore
trains on the batches an uninterrupted run trains on from s, without
holding the data set in memory.

TFDS cannot download ImageNet: place ILSVRC2012_img_train.tar and
ILSVRC2012_img_val.tar in <data_dir>/downloads/manual/ and run
`tfds build imagenet2012 --data_dir=<data_dir>` once (or let the first
`tfds.load` prepare it, which takes hours); then pass --data_dir.
"""

import dataclasses

import tensorflow as tf

from trainers.inception import recipes as inception_recipes
from trainers.run import data_checks

IMAGENET = inception_recipes.PAPER_DATASET
NUM_CLASSES = 1000  # imagenet2012's; fake data uses it too.
HOW_TO_GET = (
    "TFDS cannot download ImageNet: put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar "
    "in DIR/downloads/manual/, run `tfds build imagenet2012 --data_dir=DIR` and pass "
    "--data_dir=DIR; or pass --use_fake_data for a smoke run."
)
FAKE_BATCHES = 4  # The distinct batches of fake data, repeated.
# Reading: TFDS's default interleave of the shards.
_CYCLE_LENGTH = 16
_BLOCK_LENGTH = 16
# The streams drawn from a run's seed: the epochs' order, the examples' distortions.
_ORDER, _DISTORTION = 0, 1
_GRAPH_SEED = 1  # Any fixed nonzero value (see `_training_stream`).
_MEAN_RGB = (0.485, 0.456, 0.406)
_STDDEV_RGB = (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What the pipeline needs to know about one TFDS data set.

    Attributes:
        name: the TFDS name.
        num_classes: labels are 0 … num_classes - 1.
        eval_split: the split evaluated on.
        min_crop_area: the smallest fraction of the image a random training
            crop keeps (Inception's 8% on ImageNet photographs; half on
            small centred images, where 8% of 28×28 would leave a few pixels).
        eval_crop: the central fraction kept for evaluation (87.5% on
            ImageNet; the whole image elsewhere).
    """

    name: str
    num_classes: int
    eval_split: str
    min_crop_area: float = 0.5
    eval_crop: float = 1.0

    @property
    def splits(self):
        return ("train", self.eval_split)


IMAGENET_SPEC = DatasetSpec(
    IMAGENET, NUM_CLASSES, "validation", min_crop_area=0.08, eval_crop=0.875
)


def dataset_spec(name, data_dir):
    """The `DatasetSpec` of TFDS data set `name`, from its info (read, never downloaded).

    Raises:
        errors.MissingDataError: TFDS knows no data set `name`, or it has
            no `image`/`label` features, no "train" split, or no evaluation
            split (`data_checks.classification_info`).
    """
    if name == IMAGENET:
        return IMAGENET_SPEC  # Known without building: ImageNet may not be prepared yet.
    info, eval_split = data_checks.classification_info(name, data_dir)
    return DatasetSpec(name, info.features["label"].num_classes, eval_split)


def _standardize(image):
    return (image - _MEAN_RGB) / _STDDEV_RGB


def _as_rgb_float(image):
    """[0, 1] floats with 3 channels (grayscale repeated)."""
    image = tf.image.convert_image_dtype(image, tf.float32)
    if image.shape[-1] == 1:
        image = tf.image.grayscale_to_rgb(image)
    return image


def preprocess_train(image, seed, image_size, distortion, min_crop_area=0.08):
    """Random-size crop, flip and photometric distortion scaled by `distortion`.

    Every random choice is drawn from `seed` (a stateless RNG seed, shape [2]),
    so one seed always gives one result.
    """
    crop, flip, brightness, saturation, hue, contrast = tf.unstack(
        tf.random.experimental.stateless_split(seed, 6)
    )
    image = _as_rgb_float(image)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        seed=crop,
        min_object_covered=min_crop_area,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(min_crop_area, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.slice(image, begin, size)
    image = tf.image.resize(image, (image_size, image_size))
    image = tf.image.stateless_random_flip_left_right(image, flip)
    if distortion > 0:
        image = tf.image.stateless_random_brightness(image, 32.0 / 255.0 * distortion, brightness)
        image = tf.image.stateless_random_saturation(
            image, 1 - 0.5 * distortion, 1 + 0.5 * distortion, saturation
        )
        image = tf.image.stateless_random_hue(image, 0.2 * distortion, hue)
        image = tf.image.stateless_random_contrast(
            image, 1 - 0.5 * distortion, 1 + 0.5 * distortion, contrast
        )
        image = tf.clip_by_value(image, 0.0, 1.0)
    return _standardize(image)


def preprocess_eval(image, image_size, crop=0.875):
    """Single central crop of the fraction `crop` of the image, resized."""
    image = _as_rgb_float(image)
    if crop < 1:
        image = tf.image.central_crop(image, crop)
    image = tf.image.resize(image, (image_size, image_size))
    return _standardize(image)


def check_prepared(spec, data_dir, batch_size):
    """Checks, before training, that `spec`'s data under `data_dir` can serve a run.

    Both splits must be prepared with intact shards (`data_checks.check_tfds_data`:
    a small data set is read whole, a large one checked by its sizes), and
    one batch of `batch_size` must fit in the training split.

    Raises:
        errors.InputError: a `MissingDataError` naming where it looked
            (and, for ImageNet, how to prepare it), a `CorruptDataError`
            naming the shard, or a batch larger than the training split.
    """
    how_to_get = HOW_TO_GET if spec.name == IMAGENET else f"Run `tfds build {spec.name}`."
    data_checks.check_tfds_data(data_dir, spec.name, spec.splits, how_to_get)
    examples = _builder(spec, data_dir).info.splits["train"].num_examples
    data_checks.check_batch_size(batch_size, examples, f"{spec.name}'s train split")


def shard_paths(spec, data_dir):
    """The files of both splits of `spec`'s data set under `data_dir`."""
    info = _builder(spec, data_dir).info
    return [str(path) for split in spec.splits for path in info.splits[split].filepaths]


def _builder(spec, data_dir):
    """The TFDS builder of `spec`'s data set, prepared under `data_dir`.

    Raises:
        errors.MissingDataError (a FileNotFoundError): when the data set is
            not prepared there (the message names --data_dir and
            --use_fake_data).
    """
    how_to_get = HOW_TO_GET if spec.name == IMAGENET else "Pass --use_fake_data for a smoke run."
    return data_checks.prepared_builder(spec.name, data_dir, how_to_get)


def make_dataset(
    *,
    split,
    data_dir,
    batch_size,
    image_size,
    distortion,
    thorough_shuffle,
    seed,
    use_fake_data,
    spec=IMAGENET_SPEC,
    start_step=0,
):
    """Batched (images, labels) for `split` of `spec`'s data set ("train" repeats forever).

    The training batches are those of steps `start_step`, `start_step + 1`, …
    of a run with `seed` (see the module docstring); getting to `start_step`
    reads, without decoding, the examples of its epoch before it (up to one
    epoch of records: for ImageNet minutes).

    Raises:
        errors.MissingDataError (a FileNotFoundError): when the data set is
            not prepared under `data_dir` (the message names --data_dir and
            --use_fake_data).
    """
    training = split == "train"
    if use_fake_data:
        dataset = make_fake_dataset(batch_size, image_size, seed, training, spec.num_classes)
        return dataset.skip(start_step % FAKE_BATCHES) if training else dataset
    info = _builder(spec, data_dir).info
    paths = [str(path) for path in info.splits[split].filepaths]
    if training:
        examples = _training_stream(
            paths, info.splits[split].num_examples, seed, start_step * batch_size, thorough_shuffle
        )

        def prepare(index, record):
            image, label = _image_and_label(info.features, record)
            seed_of_example = _key(seed, _DISTORTION, index)
            return (
                preprocess_train(
                    image, seed_of_example, image_size, distortion, spec.min_crop_area
                ),
                label,
            )
    else:
        examples = _read(tf.data.Dataset.from_tensor_slices(paths))

        def prepare(record):
            image, label = _image_and_label(info.features, record)
            return preprocess_eval(image, image_size, spec.eval_crop), label

    return (
        examples.map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(batch_size, drop_remainder=training)
        .prefetch(tf.data.AUTOTUNE)
    )


def _training_stream(paths, num_examples, seed, first, thorough_shuffle):
    """`(index, serialized example)` of a run's training stream, from index `first` on.

    Epoch e reads the shards `paths` (in an order shuffled under
    `thorough_shuffle`) through a shuffle buffer, both seeded from (`seed`,
    e); the epochs of `num_examples` each follow one another.
    """
    # "Within-shard shuffling": shuffled file order and a 10× buffer.
    buffer = 10_000 if thorough_shuffle else 1_000

    def epoch(number):
        # tf.data pairs a shuffle's seed with its graph's: a fixed seed for this
        # function's graph leaves the order to (seed, epoch), whatever the global
        # seed (and TensorFlow refuses a tensor seed under a global seed of 0).
        tf.compat.v1.set_random_seed(_GRAPH_SEED)
        file_seed, record_seed = tf.unstack(
            tf.random.stateless_uniform(
                [2], seed=_key(seed, _ORDER, number), minval=None, maxval=None, dtype=tf.int64
            )
        )
        files = tf.data.Dataset.from_tensor_slices(paths)
        if thorough_shuffle:
            files = files.shuffle(len(paths), seed=file_seed, reshuffle_each_iteration=False)
        return _read(files).shuffle(buffer, seed=record_seed, reshuffle_each_iteration=False)

    return (
        tf.data.Dataset.counter(first // num_examples)
        .flat_map(epoch)
        .skip(first % num_examples)  # Serialized records: nothing is decoded to get there.
        .enumerate(first)
    )


def _key(seed, stream, counter):
    """A stateless RNG seed (shape [2]) drawn from (`seed`, `stream`, `counter`)."""
    return tf.random.experimental.stateless_fold_in(tf.constant([seed, stream], tf.int64), counter)


def _read(files):
    """The serialized examples of the shard `files`, interleaved as TFDS reads them."""
    return files.interleave(
        tf.data.TFRecordDataset,
        cycle_length=_CYCLE_LENGTH,
        block_length=_BLOCK_LENGTH,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def _image_and_label(features, record):
    example = features.deserialize_example(record)
    return example["image"], example["label"]


def make_fake_dataset(
    batch_size, image_size, seed, repeat, num_classes=NUM_CLASSES, num_batches=FAKE_BATCHES
):
    """Random images and labels of the real shapes (smoke runs, benchmarks)."""
    shape = (num_batches * batch_size, image_size, image_size, 3)
    images = tf.random.stateless_normal(shape, seed=(seed, 0))
    labels = tf.random.stateless_uniform(
        (num_batches * batch_size,), seed=(seed, 1), maxval=num_classes, dtype=tf.int32
    )
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    dataset = dataset.batch(batch_size, drop_remainder=True)
    return dataset.repeat() if repeat else dataset
