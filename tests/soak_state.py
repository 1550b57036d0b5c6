"""What the fault soak reads of a run on disk: its commit point, its files, and their equality.

`committed_step` is where a relaunch must resume; `strict_json_problems`,
`leftovers` and `snapshot` are checked after every fault; `differences`
compares a faulted run's final state with the uninterrupted run's, bit for
bit: every variable of the newest checkpoint, `history.json` and
`summary.json` (timings aside), every TensorBoard point (each (tag, step)
once; scalars, histograms and text equal, images equal as decoded pixels),
and the figures as decoded pixels.
"""

import collections
import glob
import hashlib
import json
import os
import re

import numpy as np

from tests import run_outputs
from trainers.run import atomic_files

# Measured times: they differ between any two runs.
TIMING_TAGS = frozenset({"train/images_per_sec", "eval/precise_bn_seconds"})
FIGURES = ("figure1.png", "figure2.png", "lr_sweep.png")
_ORBAX_TMP = ".orbax-checkpoint-tmp"


def _history_steps(run_dir):
    path = os.path.join(run_dir, "history.json")
    try:
        with open(path) as f:
            return json.load(f).get("steps", 0)
    except (FileNotFoundError, ValueError):
        return None


def checkpoint_steps(run_dir):
    """The steps of the checkpoints in `run_dir/checkpoints` by their names (either engine's)."""
    directory = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    steps = set()
    for name in os.listdir(directory):
        match = re.fullmatch(r"ckpt-(\d+)\.index|(\d+)", name)
        if match:
            steps.add(int(match.group(1) or match.group(2)))
    return sorted(steps)


def readable(run_dir, step):
    """Whether checkpoint `step` of `run_dir` reads whole (every variable, either engine)."""
    try:
        _checkpoint_values(run_dir, step)
    except Exception:  # Any reader error: a damaged checkpoint.
        return False
    return True


def committed_step(run_dir):
    """The step a relaunch must resume at: the newest readable checkpoint the history covers."""
    bound = _history_steps(run_dir)
    if bound is None:
        return 0
    for step in reversed(checkpoint_steps(run_dir)):
        if step <= bound and readable(run_dir, step):
            return step
    return 0


def _checkpoint_values(run_dir, step):
    """`{name: array or bytes}` of every value in checkpoint `step` (TensorFlow's or orbax's)."""
    directory = os.path.join(run_dir, "checkpoints")
    prefix = os.path.join(directory, f"ckpt-{step}")
    if os.path.exists(prefix + ".index"):
        import tensorflow as tf

        reader = tf.train.load_checkpoint(prefix)
        return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    from absl import logging
    import jax
    import orbax.checkpoint as ocp

    from trainers.run import errors

    errors.quiet_abandoned_reads()  # A damaged checkpoint read here ends in debug lines too.

    # As NumPy arrays: a job's checkpoint names devices this process has not.
    path = os.path.join(directory, str(step), "default")
    checkpointer = ocp.PyTreeCheckpointer()
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # Orbax warns that a step's metadata is a level up.
    try:
        metadata = checkpointer.metadata(path).item_metadata
    finally:
        logging.set_verbosity(verbosity)
    layout = jax.tree.map(
        lambda _: ocp.ArrayRestoreArgs(restore_type=np.ndarray), getattr(metadata, "tree", metadata)
    )
    tree = checkpointer.restore(path, restore_args=layout)
    return {
        f"{owner}/{i}": np.asarray(value)
        for owner, values in tree.items()
        for i, value in enumerate(values)
    }


def strict_json_problems(model_dir):
    """The JSON files under `model_dir` that do not parse as strict JSON, with why."""
    problems = []
    for path in glob.glob(os.path.join(model_dir, "**", "*.json"), recursive=True):
        if "/checkpoints/" in path:  # Orbax's own files.
            continue
        try:
            run_outputs.read_strict_json(path)
        except ValueError as error:
            problems.append(f"{path}: {error}")
    return problems


def leftovers(model_dir, tmp_dirs):
    """What killed writes and workers left: temporary files, killed saves, scratch directories."""
    found = []
    for directory, subdirs, files in os.walk(model_dir):
        for name in subdirs + files:
            if (
                name.startswith(atomic_files.TEMP_PREFIX)
                or re.fullmatch(r"ckpt-\d+_temp|checkpoint\.tmp.*", name)
                or _ORBAX_TMP in name
            ):
                found.append(os.path.join(directory, name))
    for tmp_dir in tmp_dirs:
        if os.path.isdir(tmp_dir):
            found += [
                os.path.join(tmp_dir, n) for n in os.listdir(tmp_dir) if n.startswith("keras_bn_")
            ]
    return sorted(found)


