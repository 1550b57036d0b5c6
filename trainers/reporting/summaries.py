"""TensorBoard and results-file helpers shared by the trainers."""

import json

import tensorflow as tf

import keras_bn
from trainers.run import event_files


def write_config(writer, config_values):
    """Logs the run's whole configuration as a Markdown table, text tag 'config'."""
    rows = ["| setting | value |", "|---|---|"]
    rows += [f"| {name} | {value} |" for name, value in sorted(config_values.items())]
    with writer.as_default():
        tf.summary.text("config", "\n".join(rows), step=0)
    writer.flush()


def root_writer(directory):
    """A writer of a model_dir root's own summaries (layouts, figures), written anew each launch.

    Each launch logs the root's summaries whole (the dashboards at its start,
    the figures at its end), so the files of earlier launches are deleted
    first: every root point is then in the event files once.
    """
    tf.io.gfile.makedirs(directory)
    event_files.remove_all(directory)
    return tf.summary.create_file_writer(directory)


def write_json(path, payload):
    """Writes JSON atomically (temp file + rename): a kill never leaves half."""
    write_text(path, json.dumps(payload, indent=2, sort_keys=True))


def write_text(path, text):
    """Writes `text` atomically (temp file + rename): a kill never leaves half."""
    tmp = path + ".tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(text)
    tf.io.gfile.rename(tmp, path, overwrite=True)


def read_json(path, default):
    if not tf.io.gfile.exists(path):
        return default
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def flag_values(flag_holders):
    """Maps each holder's name to its value (for logging and summaries)."""
    return {holder.name: holder.value for holder in flag_holders}


def make_monitor(model, probe_data, group_by=None):
    """A `keras_bn.BatchNormMonitor` of `model` on `probe_data`, probed once here.

    The monitor works on every Keras backend. Its first probe runs before
    training starts, so a model it cannot read (no keras_bn layer, inputs it
    cannot reach) stops the run at once with the monitor's own error.
    """
    monitor = keras_bn.BatchNormMonitor(None, probe_data, group_by=group_by)
    monitor.health(model)
    return monitor
