"""Where the trainers write TensorBoard: run configs, root writers, layouts, BN health.

Each run's own scalars go through its task's `write_summaries` into the
run's writer (`trainers.run.run_state`); what is shared lives here: the
"config" text of a run, the writers of a model_dir root's own summaries (its
layouts and figures, each part committed whole, `root_events`),
custom-scalars layouts (one chart per entry, with every run under the root
that logs a matching tag as its own line) and the BN layers' health monitor.
Figures: `trainers.reporting.figures`.
"""

import contextlib
import hashlib
import os
import shutil
import tempfile

from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary
import tensorflow as tf

import keras_bn
from trainers.run import event_files
from trainers.run import model_dirs

# A root's parts are event files of fixed names, replaced whole: "tfevents" makes TensorBoard
# read them.
ROOT_PREFIX = "events.out.tfevents.root."


def write_custom_scalars(writer, category, charts):
    """Logs a custom-scalars layout: `charts` maps each chart's title to its tag regexes."""
    layout = layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title=category,
                chart=[
                    layout_pb2.Chart(
                        title=title, multiline=layout_pb2.MultilineChartContent(tag=list(tags))
                    )
                    for title, tags in charts.items()
                ],
            )
        ]
    )
    with writer.as_default():
        tf.summary.experimental.write_raw_pb(
            custom_scalar_summary.pb(layout).SerializeToString(), step=0
        )
    writer.flush()


def write_config(writer, config_values):
    """Logs the run's whole configuration as a Markdown table, text tag 'config'."""
    rows = ["| setting | value |", "|---|---|"]
    rows += [f"| {name} | {value} |" for name, value in sorted(config_values.items())]
    with writer.as_default():
        tf.summary.text("config", "\n".join(rows), step=0)
    writer.flush()


@contextlib.contextmanager
def root_events(directory, part):
    """A writer of one part of a model_dir root's own summaries, committed whole at the end.

    The root's summaries (the dashboards a run logs at its start, the figures
    at its end) are logged again by every launch. Each part is one event file
    of a fixed name, `ROOT_PREFIX + part`: the writer writes into a staging
    directory outside the root (TensorBoard would read one inside it), of a
    name fixed by the root and the part so that a launch removes what a
    killed one left there, and when the block ends without an error its
    events replace that file atomically. A kill at any instant leaves the
    part as the last launch to finish it wrote it, never lost and never
    twice. Root event files of any other name (an older trainer's, one per
    launch) are then removed, their points being in the parts, unless the
    root is a run's directory too (a one-variant Inception run's).

    Args:
        directory: the model_dir root.
        part: the part's name ("dashboards", "figures").

    Yields:
        The `tf.summary` writer of the part.
    """
    tf.io.gfile.makedirs(directory)
    staging = _staging_dir(directory, part)
    shutil.rmtree(staging, ignore_errors=True)  # A killed launch's.
    writer = tf.summary.create_file_writer(staging)
    try:
        yield writer
        writer.flush()
        writer.close()
        records = [r for path in event_files.paths(staging) for r in event_files.read_records(path)]
        event_files.write_records(os.path.join(directory, ROOT_PREFIX + part), records)
        if not tf.io.gfile.exists(os.path.join(directory, "history.json")):
            for path in event_files.paths(directory):
                if not os.path.basename(path).startswith(ROOT_PREFIX):
                    tf.io.gfile.remove(path)
    finally:
        writer.close()
        shutil.rmtree(staging, ignore_errors=True)


def _staging_dir(directory, part):
    """Where `root_events` stages the root `directory`'s `part`: local, fixed per root and part."""
    local = model_dirs.local_path(directory)
    name = directory if local is None else os.path.realpath(local)
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"keras_bn_root_{digest}_{part}")


def make_monitor(model, probe_data, group_by=None):
    """A `keras_bn.BatchNormMonitor` of `model` on `probe_data`, probed once here.

    The monitor works on every Keras backend. Its first probe runs before
    training starts, so a model it cannot read (no keras_bn layer, inputs it
    cannot reach) stops the run at once with the monitor's own error.
    """
    monitor = keras_bn.BatchNormMonitor(None, probe_data, group_by=group_by)
    monitor.health(model)
    return monitor