def snapshot(model_dir):
    """Every file and directory under `model_dir`: its kind, size, mtime and content hash."""
    state = {}
    for directory, _, files in os.walk(model_dir):
        state[os.path.relpath(directory, model_dir)] = ("dir", os.stat(directory).st_mtime_ns)
        for name in files:
            path = os.path.join(directory, name)
            info = os.stat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            state[os.path.relpath(path, model_dir)] = (info.st_size, info.st_mtime_ns, digest)
    return state


def _events(directory, model_dir):
    """`({(tag, step): count}, {(tag, step): comparable value})` of `directory`'s event files.

    The value is the point's content: a scalar's, histogram's or text's
    tensor, an image's decoded pixels; `model_dir` is cut out of text.
    """
    import tensorflow as tf

    counts, values = collections.Counter(), {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                key = (value.tag, event.step)
                counts[key] += 1
                if value.tag in TIMING_TAGS:
                    continue
                plugin = value.metadata.plugin_data.plugin_name
                tensor = tf.make_ndarray(value.tensor) if value.HasField("tensor") else None
                if plugin == "images":
                    content = [np.asarray(tf.io.decode_png(png)) for png in tensor.flat[2:]]
                    content = [(p.shape, p.tobytes()) for p in content]
                elif plugin == "text":
                    content = [t.replace(model_dir.encode(), b"<model_dir>") for t in tensor.flat]
                elif plugin in ("scalars", "histograms"):
                    content = (tensor.dtype.str, tensor.shape, tensor.tobytes())
                else:  # HParams and layouts: their (tag, step) only (they hold start times).
                    content = plugin
                values[key] = content
    return counts, values


def _png_pixels(path):
    import tensorflow as tf

    with open(path, "rb") as f:
        return np.asarray(tf.io.decode_png(f.read()))


def _values_equal(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def differences(reference, faulted, run_dirs, tmp_dirs):
    """What differs between the faulted run's final state and the uninterrupted run's.

    Args:
        reference: the uninterrupted run's --model_dir.
        faulted: the faulted run's --model_dir.
        run_dirs: the run directories under each ("" for the root itself).
        tmp_dirs: the faulted workers' temporary directories.

    Returns:
        A list of one-line differences (empty when the states are equal).
    """
    found = []
    for name in ("summary.json",):
        want, got = (os.path.join(d, name) for d in (reference, faulted))
        if os.path.exists(want) and run_outputs.read_json(got) != run_outputs.read_json(want):
            found.append(f"{name} differs")
    for name in FIGURES:
        want, got = (os.path.join(d, name) for d in (reference, faulted))
        if os.path.exists(want) and not _values_equal(_png_pixels(got), _png_pixels(want)):
            found.append(f"{name}: other pixels")
    for run in sorted(set(run_dirs) | {""}):
        want_dir, got_dir = os.path.join(reference, run), os.path.join(faulted, run)
        label = run or "the root"
        if run:
            history = [
                run_outputs.read_json(os.path.join(d, "history.json")) for d in (want_dir, got_dir)
            ]
            if history[0] != history[1]:
                found.append(f"{label}/history.json differs")
            steps = [checkpoint_steps(d) for d in (want_dir, got_dir)]
            if steps[0] != steps[1]:
                found.append(f"{label}: checkpoints of steps {steps[1]}, not {steps[0]}")
            elif steps[0]:
                found += _checkpoint_differences(want_dir, got_dir, steps[0][-1], label)
        (want_counts, want_values), (got_counts, got_values) = (
            _events(want_dir, reference),
            _events(got_dir, faulted),
        )
        twice = sorted(k for k, n in got_counts.items() if n > 1)
        if twice:
            found.append(f"{label}: points logged more than once: {twice[:5]}")
        if set(got_counts) != set(want_counts):
            missing = sorted(set(want_counts) - set(got_counts))[:5]
            extra = sorted(set(got_counts) - set(want_counts))[:5]
            found.append(f"{label}: TensorBoard points missing {missing}, extra {extra}")
        unequal = sorted(
            k for k in set(want_values) & set(got_values) if want_values[k] != got_values[k]
        )
        if unequal:
            found.append(f"{label}: TensorBoard points of other values: {unequal[:5]}")
    left = leftovers(faulted, tmp_dirs)
    if left:
        found.append(f"left behind: {left[:5]}")
    return found


def _checkpoint_differences(want_dir, got_dir, step, label):
    want, got = _checkpoint_values(want_dir, step), _checkpoint_values(got_dir, step)
    if set(want) != set(got):
        return [
            f"{label}: checkpoint {step} holds other variables: {sorted(set(want) ^ set(got))[:5]}"
        ]
    unequal = sorted(name for name in want if not _values_equal(want[name], got[name]))
    if unequal:
        return [f"{label}: checkpoint {step} differs in {len(unequal)} values: {unequal[:5]}"]
    return []


def describe_values(run_dir, step):
    """How many values checkpoint `step` holds (for the report)."""
    return len(_checkpoint_values(run_dir, step))
