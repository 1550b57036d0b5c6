"""A run directory's TensorBoard event files, cut back to what a resumed run has committed.

A killed run may have logged summaries of steps after its last checkpoint,
and a kill inside a write leaves a torn last record. A resumed run logs
those steps again, so before it writes, `keep_through(run_dir, step)`
rewrites the directory's event files to the events at or before `step`: each
point is then logged once. Files are rewritten atomically
(`trainers.run.atomic_files`), so a kill during the rewrite leaves either
version.

A torn end (a record cut short, or zeros where a crash lost the end of the
file) is what a killed write leaves, and is dropped. A record whose bytes are
all there but whose checksum fails is damage, not a kill: the records after
it cannot be trusted, nor dropped without losing committed points, so the
file is refused (`CorruptEventsError`) and left as it is.

The end-of-run summaries of a run (HParams metrics, logged at its last
step) go to their own file, suffix `END_SUFFIX`: `remove_end` deletes it
when the run's end has to be logged again.
"""

import os
import struct

from absl import logging
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
import tensorflow as tf

from trainers.run import atomic_files
from trainers.run import errors
from trainers.run import fault_points

PATTERN = "events.out.tfevents.*"
END_SUFFIX = ".end"
_FRAMING = 16  # Length (8 bytes) and two CRC32Cs (4 each) around every record.


class CorruptEventsError(errors.InputError):
    """An event file with a damaged record before its end: refused, never rewritten."""


def paths(run_dir):
    """The event files directly in `run_dir` (not in its subdirectories), oldest first."""
    return sorted(tf.io.gfile.glob(os.path.join(run_dir, PATTERN)))


def read_records(path):
    """The serialized events of `path`, without a torn end (see the module docstring).

    Raises:
        CorruptEventsError: if a record whose bytes are all there is damaged.
    """
    records = []
    try:
        for record in tf.data.TFRecordDataset(path):
            records.append(record.numpy())
    except tf.errors.DataLossError:
        pass  # Classified below: a torn end or damage.
    offset = sum(len(r) + _FRAMING for r in records)
    if offset < tf.io.gfile.stat(path).length:  # A header cut short reads as the file's end.
        damage = _damage(path, offset)
        if damage is not None:
            raise CorruptEventsError(
                f"{path} has a damaged record at byte {offset} ({damage}), not a torn end: "
                "the events after it cannot be read, and rewriting the file would lose them. "
                "Restore the file from a copy, or move it out of its directory to give up its "
                "points, then relaunch."
            )
        logging.warning("%s ends in a torn record (a killed write); it is dropped.", path)
    return records


def _damage(path, offset):
    """What is wrong with the record at byte `offset` of `path`, or None for a torn end."""
    with tf.io.gfile.GFile(path, "rb") as f:
        f.seek(offset)
        rest = f.read()
    if len(rest) < 12 or not any(rest):  # The header cut short, or zeros after a crash.
        return None
    (length,), (length_crc,) = struct.unpack("<Q", rest[:8]), struct.unpack("<I", rest[8:12])
    if masked_crc32c(rest[:8]) != length_crc:
        return "its length's checksum fails"
    if len(rest) < length + _FRAMING:  # The data cut short.
        return None
    return "its data's checksum fails"


def write_records(path, records):
    """Writes `records` (serialized events) as the event file `path`, atomically."""
    tmp = atomic_files.temporary_path(path)
    with tf.io.TFRecordWriter(tmp) as writer:
        for record in records:
            writer.write(record)
    atomic_files.commit(tmp, path)


def keep_through(run_dir, step):
    """Rewrites `run_dir`'s event files to hold only events of steps <= `step`.

    With `step == 0` (nothing committed) every event file is deleted: the
    run starts again and logs its step-0 events anew. Returns the number of
    events dropped from the files kept.

    Raises:
        CorruptEventsError: if a file has a damaged record (none is rewritten then).
    """
    if step == 0:
        remove_all(run_dir)
        return 0
    rewrites = []
    for path in paths(run_dir):
        records = read_records(path)
        kept = [r for r in records if event_pb2.Event.FromString(r).step <= step]
        if len(kept) < len(records) or not _ends_cleanly(path, records):
            rewrites.append((path, kept, len(records) - len(kept)))
    for path, kept, _ in rewrites:
        fault_points.reach("event rewrite")
        write_records(path, kept)
    dropped = sum(n for _, _, n in rewrites)
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
    """Deletes the event files directly in `directory`: a run that starts over logs them anew."""
    for path in paths(directory):
        tf.io.gfile.remove(path)


def _ends_cleanly(path, records):
    """Whether `records` (read from `path`) account for every byte of it: no torn tail."""
    return tf.io.gfile.stat(path).length == sum(len(r) + _FRAMING for r in records)
