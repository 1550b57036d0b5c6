"""Checks of a trainer's --model_dir and data before any model is built.

Bad input then ends the trainer with one line on stderr and exit status 1
(`one_line_errors`), instead of a traceback minutes into a run. A model_dir
records which trainer wrote it (`MARKER`), so another trainer cannot write
its checkpoints and summaries over it.
"""

import contextlib
import json
import os
import re
import struct
import sys
import tempfile

from trainers import console

MARKER = "trainer.json"
LOCK = "trainer.lock"
# The data files this process reads (`reads_data_files`).
_DATA_FILES = []
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
    """Turns an `InputError` raised inside into `program: error: ...` on stderr, exit status 1.

    A Ctrl-C ends in one line too, exit status 130: where the run stood and
    its last checkpoint (`console.Interrupted`), or that it was interrupted.

    So too TensorFlow's `DataLossError`, a corrupt record met while reading
    data: the line names which of the files given to `reads_data_files`
    holds it (`corrupt_data_error`).
    """
    try:
        yield
    except InputError as error:
        sys.exit(f"{program}: error: {one_line(error)}")
    except console.Interrupted as interrupted:
        print(f"{program}: {interrupted}", file=sys.stderr)
        sys.exit(130)  # The shell's status for a Ctrl-C.
    except KeyboardInterrupt:
        print(f"{program}: interrupted; relaunch the same command to resume", file=sys.stderr)
        sys.exit(130)
    except _data_loss_errors() as error:
        named = corrupt_data_error(error, _DATA_FILES) if _DATA_FILES else None
        if named is None:
            raise  # Not from the data files: a traceback says more than a guess.
        sys.exit(f"{program}: error: {one_line(named)}")


def _data_loss_errors():
    """TensorFlow's `DataLossError` once TensorFlow is imported (before, nothing raises it)."""
    tf = sys.modules.get("tensorflow")
    return (tf.errors.DataLossError,) if tf is not None else ()


def one_line(message, limit=None):
    """`message` (an error, or any text) on one line, cut to `limit` characters if given."""
    text = " ".join(str(message).split())  # One line, whatever the message held.
    if limit is not None and len(text) > limit:
        return text[:limit] + "..."
    return text


def _is_remote(path):
    return "://" in path


def local_path(path):
    """`path` on this machine's file system (a `file://` URL's path), or None if remote."""
    if path.startswith("file://"):
        return path[len("file://") :]
    return None if _is_remote(path) else path


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
    """Checks that TFDS data set `name` is prepared under `data_dir` with intact shards of `splits`.

    Reads `dataset_info.json` of the newest version directory
    `data_dir/name/<version>/` (`data_dir=None`: TFDS's default directory; a
    remote `data_dir` is left to TFDS), lists its shard files and checks
    them as far as is cheap (`_corrupt_shard`): a small data set whole, a
    large one by its sizes.

    Raises:
        MissingDataError: naming where it looked, what is missing and
            `how_to_get` the data.
        CorruptDataError: naming the first shard found corrupt.
    """
    directory = data_dir or tfds_default_dir()
    if _is_remote(directory):
        return
    where = f"--data_dir={data_dir}" if data_dir else f"TFDS's default directory {directory}"
    version_dir = prepared_version_dir(directory, name)
    if version_dir is None:
        raise MissingDataError(
            f"{name} was not found under {where}: no {os.path.join(directory, name)}/<version>/"
            f"dataset_info.json. {how_to_get}"
        )
    info = _dataset_info(version_dir)
    shards = {} if info is None else _shards(version_dir, name, info)
    missing = ["dataset_info.json"] if info is None else _missing_files(version_dir, shards, splits)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise MissingDataError(
            f"{name} under {where} is incomplete: {version_dir} lacks "
            f"{', '.join(missing[:3])}{more}. {how_to_get}"
        )
    corrupt = _corrupt_shard(info, shards, splits)
    if corrupt:
        path, problem = corrupt
        raise CorruptDataError(
            f"{name} under {where} has a corrupt shard, {path}: {problem}. Delete {version_dir} "
            f"and prepare it again. {how_to_get}"
        )


