"""A run directory's TensorBoard event files, cut back to what a resumed run has committed.

A killed run may have logged summaries of steps after its last checkpoint,
and a kill inside a write leaves a truncated last record. A resumed run logs
those steps again, so before it writes, `keep_through(run_dir, step)`
rewrites the directory's event files to the events at or before `step`: each
point is then logged once. Files are rewritten atomically (temporary file,
then rename), so a kill during the rewrite leaves either version.

The end-of-run summaries of a run (HParams metrics, logged at its last
step) go to their own file, suffix `END_SUFFIX`: `remove_end` deletes it
when the run's end has to be logged again.
"""

import os

from absl import logging
from tensorboard.compat.proto import event_pb2
import tensorflow as tf

PATTERN = "events.out.tfevents.*"
END_SUFFIX = ".end"
_REWRITE_TMP = ".events_rewrite.tmp"  # No "tfevents" in it: TensorBoard never reads it.


def paths(run_dir):
    """The event files directly in `run_dir` (not in its subdirectories), oldest first."""
    return sorted(tf.io.gfile.glob(os.path.join(run_dir, PATTERN)))


def read_records(path):
    """The serialized events of `path`, up to a truncated or corrupt last record."""
    records = []
    try:
        for record in tf.data.TFRecordDataset(path):
            records.append(record.numpy())
    except tf.errors.DataLossError:
        logging.warning("%s ends in a truncated record (a killed write); it is dropped.", path)
    return records


def keep_through(run_dir, step):
    """Rewrites `run_dir`'s event files to hold only events of steps <= `step`.

    With `step == 0` (nothing committed) every event file is deleted: the
    run starts again and logs its step-0 events anew. Returns the number of
    events dropped from the files kept.
    """
    if step == 0:
        remove_all(run_dir)
        return 0
    dropped = 0
    for path in paths(run_dir):
        records = read_records(path)
        kept = [r for r in records if event_pb2.Event.FromString(r).step <= step]
        if len(kept) == len(records) and _ends_cleanly(path, records):
            continue
        dropped += len(records) - len(kept)
        _rewrite(path, kept)
    if dropped:
        logging.info(
            "Dropped %d events after step %d from %s (logged again).", dropped, step, run_dir
        )
    return dropped


def remove_end(run_dir):
    """Deletes the end-of-run event files of `run_dir` (suffix `END_SUFFIX`)."""
    for path in paths(run_dir):
        if path.endswith(END_SUFFIX):
            tf.io.gfile.remove(path)


def remove_all(directory):
    """Deletes the event files directly in `directory`: a root whose launch rewrites them all."""
    for path in paths(directory):
        tf.io.gfile.remove(path)


def _ends_cleanly(path, records):
    """Whether `records` (read from `path`) account for every byte of it: no torn tail."""
    framing = 16  # Length (8 bytes) and two CRC32Cs (4 each) around every record.
    return tf.io.gfile.stat(path).length == sum(len(r) + framing for r in records)


def _rewrite(path, records):
    tmp = os.path.join(os.path.dirname(path), _REWRITE_TMP)
    with tf.io.TFRecordWriter(tmp) as writer:
        for record in records:
            writer.write(record)
    tf.io.gfile.rename(tmp, path, overwrite=True)
