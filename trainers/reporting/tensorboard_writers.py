"""Where the trainers write TensorBoard: run configs, root writers, layouts, BN health.

Each run's own scalars go through its task's `write_summaries` into the
run's writer (`trainers.run.run_state`); what is shared lives here: the
"config" text of a run, the writer of a model_dir's root (its layouts and
figures, rewritten each launch), custom-scalars layouts (one chart per
entry, with every run under the root that logs a matching tag as its own
line) and the BN layers' health monitor. Figures: `trainers.reporting.figures`.
"""

from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary
import tensorflow as tf

import keras_bn
from trainers.run import event_files


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


def root_writer(directory):
    """A writer of a model_dir root's own summaries (layouts, figures), written anew each launch.

    Each launch logs the root's summaries whole (the dashboards at its start,
    the figures at its end), so the files of earlier launches are deleted
    first: every root point is then in the event files once.
    """
    tf.io.gfile.makedirs(directory)
    event_files.remove_all(directory)
    return tf.summary.create_file_writer(directory)


def make_monitor(model, probe_data, group_by=None):
    """A `keras_bn.BatchNormMonitor` of `model` on `probe_data`, probed once here.

    The monitor works on every Keras backend. Its first probe runs before
    training starts, so a model it cannot read (no keras_bn layer, inputs it
    cannot reach) stops the run at once with the monitor's own error.
    """
    monitor = keras_bn.BatchNormMonitor(None, probe_data, group_by=group_by)
    monitor.health(model)
    return monitor
