"""Files written whole or not at all, and what a killed write leaves behind.

`write_bytes(path, data)` writes `data` into a temporary file beside `path`
and renames it over `path`. On a local disk it flushes the temporary file to
the disk (fsync) before the rename and the directory after it: at any instant
a kill or a power loss leaves the old file or the new one, never a mix, and
once `write_bytes` returns the new one survives a power loss. `commit` does
the same for a temporary file written by another writer (a TFRecord writer).

`sync` flushes files another library wrote (TensorFlow's event files and
checkpoints, orbax's steps), whose writers only flush their own buffers.

On an object store (a `gs://` path, written through `tf.io.gfile`) an object
appears whole when its writer closes, so a reader never sees half of one; but
a rename there is a copy and then a delete, and there is no fsync: a kill
between the copy and the delete leaves both names.

Every temporary name starts with `TEMP_PREFIX` and holds the writer's pid and
a random token, so no two writers share one, and none contains "tfevents"
(TensorBoard reads every file whose name does). A write killed before its
rename leaves its temporary file; `remove_leftovers` removes them (the chief
does, under the --model_dir lock, before it writes).
"""

import os
import shutil
import uuid

from trainers.run import fault_points
from trainers.run import model_dirs

TEMP_PREFIX = ".keras_bn-tmp."


def temporary_path(path):
    """A fresh temporary name in `path`'s directory, this process's own."""
    return os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{os.getpid()}.{uuid.uuid4().hex}")


def write_bytes(path, data):
    """Writes `data` to `path` atomically (see the module docstring)."""
    tmp = temporary_path(path)
    local = model_dirs.local_path(tmp)
    if local is None:
        import tensorflow as tf

        with tf.io.gfile.GFile(tmp, "wb") as f:
            f.write(data)
    else:
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    commit(tmp, path)


def write_text(path, text):
    """Writes `text` (UTF-8) to `path` atomically."""
    write_bytes(path, text.encode("utf-8"))


def commit(tmp, path):
    """Renames the written temporary file `tmp` over `path`, durably on a local disk.

    The fault point "rename <name of path>" comes just before the rename.
    """
    fault_points.reach(f"rename {os.path.basename(path)}")
    if model_dirs.local_path(path) is None:
        import tensorflow as tf

        tf.io.gfile.rename(tmp, path, overwrite=True)
        return
    tmp, path = model_dirs.local_path(tmp), model_dirs.local_path(path)
    _fsync(tmp, os.O_RDONLY)
    os.replace(tmp, path)
    _fsync(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)


def sync(paths):
    """Flushes `paths` (files, or directories whose files are flushed) to the disk, then
    their directories: written by another library's writer, which only flushes its buffers
    (TensorFlow's file writers and checkpoints). A no-op on an object store."""
    directories = set()
    for path in paths:
        local = model_dirs.local_path(path)
        if local is None:
            continue
        if os.path.isdir(local):
            for directory, _, files in os.walk(local):
                for name in files:
                    _fsync(os.path.join(directory, name), os.O_RDONLY)
                directories.add(directory)
        elif os.path.exists(local):
            _fsync(local, os.O_RDONLY)
        directories.add(os.path.dirname(local) or ".")
    for directory in sorted(directories, key=len, reverse=True):
        _fsync(directory, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path, flags):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(root):
    """Removes the temporary files and directories killed writes left under `root`.

    Returns their paths. Call it only while no other process writes under
    `root` (the chief, holding the --model_dir lock); another --model_dir
    nested inside (its own lock file there) is left alone.
    """
    local = model_dirs.local_path(root)
    if local is None:
        import tensorflow as tf

        found = [
            os.path.join(directory, name)
            for directory, subdirs, files in tf.io.gfile.walk(root)
            for name in subdirs + files
            if name.startswith(TEMP_PREFIX)
        ]
        for path in found:
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            elif tf.io.gfile.exists(path):
                tf.io.gfile.remove(path)
        return found
    found = []
    for directory, subdirs, files in os.walk(local):
        # Another --model_dir nested inside, with its own lock: its writers are not ours.
        subdirs[:] = [
            n for n in subdirs if not os.path.exists(os.path.join(directory, n, model_dirs.LOCK))
        ]
        for name in [n for n in subdirs if n.startswith(TEMP_PREFIX)]:
            subdirs.remove(name)
            found.append(os.path.join(directory, name))
            shutil.rmtree(found[-1], ignore_errors=True)
        for name in files:
            if name.startswith(TEMP_PREFIX):
                found.append(os.path.join(directory, name))
                os.remove(found[-1])
    return found
