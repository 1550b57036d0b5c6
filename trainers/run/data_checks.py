"""Checks of a data set before training, and the file a corrupt record came from.

`check_tfds_data` looks at a prepared TFDS data set before any model is
built: its version directory, the shard files TFDS's own `DatasetInfo` lists
(`tfds.builder_from_directory`), and as far as is cheap their TFRecord
framing and checksums (TFDS checks no shard before reading it). What it
cannot see, a corrupt record met in training, `program.one_line_errors` names
through `name_corrupt_file`. The trainers get TFDS builders, splits and
infos through here too (`prepared_builder`, `load_split`,
`classification_info`), so a missing or unsuitable data set is one line.
"""

import difflib
import hashlib
import os
import re
import struct
import sys

from google.protobuf import json_format

from trainers.run.errors import CorruptDataError
from trainers.run.errors import InputError
from trainers.run.errors import MissingDataError
from trainers.run.model_dirs import is_remote

# The data files this process reads (`reads_data_files`).
_DATA_FILES = []


def tfds_default_dir():
    """The directory TFDS reads when no data_dir is given (as TFDS resolves it)."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


def check_tfds_data(data_dir, name, splits, how_to_get):
    """Checks that TFDS data set `name` is prepared under `data_dir` with intact shards of `splits`.

    Reads TFDS's info of the newest version directory
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
    if is_remote(directory):
        return
    where = f"--data_dir={data_dir}" if data_dir else f"TFDS's default directory {directory}"
    version_dir = prepared_version_dir(directory, name)
    if version_dir is None:
        raise MissingDataError(
            f"{name} was not found under {where}: no {os.path.join(directory, name)}/<version>/"
            f"dataset_info.json. {how_to_get}"
        )
    try:
        info = _dataset_info(version_dir)
    except _UNREADABLE_INFO as error:
        raise MissingDataError(
            f"{name} under {where} is incomplete: TFDS cannot read the info of {version_dir} "
            f"({type(error).__name__}: {' '.join(str(error).split())}). {how_to_get}"
        ) from None
    shards = _shards(info)
    missing = _missing_files(version_dir, shards, splits)
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
    info = _local_info(data_dir, name)
    return {split.name: split.num_examples for split in info.splits.values()} if info else {}


# What `fingerprint` reads of each end of a shard: its first and last records, or more.
FINGERPRINT_READ_BYTES = 64 * 1024


def fingerprint(data_dir, name):
    """What identifies the local copy of TFDS data set `name` (`data_dir=None`: TFDS's default).

    Its name and version as TFDS's info records them, and per split the
    examples, the shard files' total bytes and a SHA-256 `digest` of each
    shard's size and its first and last `FINGERPRINT_READ_BYTES` (the
    first and last records of a small shard, whole shards of a small data
    set): cheap (two reads per shard, whatever the data set's size), and
    other data under the same name, a cut copy or shards rewritten in
    another order differ in them. None when there is no readable local copy
    (a remote `data_dir`, mock data).
    """
    info = _local_info(data_dir, name)
    if info is None:
        return None
    return {
        "name": info.name,
        "version": str(info.version),
        "splits": {
            split.name: {
                "examples": split.num_examples,
                "bytes": sum(os.path.getsize(str(path)) for path in split.filepaths),
                "digest": _ends_digest([str(path) for path in split.filepaths]),
            }
            for split in info.splits.values()
        },
    }


def _ends_digest(paths):
    """The SHA-256 of each file's size, first and last `FINGERPRINT_READ_BYTES`, in order."""
    digest = hashlib.sha256()
    for path in paths:
        size = os.path.getsize(path)
        digest.update(struct.pack("<Q", size))
        with open(path, "rb") as f:
            digest.update(f.read(FINGERPRINT_READ_BYTES))
            f.seek(max(size - FINGERPRINT_READ_BYTES, 0))
            digest.update(f.read(FINGERPRINT_READ_BYTES))
    return digest.hexdigest()


def _local_info(data_dir, name):
    """TFDS's info of the newest local copy of `name`, or None (none readable, or remote)."""
    version_dir = None if is_remote(data_dir or "") else prepared_version_dir(data_dir, name)
    try:
        return _dataset_info(version_dir) if version_dir else None
    except _UNREADABLE_INFO:
        return None


def prepared_builder(name, data_dir, how_to_get):
    """The TFDS builder of `name` prepared under `data_dir`; else a `MissingDataError`."""
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
        prepared = builder.is_prepared()
    except (AssertionError, OSError, tfds.core.registered.DatasetNotFoundError):
        prepared = False
    if not prepared:
        raise MissingDataError(
            f"TFDS {name!r} was not found under --data_dir={data_dir!r}. {how_to_get}"
        )
    return builder


