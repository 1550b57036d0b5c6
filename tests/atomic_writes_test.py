"""The trainers' writes are whole or absent after a kill, durable, and leave nothing behind.

A kill is stood in for by an exception raised where the process would die:
at the rename that commits a file (`os.replace`), or inside a root part's
block. What must hold then is what a relaunch finds: the previous file whole,
its temporary file removable, the root's TensorBoard parts not lost.
"""

import os
import tempfile
from unittest import mock

from absl.testing import absltest
import tensorflow as tf

from tests import tensorboard_events
from trainers.reporting import figures
from trainers.reporting import tensorboard_writers
from trainers.run import atomic_files
from trainers.run import json_files


class _Killed(BaseException):
    """What a kill at the patched call stands in for (no handler of `Exception` catches it)."""


def _kill_at_rename():
    return mock.patch.object(os, "replace", side_effect=_Killed)


class AtomicFilesTest(absltest.TestCase):
    def test_a_kill_before_the_rename_keeps_the_old_file_and_leaves_a_removable_temporary(self):
        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "history.json")
        json_files.write_json(path, {"steps": 4})
        with _kill_at_rename(), self.assertRaises(_Killed):
            json_files.write_json(path, {"steps": 8})
        self.assertEqual(json_files.read_json(path, None), {"steps": 4})
        left = [n for n in os.listdir(directory) if n != "history.json"]
        self.assertLen(left, 1)
        self.assertTrue(left[0].startswith(atomic_files.TEMP_PREFIX), left)
        self.assertNotIn("tfevents", left[0])  # TensorBoard would read it.
        self.assertEqual(
            atomic_files.remove_leftovers(directory), [os.path.join(directory, left[0])]
        )
        self.assertEqual(os.listdir(directory), ["history.json"])

    def test_the_file_and_its_directory_are_flushed_to_disk(self):
        directory = tempfile.mkdtemp()
        synced = []
        real_fsync = os.fsync

        def fsync(fd):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real_fsync(fd)

        with mock.patch.object(os, "fsync", side_effect=fsync):
            atomic_files.write_text(os.path.join(directory, "table2.md"), "| a |")
        self.assertLen(synced, 2)
        self.assertTrue(os.path.basename(synced[0]).startswith(atomic_files.TEMP_PREFIX))
        self.assertEqual(synced[1], os.path.realpath(directory))

    def test_temporary_names_are_the_writers_own(self):
        path = os.path.join(tempfile.mkdtemp(), "summary.json")
        names = {atomic_files.temporary_path(path) for _ in range(100)}
        self.assertLen(names, 100)
        self.assertTrue(all(f".{os.getpid()}." in os.path.basename(n) for n in names))

    def test_leftover_temporary_directories_are_removed_at_any_depth(self):
        root = tempfile.mkdtemp()
        staging = atomic_files.temporary_path(os.path.join(root, "run", "figures"))
        os.makedirs(os.path.join(staging, "inner"))
        kept = os.path.join(root, "run", "history.json")
        with open(kept, "w") as f:
            f.write("{}")
        self.assertEqual(atomic_files.remove_leftovers(root), [staging])
        self.assertEqual(os.listdir(os.path.join(root, "run")), ["history.json"])

    def test_a_figure_killed_while_written_leaves_the_old_png(self):
        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "figure1.png")
        plt = figures.pyplot()
        old = figures.save_figure(plt.figure(figsize=(1, 1)), path)
        fig = plt.figure(figsize=(2, 2))
        with _kill_at_rename(), self.assertRaises(_Killed):
            figures.save_figure(fig, path)
        with open(path, "rb") as f:
            self.assertEqual(f.read(), old)


class RootEventsTest(absltest.TestCase):
    def _figure(self, writer, step):
        tensorboard_writers.write_custom_scalars(writer, "layout", {"a": ["^a$"]})
        with writer.as_default(step=step):
            tf.summary.scalar("figure_point", float(step))

    def test_each_launch_replaces_the_parts_and_a_killed_one_loses_nothing(self):
        root = tempfile.mkdtemp()
        # What an older trainer left: a root event file of its own name.
        legacy = tf.summary.create_file_writer(root)
        with legacy.as_default(step=0):
            tf.summary.scalar("legacy", 1.0)
        legacy.close()
        for _ in range(2):  # Two launches: each point once, the older trainer's file gone.
            with tensorboard_writers.root_events(root, "dashboards") as writer:
                self._figure(writer, 0)
            with tensorboard_writers.root_events(root, "figures") as writer:
                with writer.as_default(step=40):
                    tf.summary.scalar("figure_point", 40.0)
        points = tensorboard_events.read_events(root)
        self.assertEqual(points["figure_point"], [(0, 0.0), (40, 40.0)])
        self.assertNotIn("legacy", points)
        self.assertEqual(
            sorted(os.listdir(root)),
            [
                tensorboard_writers.ROOT_PREFIX + "dashboards",
                tensorboard_writers.ROOT_PREFIX + "figures",
            ],
        )

        # A launch killed while it writes a part: the last finished launch's part stays.
        with self.assertRaises(_Killed):
            with tensorboard_writers.root_events(root, "figures") as writer:
                with writer.as_default(step=40):
                    tf.summary.scalar("figure_point", -1.0)
                raise _Killed
        with _kill_at_rename(), self.assertRaises(_Killed):
            with tensorboard_writers.root_events(root, "figures") as writer:
                with writer.as_default(step=40):
                    tf.summary.scalar("figure_point", -2.0)
        self.assertEqual(
            tensorboard_events.read_events(root)["figure_point"], [(0, 0.0), (40, 40.0)]
        )
        atomic_files.remove_leftovers(root)
        self.assertLen(os.listdir(root), 2)


if __name__ == "__main__":
    absltest.main()
