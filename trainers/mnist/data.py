"""MNIST from TensorFlow Datasets, held in memory, in a resumable deterministic order."""

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from trainers.run import data_checks

HOW_TO_GET = (
    "To get MNIST, omit --data_dir and TFDS downloads it into its default directory (needs "
    "network), or pass --data_dir=DIR of a prepared TFDS copy (DIR/mnist/3.0.1/)."
)
SPLITS = ("train", "test")
TRAIN_EXAMPLES = 60_000  # MNIST's train split, before TFDS has a copy to count.


def check_prepared(data_dir, batch_size, train_subset=None):
    """Checks, before the run claims --model_dir, that MNIST can serve it.

    With `data_dir`, both splits must be prepared there; without, TFDS's
    default directory is checked if it holds a copy (else TFDS downloads one).
    The shards of a copy must be intact (read whole, in a fraction of a
    second: `data_checks.check_tfds_data`), and one batch of `batch_size` no
    larger than the training examples (the first `train_subset` of them).

    Raises:
        errors.InputError: a `MissingDataError` naming where it looked and
            how to get MNIST, a `CorruptDataError` naming the shard, or a
            batch larger than the training examples.
    """
    if data_dir is not None or data_checks.prepared_version_dir(None, "mnist"):
        data_checks.check_tfds_data(data_dir, "mnist", SPLITS, HOW_TO_GET)
    examples = data_checks.split_sizes(data_dir, "mnist").get("train", TRAIN_EXAMPLES)
    if train_subset and train_subset < examples:
        examples, whose = train_subset, f"--train_subset={train_subset}"
    else:
        whose = "MNIST's train split"
    data_checks.check_batch_size(batch_size, examples, whose)


def load_mnist(data_dir, split, limit=None):
    """Returns `(images, labels)` of an MNIST split as NumPy arrays.

    Images are float32 in [0, 1], flattened to 784; labels int32. Read from
    `data_dir` with no download attempt; with `data_dir=None` from TFDS's
    default directory, downloading MNIST there first if it is missing.
    With `limit`, only the split's first `limit` examples are read, those a
    whole read returns first: a run on 600 examples decodes 600, not 60,000.

    Raises:
        ValueError: a `limit` below 1.
        errors.MissingDataError (a FileNotFoundError): when the prepared
            data set is not under `data_dir` (the message names the
            --data_dir flag and how to get MNIST).
        errors.CorruptDataError: when TensorFlow reads a bad record
            (naming the shard).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"`limit` must be at least 1 or None. Received: limit={limit}")
    dataset = data_checks.load_split("mnist", split, data_dir, HOW_TO_GET)
    if limit is not None:
        dataset = dataset.take(limit)
    try:
        # Batches of 10k rather than batch_size=-1, which aborts the process
        # (std::length_error) under tfds.testing.mock_data.
        batches = list(tfds.as_numpy(dataset.batch(10_000)))
    except tf.errors.DataLossError as error:  # In a copy not checked before (just downloaded).
        paths = tfds.builder("mnist", data_dir=data_dir).info.splits[split].filepaths
        raise data_checks.corrupt_data_error(error, [str(p) for p in paths]) from None
    images = np.concatenate([b["image"] for b in batches])
    labels = np.concatenate([b["label"] for b in batches])
    return images.reshape(len(images), -1).astype(np.float32) / 255.0, labels.astype(np.int32)


def example_order(num_examples, batch_size, seed, num_steps):
    """Indices of the examples for steps 0..num_steps-1, flattened.

    Each epoch is a fresh permutation drawn from one seeded generator, and
    every step takes `batch_size` consecutive indices, dropping each epoch's
    remainder. The order for step s depends only on (seed, s), so a resumed
    run sees exactly the batches a run without interruption would.
    """
    steps_per_epoch = num_examples // batch_size
    if steps_per_epoch == 0:  # `check_prepared` refuses it up front for the known splits.
        raise ValueError(
            f"The batch size exceeds the {num_examples} training examples. "
            f"Received: batch_size={batch_size}"
        )
    rng = np.random.RandomState(seed)
    epochs = -(-num_steps // steps_per_epoch)
    per_epoch = steps_per_epoch * batch_size
    return np.concatenate([rng.permutation(num_examples)[:per_epoch] for _ in range(epochs)])[
        : num_steps * batch_size
    ]


def make_dataset(images, labels, batch_size, seed, start_step, num_steps):
    """Training batches for steps `start_step`..`num_steps-1` as a tf.data set."""
    order = example_order(len(images), batch_size, seed, num_steps)
    order = order[start_step * batch_size :]
    images, labels = tf.constant(images), tf.constant(labels)
    return (
        tf.data.Dataset.from_tensor_slices(order)
        .batch(batch_size, drop_remainder=True)
        .map(lambda idx: (tf.gather(images, idx), tf.gather(labels, idx)))
        .prefetch(tf.data.AUTOTUNE)
    )