def prepared_version_dir(data_dir, name):
    """The newest `data_dir/name/<version>/` (`data_dir=None`: TFDS's default), or None."""
    root = os.path.join(data_dir or tfds_default_dir(), name)
    versions = sorted(
        (v for v in (os.listdir(root) if os.path.isdir(root) else []) if v[:1].isdigit()),
        key=lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split(".")),
    )
    return os.path.join(root, versions[-1]) if versions else None


def split_sizes(data_dir, name):
    """`{split: examples}` of the newest local copy of `name` (`data_dir=None`: TFDS's default).

    Empty when there is no readable local copy (a remote `data_dir` included).
    """
    version_dir = None if _is_remote(data_dir or "") else prepared_version_dir(data_dir, name)
    info = version_dir and _dataset_info(version_dir)
    return {
        split["name"]: sum(int(n) for n in split.get("shardLengths", []))
        for split in (info or {}).get("splits", [])
    }


def check_batch_size(batch_size, num_examples, examples):
    """Raises `InputError` if one batch needs more than the `num_examples` training examples.

    `examples` says whose examples, for the message (e.g. "MNIST's train split").
    """
    if batch_size > num_examples:
        raise InputError(
            f"A training batch cannot be larger than the {num_examples} training examples of "
            f"{examples}: pass --batch_size={num_examples} or less. Received: "
            f"batch_size={batch_size}"
        )


