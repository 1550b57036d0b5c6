"""Checks of a trainer's --model_dir and data before any model is built.

Bad input then ends the trainer with one line on stderr and exit status 1
(`one_line_errors`), instead of a traceback minutes into a run. A model_dir
records which trainer wrote it (`MARKER`), so another trainer cannot write
its checkpoints and summaries over it.
"""

import contextlib
import json
import os
import sys
import tempfile

MARKER = "trainer.json"
LOCK = "trainer.lock"
# The OS locks this process holds, by directory: kept until the process ends,
# when the OS drops them, killed or not; a relaunch in the same process (a
# test's resume) keeps the one it holds.
_HELD_LOCKS = {}


class InputError(ValueError):
    """Bad flags, --model_dir or data: reported as one line, without a traceback."""


class MissingDataError(InputError, FileNotFoundError):
    """A data set that is not (completely) where the flags say."""


@contextlib.contextmanager
def one_line_errors(program):
    """Turns an `InputError` raised inside into `program: error: ...` on stderr, exit status 1."""
    try:
        yield
    except InputError as error:
        message = " ".join(str(error).split())  # One line, whatever the message held.
        sys.exit(f"{program}: error: {message}")


def _is_remote(path):
    return "://" in path


def check_model_dir(model_dir, trainer):
    """Creates `model_dir` if needed and checks that `trainer` may write into it.

    A remote path (gs://...) is only checked for another trainer's marker.

    Raises:
        InputError: if `model_dir` is an existing file, cannot be created or
            written, or holds another trainer's run.
    """
    if not _is_remote(model_dir):
        if os.path.exists(model_dir) and not os.path.isdir(model_dir):
            raise InputError(f"--model_dir={model_dir} is an existing file; pass a directory.")
        try:
            os.makedirs(model_dir, exist_ok=True)
            # A probe file: directory permissions alone do not show a
            # read-only file system, and root passes every permission check.
            with tempfile.TemporaryFile(dir=model_dir):
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

    A remote directory (gs://...) has no OS lock and is not locked.

    Raises:
        InputError: if another process holds the lock, naming its pid and host.
    """
    import fcntl
    import socket

    key = os.path.realpath(model_dir)
    if _is_remote(model_dir) or key in _HELD_LOCKS:
        return
    handle = open(os.path.join(model_dir, LOCK), "a+")  # Held open until the process ends.
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
    """Locks `model_dir` and records `trainer` as its writer (the chief calls it once)."""
    import tensorflow as tf

    from trainers import summaries  # Atomic JSON: a kill never leaves half a marker.

    tf.io.gfile.makedirs(model_dir)
    lock_model_dir(model_dir)
    summaries.write_json(os.path.join(model_dir, MARKER), {"trainer": trainer})


def tfds_default_dir():
    """The directory TFDS reads when no data_dir is given (as TFDS resolves it)."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


def check_tfds_data(data_dir, name, splits, how_to_get):
    """Checks that TFDS data set `name` is prepared under `data_dir` with all shards of `splits`.

    Reads only `dataset_info.json` and lists the shard files of the newest
    version directory `data_dir/name/<version>/` (`data_dir=None`: TFDS's
    default directory; a remote `data_dir` is left to TFDS).

    Raises:
        MissingDataError: naming where it looked, what is missing and
            `how_to_get` the data.
    """
    directory = data_dir or tfds_default_dir()
    if _is_remote(directory):
        return
    where = f"--data_dir={data_dir}" if data_dir else f"TFDS's default directory {directory}"
    root = os.path.join(directory, name)
    versions = sorted(
        (v for v in (os.listdir(root) if os.path.isdir(root) else []) if v[:1].isdigit()),
        key=lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split(".")),
    )
    if not versions:
        raise MissingDataError(
            f"{name} was not found under {where}: no {root}/<version>/dataset_info.json. "
            f"{how_to_get}"
        )
    version_dir = os.path.join(root, versions[-1])
    missing = _missing_files(version_dir, name, splits)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise MissingDataError(
            f"{name} under {where} is incomplete: {version_dir} lacks "
            f"{', '.join(missing[:3])}{more}. {how_to_get}"
        )


def _missing_files(directory, name, splits):
    """The files of `splits` that `directory`'s dataset_info.json lists but the directory lacks."""
    info_path = os.path.join(directory, "dataset_info.json")
    try:
        with open(info_path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return ["dataset_info.json"]
    file_format = info.get("fileFormat", "tfrecord")
    by_name = {split["name"]: split for split in info.get("splits", [])}
    present = set(os.listdir(directory))
    missing = []
    for split in splits:
        if split not in by_name:
            missing.append(f"split {split!r}")
            continue
        shards = len(by_name[split].get("shardLengths", [])) or 1
        missing += [
            shard
            for i in range(shards)
            if (shard := f"{name}-{split}.{file_format}-{i:05d}-of-{shards:05d}") not in present
        ]
    return missing
