"""A trainer's --model_dir: checked writable, owned by one trainer, locked by one launch.

A model_dir records which trainer wrote it (`MARKER`), so another trainer
cannot write its checkpoints and summaries over it, and holds an OS file lock
(`LOCK`) while a launch writes there.
"""

import json
import os
import tempfile

from trainers.run.errors import InputError

MARKER = "trainer.json"
LOCK = "trainer.lock"
# The OS locks this process holds, by directory: kept until the process ends,
# when the OS drops them, killed or not; a relaunch in the same process (a
# test's resume) keeps the one it holds.
_HELD_LOCKS = {}


def is_remote(path):
    return "://" in path


def local_path(path):
    """`path` on this machine's file system (a `file://` URL's path), or None if remote."""
    if path.startswith("file://"):
        return path[len("file://") :]
    return None if is_remote(path) else path


def check_model_dir(model_dir, trainer):
    """Creates `model_dir` if needed and checks that `trainer` may write into it.

    A remote path (gs://...) is only checked for another trainer's marker; a
    `file://` URL is checked as its local path.

    Raises:
        InputError: if `model_dir` is an existing file, cannot be created or
            written, or holds another trainer's run.
    """
    local = local_path(model_dir)
    if local is not None:
        if os.path.exists(local) and not os.path.isdir(local):
            raise InputError(f"--model_dir={model_dir} is an existing file; pass a directory.")
        try:
            os.makedirs(local, exist_ok=True)
            # A probe file: directory permissions alone do not show a
            # read-only file system, and root passes every permission check.
            with tempfile.TemporaryFile(dir=local):
                pass
        except OSError as error:
            raise InputError(
                f"--model_dir={model_dir} is not writable ({error.strerror or error}); "
                "pass a directory this user can write."
            ) from None
    owner = model_dir_owner(model_dir)
    if owner is not None and owner != trainer:
        raise InputError(
            f"--model_dir={model_dir} holds a run of {owner} ({os.path.join(model_dir, MARKER)}); "
            f"{trainer} does not write into it: pass another --model_dir."
        )


def model_dir_owner(model_dir):
    """The trainer recorded in `model_dir`'s marker, or None."""
    import tensorflow as tf  # Local: remote paths need tf.io.gfile, local checks do not.

    path = os.path.join(model_dir, MARKER)
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as f:
        text = f.read()
    try:
        return json.loads(text).get("trainer")
    except (json.JSONDecodeError, AttributeError):
        raise InputError(
            f"{path} is not a trainer marker ({len(text)} bytes of other content); if this "
            "directory holds the run you meant, delete that file and relaunch."
        ) from None


def lock_model_dir(model_dir):
    """Takes `model_dir`'s OS file lock for this process, so no second launch writes there.

    A remote directory (gs://...) has no OS lock and is not locked; a
    `file://` URL is locked as its local path.

    Raises:
        InputError: if another process holds the lock, naming its pid and host.
    """
    import fcntl
    import socket

    local = local_path(model_dir)
    key = None if local is None else os.path.realpath(local)
    if key is None or key in _HELD_LOCKS:
        return
    handle = open(os.path.join(local, LOCK), "a+")  # Held open until the process ends.
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise InputError(
            f"--model_dir={model_dir} is in use by {owner}, which holds {LOCK}; wait for that "
            "launch to end, or pass another --model_dir."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _HELD_LOCKS[key] = handle


def claim_model_dir(model_dir, trainer):
    """Locks `model_dir`, removes what killed writes left there, records `trainer` as its writer.

    The chief calls it once, before it writes anything else there.
    """
    from absl import logging
    import tensorflow as tf

    # Atomic files: a kill never leaves half a marker, and leaves temporary files to remove.
    from trainers.run import atomic_files
    from trainers.run import json_files

    tf.io.gfile.makedirs(model_dir)
    lock_model_dir(model_dir)
    removed = atomic_files.remove_leftovers(model_dir)
    if removed:
        logging.info(
            "Removed %d temporary files of killed writes under %s", len(removed), model_dir
        )
    json_files.write_json(os.path.join(model_dir, MARKER), {"trainer": trainer})