def _dataset_info(version_dir):
    """The parsed `dataset_info.json` of `version_dir`, or None if it cannot be read."""
    try:
        with open(os.path.join(version_dir, "dataset_info.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _shards(version_dir, name, info):
    """`{split: [(shard path, records)]}` as `info` (a parsed dataset_info.json) lists them."""
    file_format = info.get("fileFormat", "tfrecord")
    shards = {}
    for split in info.get("splits", []):
        lengths = [int(n) for n in split.get("shardLengths", [])] or [None]
        shards[split["name"]] = [
            (
                os.path.join(
                    version_dir,
                    f"{name}-{split['name']}.{file_format}-{i:05d}-of-{len(lengths):05d}",
                ),
                records,
            )
            for i, records in enumerate(lengths)
        ]
    return shards


def _missing_files(directory, shards, splits):
    """The files of `splits` (in `shards`, from dataset_info.json) that `directory` lacks."""
    present = set(os.listdir(directory))
    missing = []
    for split in splits:
        if split not in shards:
            missing.append(f"split {split!r}")
            continue
        missing += [
            name for path, _ in shards[split] if (name := os.path.basename(path)) not in present
        ]
    return missing


class CorruptDataError(InputError):
    """A data file whose content is not what its data set's info says."""


# TFRecord framing: a record's header is its length (8 bytes) and the length's
# checksum (4 bytes); the data's checksum (4 bytes) follows the data.
_RECORD_HEADER = 12
_RECORD_FRAMING = _RECORD_HEADER + 4
# Splits up to this size are read whole before training, checksums included
# (a fifth of a second for Fashion-MNIST); larger ones only have their sizes
# summed, and their framing walked when the sizes disagree with
# dataset_info.json, since reading ImageNet's 1,000 shards takes many minutes.
# What these checks cannot see is named when training meets it
# (`one_line_errors`, `reads_data_files`).
VERIFY_BYTES = 256 * 2**20
_CHECK_BATCH = 16_384  # Records TensorFlow reads per step of a checksum pass.


def _corrupt_shard(info, shards, splits):
    """`(path, problem)` of the first TFRecord shard of `splits` that is not intact, or None.

    Sums each split's shard sizes (one `stat` per shard). Walks the record
    framing of every shard of a split of at most `VERIFY_BYTES`, then reads
    it through TensorFlow, which verifies the checksums; walks the framing of
    a larger split only when its sizes disagree with dataset_info.json's
    `numBytes`.
    """
    if info.get("fileFormat", "tfrecord") != "tfrecord":
        return None  # Other formats have other framing; TFDS checks them when reading.
    by_name = {split["name"]: split for split in info.get("splits", [])}
    for split in splits:
        size = sum(os.path.getsize(path) for path, _ in shards[split])
        examples = int(by_name[split].get("numBytes", 0))
        records = sum(n or 0 for _, n in shards[split])
        # TFDS records the examples' bytes; a Beam build, the files'.
        agrees = examples and size in (examples + _RECORD_FRAMING * records, examples)
        small = size <= VERIFY_BYTES
        if not small and (agrees or not examples):
            continue
        for path, expected in shards[split]:
            problem = _framing_problem(path, expected) or (small and _checksum_problem(path))
            if problem:
                return path, problem
    return None


def _checksum_problem(path, records=-1):
    """What TensorFlow finds reading `records` (-1: all) of TFRecord shard `path`, or None."""
    import tensorflow as tf

    try:
        for _ in tf.data.TFRecordDataset(path).take(records).batch(_CHECK_BATCH):
            pass
    except tf.errors.DataLossError as error:
        return f"TensorFlow reads a {_data_loss(error)[0]}"
    return None


def _data_loss(error):
    """`(what, offset)` of a TensorFlow `DataLossError`: its message's gist and byte offset.

    The offset (None if the message has none) is that of the bad record's
    header or data.
    """
    message = str(error)
    found = re.search(r"\w+ record at (\d+)", message)
    if found:
        return found.group(0), int(found.group(1))
    return message.split("[Op:")[0].split("}}")[-1].strip(), None


def _record_starts(path, stop=None):
    """The byte offsets at which the records of TFRecord file `path` start, and what breaks it.

    Reads each record's 8-byte length, not its data, so checksums go
    unchecked. Returns `(starts, problem)`: `problem` is None when the records
    tile the file exactly. With `stop`, ends at the first record starting at
    or after byte `stop`.
    """
    size = os.path.getsize(path)
    starts, offset = [], 0
    with open(path, "rb") as f:
        while offset < size and (stop is None or not starts or starts[-1] < stop):
            starts.append(offset)
            f.seek(offset)
            header = f.read(8)
            if len(header) < 8:
                return starts, f"the file ends inside the header of record {len(starts) - 1}"
            (length,) = struct.unpack("<Q", header)
            offset += length + _RECORD_FRAMING
            if offset > size:
                return starts, (
                    f"record {len(starts) - 1} at byte {starts[-1]} claims {length} bytes, past "
                    f"the end of the file ({size} bytes)"
                )
    return starts, None


def _framing_problem(path, expected=None):
    """What is wrong with TFRecord shard `path` holding `expected` records, or None."""
    starts, problem = _record_starts(path)
    if problem is None and expected is not None and len(starts) != expected:
        problem = f"it holds {len(starts)} records where dataset_info.json lists {expected}"
    return problem


def corrupt_data_error(error, shard_paths):
    """The `CorruptDataError` naming which of `shard_paths` a TensorFlow `DataLossError` came from.

    TensorFlow's message gives the offset of the bad record's header or data
    ("corrupted record at 4544") but not the file: the culprit is the shard
    with a record there (whose framing is broken, without an offset).
    """
    what, offset = _data_loss(error)
    local = [p for p in shard_paths if not _is_remote(p) and os.path.isfile(p)]
    if offset is None:
        named = [path for path in local if _record_starts(path)[1]]
    else:
        reaching = {}  # Shard: the records up to the one at `offset`.
        for path in local:
            starts, _ = _record_starts(path, stop=offset)
            for index in range(max(len(starts) - 2, 0), len(starts)):
                if starts[index] in (offset, offset - _RECORD_HEADER):
                    reaching[path] = index + 1
        named = list(reaching)
        if len(named) > 1:  # Shards of records alike in size: TensorFlow rereads each one.
            named = [path for path in named if _checksum_problem(path, reaching[path])] or named
    if len(named) == 1:
        return CorruptDataError(
            f"The data file {named[0]} is corrupt (TensorFlow: {what}): delete "
            f"{os.path.dirname(named[0])} and prepare the data set again."
        )
    where = ", ".join(named[:3]) or ", ".join(sorted({os.path.dirname(p) for p in shard_paths}))
    return CorruptDataError(
        f"A data file is corrupt (TensorFlow: {what}){', one of: ' + where if where else ''}; "
        "delete the data set's directory and prepare it again."
    )


def reads_data_files(paths):
    """Records `paths` as the data files this process reads, for `one_line_errors` to name.

    The checks before training see only what is cheap to see (`check_tfds_data`);
    a corrupt record met later ends the run in one line naming its file.
    """
    _DATA_FILES[:] = paths
