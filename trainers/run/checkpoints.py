"""A run's checkpoints, on either engine, and how a run finds the one to resume from.

`TFCheckpointer` keeps them with `tf.train.CheckpointManager` (TensorFlow's
multi-worker save recipe included), `OrbaxCheckpointer` with orbax's
`CheckpointManager` on JAX. Orbax does not save TensorFlow's distributed
variables, so each engine keeps its own library's manager; both resume
through `restore_newest_readable`, the one loop that passes over damaged
checkpoints.
"""

import os
import shutil
import tempfile

from absl import logging
import tensorflow as tf

from trainers.reporting import console
from trainers.run import errors
from trainers.run import model_dirs


def restore_newest_readable(candidates, read, where):
    """Restores the newest readable of `candidates`; returns its step (0 if there are none).

    An unreadable checkpoint (damaged, missing files or, on TensorFlow,
    another model's objects) is logged in one line and the one before it
    tried. Damaged files raise whatever their reader hits first (a
    TensorFlow `OpError`, tensorstore's `ValueError`, a JSON error, an
    `OSError`, an `IndexError` for "read less bytes than requested"), so any
    exception but an `errors.InputError` marks a checkpoint unreadable.

    Args:
        candidates: `[(step, path)]`, newest first.
        read: `read(step, path)` restores that checkpoint and returns its step.
        where: the checkpoints' directory, named in the error.

    Raises:
        errors.InputError: if checkpoints exist and none is readable (or
            `read` raises one).
    """
    unreadable = []
    for step, path in candidates:
        try:
            restored = read(step, path)
        except errors.InputError:
            raise
        except Exception as error:
            logging.warning(
                "Checkpoint %s is unreadable, trying an older one: %s", path, _one_line(error)
            )
            unreadable.append((path, error))
            continue
        logging.info("Resumed from %s at step %d", path, restored)
        return restored
    if unreadable:
        raise errors.InputError(
            f"No checkpoint in {where} is readable ({', '.join(p for p, _ in unreadable)}; "
            f"the newest: {_one_line(unreadable[0][1])}); move them away to start the run "
            "over, or pass another --model_dir."
        )
    return 0


def _one_line(error, limit=300):
    """`error` as one line of at most about `limit` characters: its type and message.

    A tensorstore error's trailing spec (a JSON dump of the reader's
    settings) is left out: the cause comes before it.
    """
    text = str(error).split(" [tensorstore_spec=")[0]
    return f"{type(error).__name__}: {console.one_line(text, limit)}"


def checkpoint_prefixes(checkpoint_dir):
    """`[(step, prefix)]` of the checkpoints in `checkpoint_dir` by their files, newest first.

    A prefix is `.../ckpt-<step>`, found by its `.index` file: TensorFlow's
    `checkpoint` state file may be lost or garbled.
    """
    found = []
    for index in tf.io.gfile.glob(os.path.join(checkpoint_dir, "ckpt-*.index")):
        prefix = index[: -len(".index")]
        step = prefix.rsplit("-", 1)[1]
        if step.isdigit():
            found.append((int(step), prefix))
    return sorted(found, reverse=True)


def _readable(prefix):
    """Whether TensorFlow reads the index of the checkpoint at `prefix`."""
    try:
        tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError):
        return False
    return True


