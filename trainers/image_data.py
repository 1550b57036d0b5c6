"""Image-classification input pipelines over TFDS (imagenet2012, fashion_mnist, …) and fake data.

Any TFDS data set with `image` and `label` features serves: TFDS decodes
the images (JPEG for ImageNet, PNG for Fashion-MNIST) and numbers the
labels from 0 (imagenet2012 has 1000 classes, no background class), so
one pipeline serves all. What differs between data sets is decided in
one place, `dataset_spec`: the number of classes (from the data set's
info), its evaluation split ("validation", else "test"), and how far the
random crops and the evaluation crop may cut into the image.

TFDS cannot download ImageNet: place ILSVRC2012_img_train.tar and
ILSVRC2012_img_val.tar in <data_dir>/downloads/manual/ and run
`tfds build imagenet2012 --data_dir=<data_dir>` once (or let the first
`tfds.load` prepare it, which takes hours); then pass --data_dir.
"""

import dataclasses

import tensorflow as tf
import tensorflow_datasets as tfds

from trainers import preflight

IMAGENET = "imagenet2012"
NUM_CLASSES = 1000  # imagenet2012's; fake data uses it too.
HOW_TO_GET = (
    "TFDS cannot download ImageNet: put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar "
    "in DIR/downloads/manual/, run `tfds build imagenet2012 --data_dir=DIR` and pass "
    "--data_dir=DIR; or pass --use_fake_data for a smoke run."
)
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
        preflight.MissingDataError: TFDS knows no data set `name`, or it has
            no `image`/`label` features, no "train" split, or no evaluation split.
    """
    if name == IMAGENET:
        return IMAGENET_SPEC  # Known without building: ImageNet may not be prepared yet.
    try:
        info = tfds.builder(name, data_dir=data_dir).info
    except tfds.core.registered.DatasetNotFoundError as error:
        raise preflight.MissingDataError(f"--dataset={name}: {error}") from error
    features = info.features
    if "image" not in features or "label" not in features:
        raise preflight.MissingDataError(
            f"--dataset={name} has no 'image' and 'label' features (it has {list(features)})."
        )
    splits = list(info.splits) or ["train", "test"]  # Unprepared: the usual names.
    eval_split = next((s for s in ("validation", "test") if s in splits), None)
    if "train" not in splits or eval_split is None:
        raise preflight.MissingDataError(
            f"--dataset={name} needs a 'train' and a 'validation' or 'test' split; it has {splits}."
        )
    return DatasetSpec(name, features["label"].num_classes, eval_split)


def _standardize(image):
    return (image - _MEAN_RGB) / _STDDEV_RGB


def _as_rgb_float(image):
    """[0, 1] floats with 3 channels (grayscale repeated)."""
    image = tf.image.convert_image_dtype(image, tf.float32)
    if image.shape[-1] == 1:
        image = tf.image.grayscale_to_rgb(image)
    return image


def preprocess_train(image, image_size, distortion, min_crop_area=0.08):
    """Random-size crop, flip and photometric distortion scaled by `distortion`."""
    image = _as_rgb_float(image)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=min_crop_area,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(min_crop_area, 1.0),
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


def preprocess_eval(image, image_size, crop=0.875):
    """Single central crop of the fraction `crop` of the image, resized."""
    image = _as_rgb_float(image)
    if crop < 1:
        image = tf.image.central_crop(image, crop)
    image = tf.image.resize(image, (image_size, image_size))
    return _standardize(image)


def check_prepared(spec, data_dir):
    """Checks, without TensorFlow work, that both splits of `spec` are prepared under `data_dir`.

    Raises:
        preflight.MissingDataError: naming where it looked (and, for
            ImageNet, how to prepare it).
    """
    how_to_get = HOW_TO_GET if spec.name == IMAGENET else f"Run `tfds build {spec.name}`."
    preflight.check_tfds_data(data_dir, spec.name, spec.splits, how_to_get)


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
):
    """Batched (images, labels) for `split` of `spec`'s data set ("train" repeats forever).

    Raises:
        preflight.MissingDataError (a FileNotFoundError): when the data set is
            not prepared under `data_dir` (the message names --data_dir and
            --use_fake_data).
    """
    training = split == "train"
    if use_fake_data:
        return make_fake_dataset(batch_size, image_size, seed, training, spec.num_classes)
    try:
        dataset = tfds.load(
            spec.name,
            split=split,
            data_dir=data_dir,
            download=False,
            shuffle_files=training and thorough_shuffle,
            as_supervised=True,
        )
    except (AssertionError, FileNotFoundError, tfds.core.registered.DatasetNotFoundError) as error:
        how_to_get = (
            HOW_TO_GET if spec.name == IMAGENET else "Pass --use_fake_data for a smoke run."
        )
        raise preflight.MissingDataError(
            f"TFDS {spec.name!r} was not found under --data_dir={data_dir!r}. "
            f"{how_to_get} TFDS said: {error}"
        ) from error
    if training:
        # "Within-shard shuffling": shuffled file order and a 10× buffer.
        buffer = 10_000 if thorough_shuffle else 1_000
        dataset = dataset.repeat().shuffle(buffer, seed=seed)
        fn = lambda image, label: (
            preprocess_train(image, image_size, distortion, spec.min_crop_area),
            label,
        )
    else:
        fn = lambda image, label: (preprocess_eval(image, image_size, spec.eval_crop), label)
    return (
        dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(batch_size, drop_remainder=training)
        .prefetch(tf.data.AUTOTUNE)
    )


def make_fake_dataset(batch_size, image_size, seed, repeat, num_classes=NUM_CLASSES, num_batches=4):
    """Random images and labels of the real shapes (smoke runs, benchmarks)."""
    shape = (num_batches * batch_size, image_size, image_size, 3)
    images = tf.random.stateless_normal(shape, seed=(seed, 0))
    labels = tf.random.stateless_uniform(
        (num_batches * batch_size,), seed=(seed, 1), maxval=num_classes, dtype=tf.int32
    )
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    dataset = dataset.batch(batch_size, drop_remainder=True)
    return dataset.repeat() if repeat else dataset
