"""A run's event files after a kill or damage: a torn end is dropped, damage is refused."""

import os
import struct
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import tensorflow as tf

from tests import tensorboard_events
from trainers.run import event_files


def _run_dir(steps):
    """A run directory with one event file of one scalar per step in `steps`."""
    run_dir = tempfile.mkdtemp()
    writer = tf.summary.create_file_writer(run_dir)
    with writer.as_default():
        for step in steps:
            tf.summary.scalar("loss", float(step), step=step)
    writer.close()
    (path,) = event_files.paths(run_dir)
    return run_dir, path


def _offsets(path):
    """The byte offset and data length of each record of `path`."""
    with open(path, "rb") as f:
        data = f.read()
    out, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        out.append((offset, length))
        offset += 16 + length
    return out


class EventFilesTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("cut_in_the_header", 5),
        ("cut_in_the_data", 20),
        ("zeros_after_a_crash", None),
    )
    def test_a_torn_end_is_dropped_and_the_rest_kept(self, cut):
        run_dir, path = _run_dir([4, 8, 12])
        offset, length = _offsets(path)[-1]
        with open(path, "r+b") as f:
            if cut is None:  # A power loss may leave zeros where the last write was lost.
                f.seek(offset)
                f.write(b"\0" * (16 + length))
            else:
                f.truncate(offset + cut)
        with self.assertLogs("absl", level="WARNING"):
            event_files.keep_through(run_dir, 12)
        self.assertEqual(tensorboard_events.read_events(run_dir)["loss"], [(4, 4.0), (8, 8.0)])
        size = os.path.getsize(path)
        self.assertEqual(size, offset)  # Rewritten without the torn record.

    @parameterized.named_parameters(("length", 3), ("data", 14))
    def test_a_damaged_record_before_the_end_is_refused_and_the_file_kept(self, at):
        run_dir, path = _run_dir([4, 8, 12])
        offset, _ = _offsets(path)[2]  # The record of step 8 (the first is the file version).
        with open(path, "r+b") as f:
            f.seek(offset + at)
            byte = f.read(1)
            f.seek(offset + at)
            f.write(bytes([byte[0] ^ 0xFF]))
        with open(path, "rb") as f:
            damaged = f.read()
        with self.assertRaisesRegex(
            event_files.CorruptEventsError,
            rf"{path} has a damaged record at byte {offset} \(its (length|data)'s checksum "
            r"fails\), not a torn end: .* Restore the file from a copy, or move it out of its "
            r"directory to give up its points, then relaunch\.$",
        ):
            event_files.keep_through(run_dir, 4)  # A rewrite would drop steps 8 and 12.
        with open(path, "rb") as f:
            self.assertEqual(f.read(), damaged)

    def test_records_after_the_step_are_dropped_atomically(self):
        run_dir, path = _run_dir([4, 8, 12])
        self.assertEqual(event_files.keep_through(run_dir, 8), 1)
        self.assertEqual(tensorboard_events.read_events(run_dir)["loss"], [(4, 4.0), (8, 8.0)])
        self.assertEqual(os.listdir(run_dir), [os.path.basename(path)])


if __name__ == "__main__":
    absltest.main()