def load_split(name, split, data_dir, how_to_get):
    """`tfds.load` of `split` of `name` (downloading only into TFDS's default directory).

    A missing data set raises `MissingDataError` with `how_to_get` and TFDS's words.
    """
    import tensorflow_datasets as tfds

    try:
        return tfds.load(name, split=split, data_dir=data_dir, download=data_dir is None)
    except (AssertionError, OSError, tfds.core.registered.DatasetNotFoundError) as error:
        raise MissingDataError(
            f"TFDS {name!r} (split {split!r}) was not found under --data_dir={data_dir!r} "
            f"(None means TFDS's default). {how_to_get} TFDS said: {error}"
        ) from error


def classification_info(name, data_dir):
    """`(info, eval_split)` of image classification data set `name` (never downloaded).

    Raises `MissingDataError` if TFDS knows no `name` (naming close ones), or it
    has no `image`/`label` features, no "train" or no "validation"/"test" split.
    """
    import tensorflow_datasets as tfds

    try:
        info = tfds.builder(name, data_dir=data_dir).info
    except tfds.core.registered.DatasetNotFoundError:
        known = tfds.list_builders(with_community_datasets=False)
        close = difflib.get_close_matches(name.split(":")[0].split("/")[0], known, n=3)
        closest = f" (closest: {', '.join(close)})" if close else ""
        raise MissingDataError(
            f"--dataset={name} is not a TFDS data set{closest}. Pass the name of an image "
            "classification data set from https://www.tensorflow.org/datasets/catalog."
        ) from None
    features = info.features
    if "image" not in features or "label" not in features:
        raise MissingDataError(
            f"--dataset={name} has no 'image' and 'label' features (it has {list(features)})."
        )
    splits = list(info.splits) or ["train", "test"]  # Unprepared: the usual names.
    eval_split = next((s for s in ("validation", "test") if s in splits), None)
    if "train" not in splits or eval_split is None:
        raise MissingDataError(
            f"--dataset={name} needs a 'train' and a 'validation' or 'test' split; it has {splits}."
        )
    return info, eval_split


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
    """TFDS's `DatasetInfo` of the prepared `version_dir` (raises one of `_UNREADABLE_INFO`)."""
    import tensorflow_datasets as tfds

    return tfds.builder_from_directory(version_dir).info


# What TFDS raises for a missing dataset_info.json or features.json (an
# OSError, or a ValueError), and for garbled JSON (protobuf's parse error).
_UNREADABLE_INFO = (OSError, ValueError, json_format.Error)


def _shards(info):
    """`{split: [(shard path, records)]}` as TFDS's `info` lists them."""
    return {
        split.name: [(str(path), n) for path, n in zip(split.filepaths, split.shard_lengths)]
        for split in info.splits.values()
    }


def _missing_files(directory, shards, splits):
    """The files of `splits` (in `shards`, from TFDS's info) that `directory` lacks."""
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


# TFRecord framing: a record's header is its length (8 bytes) and the length's
# checksum (4 bytes); the data's checksum (4 bytes) follows the data.
_RECORD_HEADER = 12
_RECORD_FRAMING = _RECORD_HEADER + 4
# Splits up to this size are read whole before training, checksums included
# (a fifth of a second for Fashion-MNIST); larger ones only have their sizes
# summed, and their framing walked when the sizes disagree with
# dataset_info.json, since reading ImageNet's 1,000 shards takes many minutes.
# What these checks cannot see is named when training meets it
# (`program.one_line_errors`, `reads_data_files`).
VERIFY_BYTES = 256 * 2**20
_CHECK_BATCH = 16_384  # Records TensorFlow reads per step of a checksum pass.


def _corrupt_shard(info, shards, splits):
    """`(path, problem)` of the first TFRecord shard of `splits` that is not intact, or None.

    Sums each split's shard sizes (one `stat` per shard). Walks the record
    framing of every shard of a split of at most `VERIFY_BYTES`, then reads
    it through TensorFlow, which verifies the checksums; walks the framing of
    a larger split only when its sizes disagree with dataset_info.json's
    `num_bytes`.
    """
    if info.file_format.value != "tfrecord":
        return None  # Other formats have other framing; TFDS checks them when reading.
    for split in splits:
        size = sum(os.path.getsize(path) for path, _ in shards[split])
        examples = int(info.splits[split].num_bytes)
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
    local = [p for p in shard_paths if not is_remote(p) and os.path.isfile(p)]
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
    """Records `paths` as the data files this process reads, for `program.one_line_errors` to name.

    The checks before training see only what is cheap to see (`check_tfds_data`);
    a corrupt record met later ends the run in one line naming its file.
    """
    _DATA_FILES[:] = paths


def name_corrupt_file(error):
    """The `CorruptDataError` naming which data file a `DataLossError` came from, or None.

    None when this process recorded no data files (`reads_data_files`): a
    traceback then says more than a guess. Otherwise the error names the
    one file holding the bad record, or the candidates (`corrupt_data_error`).
    Also None for any error but TensorFlow's `DataLossError`.
    """
    tf = sys.modules.get("tensorflow")  # Before TensorFlow is imported, nothing raises it.
    if not _DATA_FILES or tf is None or not isinstance(error, tf.errors.DataLossError):
        return None
    return corrupt_data_error(error, _DATA_FILES)
