"""TensorBoard and results-file helpers shared by the trainers."""

import json

from absl import logging
import keras
import tensorflow as tf

import keras_bn


def write_config(writer, config_values):
    """Logs the run's whole configuration as a Markdown table, text tag 'config'."""
    rows = ["| setting | value |", "|---|---|"]
    rows += [f"| {name} | {value} |" for name, value in sorted(config_values.items())]
    with writer.as_default():
        tf.summary.text("config", "\n".join(rows), step=0)
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


def make_monitor(model, probe_data, group_by=None):
    """A `keras_bn.BatchNormMonitor` of `model` on `probe_data`, or None where it cannot probe.

    Off TensorFlow the monitor's probe is tried once here: where it fails
    (its TensorFlow-compiled probe cannot call a model of another backend),
    the run goes on without BN health summaries and says so in the log.
    """
    monitor = keras_bn.BatchNormMonitor(None, probe_data, group_by=group_by)
    if keras.backend.backend() == "tensorflow":
        return monitor
    try:
        monitor.health(model)
    except Exception as error:  # noqa: BLE001  (any failure of the probe: logged, then skipped)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        logging.warning(
            "BatchNormMonitor does not run under KERAS_BACKEND=%s (%s: %s); this run logs "
            "no bn_* health summaries.",
            keras.backend.backend(),
            type(error).__name__,
            first_line,
        )
        return None
    return monitor
