"""The trainers' figures: drawn with matplotlib (no display), saved as PNG, logged as images."""

import io

import tensorflow as tf


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