class TFCheckpointer:
    """A run's `tf.train.Checkpoint` of its step, model and optimizer.

    In a multi-worker run every worker must take part in a checkpoint save
    (the save reads distributed variables collectively), so each non-chief
    worker saves into its own temporary directory, outside `run_dir`,
    deleted by `close` (TensorFlow's multi-worker recipe). Every worker
    restores from the chief's checkpoints in `run_dir`, so a relaunch of all
    workers resumes at the chief's step.

    The chief's checkpoints are found by their files (`ckpt-<step>.index`),
    not only through TensorFlow's `checkpoint` state file: a lost or garbled
    state file is rebuilt from them, so no checkpoint is forgotten (and
    none deleted). An unreadable checkpoint is reported in one log line and
    the next older one restored. A killed save's `ckpt-<step>_temp`
    directory is removed.
    """

    def __init__(self, run_dir, max_to_keep, is_chief, step, model, optimizer):
        self._step = step
        # Keras' seed generators (dropout's random state) are model variables
        # but not weights, which is all a Checkpoint of the model tracks: without
        # them a resumed run would draw the dropout masks of the first steps again.
        weights = {id(w) for w in model.weights}
        seeds = [v for v in model.variables if id(v) not in weights]
        self._checkpoint = tf.train.Checkpoint(
            step=step, model=model, optimizer=optimizer, seeds=seeds
        )
        self._chief_dir = os.path.join(run_dir, "checkpoints")
        self._scratch = None if is_chief else tempfile.mkdtemp(prefix="keras_bn_worker_")
        if is_chief:
            self._repair_chief_dir()
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, self._scratch or self._chief_dir, max_to_keep=max_to_keep
        )

    def _repair_chief_dir(self):
        """Removes killed saves (their temporary directories, and checkpoints TensorFlow had
        not committed and cannot read); rebuilds a lost or garbled state file."""
        for temp in tf.io.gfile.glob(os.path.join(self._chief_dir, "ckpt-*_temp")):
            tf.io.gfile.rmtree(temp)
        # None when the file is missing or garbled (TensorFlow logs the parse error).
        state = tf.train.get_checkpoint_state(self._chief_dir)
        listed = {os.path.basename(p) for p in state.all_model_checkpoint_paths} if state else set()
        for _, prefix in checkpoint_prefixes(self._chief_dir):
            # TensorFlow commits a save by listing it in the state file, last:
            # an unlisted one it cannot read is a save killed while its index
            # was written (a first save's too, before any state file exists).
            if os.path.basename(prefix) not in listed and not _readable(prefix):
                logging.warning("Removed %s: a save killed before its commit.", prefix)
                for path in tf.io.gfile.glob(prefix + ".*"):
                    tf.io.gfile.remove(path)
        prefixes = [prefix for _, prefix in checkpoint_prefixes(self._chief_dir)]
        if not prefixes:
            return
        if not {os.path.basename(p) for p in prefixes} <= listed:
            logging.warning(
                "The checkpoint state file of %s is missing, garbled or incomplete: rebuilt "
                "from the %d checkpoints there.",
                self._chief_dir,
                len(prefixes),
            )
            tf.compat.v1.train.update_checkpoint_state(
                self._chief_dir, prefixes[0], all_model_checkpoint_paths=prefixes[::-1]
            )

    def restore(self):
        """Restores the chief's newest readable checkpoint, if any; returns its step (0 if none).

        A checkpoint of another model (its objects do not match) counts as
        unreadable: the one before it is tried (`restore_newest_readable`).
        """

        def read(step, prefix):
            self._checkpoint.restore(prefix).assert_existing_objects_matched()
            return int(self._step.numpy())

        return restore_newest_readable(checkpoint_prefixes(self._chief_dir), read, self._chief_dir)

    def save(self, step):
        """Checkpoints at `step` (every worker, each into its own directory)."""
        self._step.assign(step)
        self._manager.save(checkpoint_number=step)

    def close(self):
        """Removes a non-chief worker's scratch checkpoints."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


class OrbaxCheckpointer:
    """A run's checkpoints through `orbax.checkpoint`: every model and optimizer value by step.

    `run_dir/checkpoints/<step>/`, one `orbax.checkpoint.CheckpointManager`
    step of the values (`StandardSave`): `[model values]` and `[optimizer
    values]` by position, checked by shape when restored (names differ:
    auto-numbered objects such as an optimizer's "sgd_1" differ between
    processes). `run_dir` may be local, a `file://` URL or remote (gs://...,
    as `etils.epath` reads it). Orbax writes a step into a temporary
    directory and commits it whole (a rename, or a commit file on GCS), so a
    save killed halfway leaves no step, only a temporary directory that
    restores ignore and a save of that step replaces. Every process of a job
    saves and restores together (orbax writes each array once, from the
    process that holds its first replica, and synchronises the processes),
    so a relaunch of all processes resumes at the same step.

    Args:
        run_dir: the run's directory.
        max_to_keep: how many of the newest checkpoints to keep.
        model: the `keras.Model` whose `variables` are checkpointed.
        optimizer: the built optimizer whose `variables` are checkpointed.
    """

    def __init__(self, run_dir, max_to_keep, model, optimizer):
        import orbax.checkpoint as ocp

        # Orbax's paths (etils.epath) read no file:// URLs, and its local
        # paths must be absolute.
        local = model_dirs.local_path(run_dir)
        root = run_dir if local is None else os.path.abspath(local)
        self._dir = os.path.join(root, "checkpoints")
        self._variables = {"model": model.variables, "optimizer": optimizer.variables}
        errors.quiet_disk_full_in_threads()
        self._manager = ocp.CheckpointManager(
            self._dir,
            # Registered up front: a fresh manager reads no step's metadata without it.
            item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(
                preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
                # The caller treats a returned save as committed.
                enable_async_checkpointing=False,
            ),
        )

    def _path(self, step):
        return os.path.join(self._dir, str(step))

    def steps(self):
        """The committed checkpoints' steps, ascending."""
        return sorted(self._manager.all_steps())

    def restore(self):
        """Restores the newest readable checkpoint, if any; returns its step (0 if none).

        Nothing is deleted here (a passing read error must not cost a good
        checkpoint): `save` replaces a step that exists when the run reaches
        it again.

        Raises:
            errors.InputError: also if the newest readable one holds another
                model's values.
        """

        def read(step, path):
            values = self._read(step)
            for owner, variables in self._variables.items():
                for variable, value in zip(variables, values[owner]):
                    variable.assign(value)
            return step

        candidates = [(step, self._path(step)) for step in reversed(self.steps())]
        return restore_newest_readable(candidates, read, self._dir)

    def _read(self, step):
        """Checkpoint `step`'s values, laid out as the variables are.

        Raises:
            errors.InputError: if it holds another model's values.
        """
        import jax
        import orbax.checkpoint as ocp

        metadata = self._manager.item_metadata(step)
        if metadata is None:
            raise ValueError("no readable item metadata")
        self._check_shapes(step, getattr(metadata, "tree", metadata))
        # Read straight into each variable's layout: a process reads only the
        # shards it holds.
        target = {
            owner: [
                jax.ShapeDtypeStruct(v.value.shape, v.value.dtype, sharding=v.value.sharding)
                for v in variables
            ]
            for owner, variables in self._variables.items()
        }
        return self._manager.restore(step, args=ocp.args.StandardRestore(target))

    def _check_shapes(self, step, saved):
        """Raises `errors.InputError` unless `saved` (metadata) has the variables' shapes."""
        for owner, variables in self._variables.items():
            shapes = [tuple(m.shape) for m in (saved or {}).get(owner, [])]
            expected = [tuple(v.shape) for v in variables]
            if shapes != expected:
                mismatch = next(
                    (
                        f"{variables[i].path} has shape {shapes[i]} there, {expected[i]} here"
                        for i in range(min(len(shapes), len(expected)))
                        if shapes[i] != expected[i]
                    ),
                    f"it holds {len(shapes)} {owner} values, this {owner} has {len(expected)}",
                )
                raise errors.InputError(
                    f"Checkpoint {self._path(step)} is of another model ({mismatch}); pass "
                    "another --model_dir, or delete its checkpoints to start afresh."
                )

    def save(self, step):
        """Commits a checkpoint at `step` (every process), keeping the newest `max_to_keep`."""
        import orbax.checkpoint as ocp

        values = {
            owner: [v.value for v in variables] for owner, variables in self._variables.items()
        }
        if step in self._manager.all_steps():  # An unreadable one passed over by `restore`.
            self._manager.delete(step)
        # force: orbax's own save policy would skip a step silently.
        with errors.without_disk_full_noise():
            self._manager.save(step, args=ocp.args.StandardSave(values), force=True)
            self._manager.wait_until_finished()

    def close(self):
        """Waits for orbax's background work (deletions) and releases it."""
        self._manager.close()
