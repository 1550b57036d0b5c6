"""Reading the tags and scalar values of TensorBoard event files in tests."""

import glob
import os

import tensorflow as tf


def read_events(directory):
    """Returns {tag: [(step, value_or_None), ...]} from a run directory's events."""
    tags = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalar = None
                if value.metadata.plugin_data.plugin_name == "scalars":
                    scalar = float(tf.make_ndarray(value.tensor))
                tags.setdefault(value.tag, []).append((event.step, scalar))
    return tags


def read_plugins(directory):
    """Returns {tag: plugin name} of a run directory's events (histograms, images, ...)."""
    plugins = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                plugins[value.tag] = value.metadata.plugin_data.plugin_name
    return plugins
