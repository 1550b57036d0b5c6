"""TensorBoard report pieces shared by the trainers: custom-scalars layouts and figure images.

A custom-scalars layout at a model_dir's root draws one chart per entry,
with every run under the root that logs a matching tag as its own line;
`save_figure` renders a matplotlib figure to PNG (file and bytes) and
`write_image` logs those bytes as a TensorBoard image.
"""

import io

from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary
import tensorflow as tf


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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


def save_figure(fig, path, dpi=100):
    """Writes `fig` as a PNG to `path` (any tf.io.gfile path), closes it, returns the bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    png = buffer.getvalue()
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(png)
    return png


def write_image(writer, tag, png, step, description):
    """Logs PNG bytes as the TensorBoard image `tag` at `step`."""
    with writer.as_default(step=step):
        tf.summary.image(tag, tf.io.decode_png(png)[None], description=description)
    writer.flush()
