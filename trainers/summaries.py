"""TensorBoard and results-file helpers shared by the trainers."""

import json
import os

import tensorflow as tf


def write_flags(writer, flag_values):
    """Logs the run's flags as a Markdown table under the text tag 'flags'."""
    rows = ["| flag | value |", "|---|---|"]
    rows += [f"| {name} | {value} |" for name, value in sorted(flag_values.items())]
    with writer.as_default():
        tf.summary.text("flags", "\n".join(rows), step=0)
    writer.flush()


def write_json(path, payload):
    """Writes JSON atomically (temp file + rename): a kill never leaves half."""
    tmp = path + ".tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    tf.io.gfile.rename(tmp, path, overwrite=True)


def read_json(path, default):
    if not tf.io.gfile.exists(path):
        return default
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def flag_values(flag_holders):
    """Maps each holder's name to its value (for logging and summaries)."""
    return {holder.name: holder.value for holder in flag_holders}


def with_defaults(values, defaults):
    """Each key of `defaults` from `values`, or its default where that is None."""
    return {k: values[k] if values[k] is not None else d for k, d in defaults.items()}


def run_dir(model_dir, name):
    path = os.path.join(model_dir, name)
    tf.io.gfile.makedirs(path)
    return path
