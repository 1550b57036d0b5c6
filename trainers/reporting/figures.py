"""The trainers' figures: drawn with matplotlib (no display), saved as PNG, logged as images."""

import io

import tensorflow as tf

from trainers.run import atomic_files


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi=100):
    """Writes `fig` as a PNG to `path` atomically (a kill leaves the old file or the new one).

    `path` may be any tf.io.gfile path. Closes `fig`; returns the PNG bytes.
    """
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    png = buffer.getvalue()
    atomic_files.write_bytes(path, png)
    return png


def write_image(writer, tag, png, step, description):
    """Logs PNG bytes as the TensorBoard image `tag` at `step`."""
    with writer.as_default(step=step):
        tf.summary.image(tag, tf.io.decode_png(png)[None], description=description)
    writer.flush()
