"""A run's checkpoints, on either engine, and how a run finds the one to resume from.

`TFCheckpointer` writes them with `tf.train.Checkpoint` (TensorFlow's
multi-worker save recipe included) and keeps TensorFlow's `checkpoint` state
file itself, `OrbaxCheckpointer` with orbax's `CheckpointManager` on JAX.
Orbax does not save TensorFlow's distributed variables, so each engine keeps
its own library's format; both flush a new checkpoint to the disk
(`atomic_files.sync`) before they remove old ones themselves, each renamed
away first on a local disk, and both resume through
`restore_newest_readable`, the one loop that passes over damaged checkpoints
(and stops at a passing read error) and in which every worker of a job
agrees on the step it resumes at. The fault points of a save
(`trainers.run.fault_points`): "checkpoint write" before it is written,
"checkpoint commit" once it is whole, "checkpoint delete" before each
removal of an old one.
"""

import errno
import hashlib
import os
import shutil
import tempfile

from absl import logging
import tensorflow as tf

from trainers.reporting import console
from trainers.run import atomic_files
from trainers.run import errors
from trainers.run import fault_points
from trainers.run import model_dirs


class OneProcess:
    """The job of a run in one process: the `job` a checkpointer agrees with by default.

    A runner of several processes offers the same: `is_chief`, `num_workers`,
    `any_worker(flag)` (whether `flag` holds in any process) and
    `chief_value(value)` (the chief's `value`, in every process), each a
    collective every process calls at the same point.
    """

    is_chief = True
    num_workers = 1

    @staticmethod
    def any_worker(flag):
        return flag

    @staticmethod
    def chief_value(value):
        return value


# What a reader raises for a passing failure (a remote store's hiccup, memory, a permission),
# not for damage: the restore stops rather than pass over a good checkpoint.
_PASSING_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.ENOMEM}
)
_PASSING_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED")


def passing(error):
    """Whether `error` (or one in its chain) is a passing failure to read, not damage."""
    passing_types = (
        tf.errors.UnavailableError,
        tf.errors.DeadlineExceededError,
        tf.errors.ResourceExhaustedError,
        tf.errors.PermissionDeniedError,
        tf.errors.UnauthenticatedError,
        tf.errors.AbortedError,
        tf.errors.CancelledError,
        MemoryError,
    )
    seen = error
    while seen is not None:
        if isinstance(seen, passing_types) or getattr(seen, "errno", None) in _PASSING_ERRNOS:
            return True
        if str(seen).startswith(_PASSING_STATUSES):  # tensorstore's status, in its words.
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def restore_newest_readable(candidates, read, where, job=None, chief_error=None):
    """Restores the newest checkpoint every worker reads; returns its step (0 if there are none).

    The chief names the candidates, newest first, and every worker tries each
    in turn until all of them read the same one: so every worker of a job
    resumes at one step, and says so in one log line. A damaged checkpoint
    (missing or cut files, garbage, on TensorFlow another model's objects) is
    logged in one line and the one before it tried; damaged files raise
    whatever their reader hits first (a TensorFlow `OpError`, tensorstore's
    `ValueError`, a JSON error, an `OSError`, an `IndexError` for "read less
    bytes than requested"). A passing failure (`passing`: a remote store
    unavailable, memory, permissions) stops every worker instead, in one
    line: a relaunch reads the checkpoint again, and none is passed over, so
    none is removed.

    Args:
        candidates: the chief's `[(step, path)]`, newest first (the other
            workers' lists are not read).
        read: `read(step)` restores that checkpoint in this worker.
        where: the checkpoints' directory, named in the error.
        job: the run's processes (`OneProcess` by default).
        chief_error: an `errors.InputError` the chief met before (preparing
            the directory), which every worker then stops on.

    Raises:
        errors.InputError: if checkpoints exist and none is readable, or a
            read fails in passing, on any worker (or `read` raises one).
    """
    job = job or OneProcess
    paths = dict(candidates)
    steps = sorted(paths, reverse=True) if job.is_chief else []
    unreadable = []
    first = -1 if chief_error is not None else (steps.pop(0) if steps else 0)
    step = job.chief_value(first)
    while step != 0:
        if step < 0:  # The chief stopped: so does every worker.
            raise chief_error or errors.InputError(
                f"The chief could not prepare {where}, and this worker stops with it: the "
                "chief's line says why. Relaunch every worker once it is mended."
            )
        path = paths.get(step, f"step {step}")
        error = None
        try:
            read(step)
        except errors.InputError:
            raise
        except Exception as caught:
            error = caught
        if job.any_worker(error is not None and passing(error)):
            what = _one_line(error) if error is not None else "it failed on another worker"
            raise errors.InputError(
                f"Checkpoint {path} could not be read just now ({what}), which is no sign of "
                "damage: relaunch the same command to read it again."
            )
        if error is not None:
            logging.warning(
                "Checkpoint %s is unreadable, trying an older one: %s", path, _one_line(error)
            )
        if not job.any_worker(error is not None):
            agreed = f" (all {job.num_workers} workers)" if job.num_workers > 1 else ""
            logging.info("Resumed from %s at step %d%s", path, step, agreed)
            return step
        if error is None:
            logging.warning(
                "Checkpoint %s is unreadable on another worker, trying an older one", path
            )
        unreadable.append((path, error))
        step = job.chief_value(steps.pop(0) if steps else 0)
    if unreadable:
        newest = unreadable[0][1]
        raise errors.InputError(
            f"No checkpoint in {where} is readable ({', '.join(p for p, _ in unreadable)}; "
            f"the newest: {_one_line(newest) if newest else 'unreadable on another worker'}); "
            "move them away to start the run over, or pass another --model_dir."
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
    """Whether TensorFlow reads the index of the checkpoint at `prefix`.

    Raises:
        errors.InputError: when the read fails in passing (`passing`): no
            checkpoint is removed for that.
    """
    try:
        tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError) as error:
        if passing(error):
            raise errors.InputError(
                f"Checkpoint {prefix} could not be read just now ({_one_line(error)}), which is "
                "no sign of damage: relaunch the same command to read it again."
            ) from None
        return False
    return True


def worker_scratch_dir(run_dir, worker):
    """The scratch directory of non-chief `worker` (a name) of the run in `run_dir`.

    Outside `run_dir` and the same for every launch of that worker and run
    (by the run directory's real path), so a launch removes what a killed
    one left there.
    """
    local = model_dirs.local_path(run_dir)
    name = run_dir if local is None else os.path.realpath(local)
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"keras_bn_worker_{worker}_{digest}")


class TFCheckpointer:
    """A run's `tf.train.Checkpoint` of its step, model and optimizer.

    A save of step S writes `ckpt-S` (`tf.train.Checkpoint.write`: its data
    and index under a temporary name first), then lists it in TensorFlow's
    `checkpoint` state file (written atomically), then removes the oldest
    checkpoints beyond `max_to_keep`, each by renaming its index to a
    temporary name first. A checkpoint is resumable from the moment its
    index is whole: restores find checkpoints by their files
    (`ckpt-<step>.index`), not only through the state file, which a lost or
    garbled copy of is rebuilt from them, so no checkpoint is forgotten (and
    none deleted). An unreadable checkpoint is reported in one log line and
    the next older one restored.

    In a multi-worker run every worker must take part in a checkpoint save
    (the save reads distributed variables collectively), so each non-chief
    worker saves into its own scratch directory outside `run_dir`
    (`worker_scratch_dir`), emptied after each save and removed by `close`
    (TensorFlow's multi-worker recipe); a launch first removes what a killed
    one left there. Every worker restores from the chief's checkpoints, at
    the step the chief names and all of them read (`restore_newest_readable`).

    What killed saves leave is removed by the chief when it starts: a save's
    `ckpt-<step>_temp` directory, the state file's temporary copies, data
    files whose index is gone, and checkpoints that are neither listed nor
    readable (a save killed while its index was written).

    Args:
        run_dir: the run's directory (its checkpoints go in `run_dir/checkpoints`).
        max_to_keep: how many of the newest checkpoints to keep.
        step: the run's step variable.
        model: the model whose weights and seed generators are checkpointed.
        optimizer: the optimizer whose variables are checkpointed.
        job: the run's processes (`OneProcess` by default; a runner of
            several is one).
        worker: this worker's name, used for a non-chief's scratch directory.
    """

    def __init__(self, run_dir, max_to_keep, step, model, optimizer, job=None, worker="chief"):
        self._step = step
        self.job = job or OneProcess
        self._max_to_keep = max_to_keep
        # Keras' seed generators (dropout's random state) are model variables
        # but not weights, which is all a Checkpoint of the model tracks: without
        # them a resumed run would draw the dropout masks of the first steps again.
        weights = {id(w) for w in model.weights}
        seeds = [v for v in model.variables if id(v) not in weights]
        self._checkpoint = tf.train.Checkpoint(
            step=step, model=model, optimizer=optimizer, seeds=seeds
        )
        # Made now, so every checkpoint holds it (a restore makes it too):
        # `write` leaves it at 0, whatever the run's history of saves.
        self._checkpoint.save_counter  # noqa: B018
        self._chief_dir = os.path.join(run_dir, "checkpoints")
        self._scratch = None
        self._repair_error = None  # Told every worker at the restore, their first collective.
        if self.job.is_chief:
            try:
                self._repair_chief_dir()
            except errors.InputError as error:
                self._repair_error = error
        else:
            self._scratch = worker_scratch_dir(run_dir, worker)
            shutil.rmtree(self._scratch, ignore_errors=True)  # A killed launch's.
            os.makedirs(self._scratch)

    def _repair_chief_dir(self):
        """Removes what killed saves and deletions left; rebuilds a lost or garbled state file."""
        leftovers = [
            *tf.io.gfile.glob(os.path.join(self._chief_dir, "ckpt-*_temp")),
            *tf.io.gfile.glob(os.path.join(self._chief_dir, "checkpoint.tmp*")),
        ]
        indexed = {prefix for _, prefix in checkpoint_prefixes(self._chief_dir)}
        for data in tf.io.gfile.glob(os.path.join(self._chief_dir, "ckpt-*.data-*")):
            if data.rsplit(".data-", 1)[0] not in indexed:  # A deletion killed after its index.
                leftovers.append(data)
        for path in leftovers:
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            else:
                tf.io.gfile.remove(path)
        state = _checkpoint_state(self._chief_dir)
        listed = {os.path.basename(p) for p in state.all_model_checkpoint_paths} if state else set()
        for _, prefix in checkpoint_prefixes(self._chief_dir):
            # A save lists its checkpoint once the checkpoint is whole: an
            # unlisted one TensorFlow cannot read is a save killed while its
            # index was written (a first save's too, before any state file exists).
            if os.path.basename(prefix) not in listed and not _readable(prefix):
                logging.warning("Removed %s: a save killed before its commit.", prefix)
                _remove_checkpoint(prefix)
        prefixes = [prefix for _, prefix in checkpoint_prefixes(self._chief_dir)]
        if not prefixes:
            return
        if {os.path.basename(p) for p in prefixes} != listed:
            logging.warning(
                "The checkpoint state file of %s is missing, garbled or incomplete: rebuilt "
                "from the %d checkpoints there.",
                self._chief_dir,
                len(prefixes),
            )
            _write_state(self._chief_dir, prefixes[::-1])

    def restore(self, newest=None):
        """Restores the chief's newest checkpoint all workers read; returns its step (0 if none).

        Only checkpoints of steps up to `newest` (all if None) are
        candidates. A checkpoint of another model (its objects do not match)
        counts as unreadable: the one before it is tried
        (`restore_newest_readable`).
        """

        def read(step):
            prefix = os.path.join(self._chief_dir, f"ckpt-{step}")
            self._checkpoint.restore(prefix).assert_existing_objects_matched()

        candidates = []
        if self.job.is_chief:
            candidates = [
                (s, p)
                for s, p in checkpoint_prefixes(self._chief_dir)
                if newest is None or s <= newest
            ]
        return restore_newest_readable(
            candidates, read, self._chief_dir, self.job, chief_error=self._repair_error
        )

    def save(self, step):
        """Checkpoints at `step` (every worker, each into its own directory; see the class)."""
        self._step.assign(step)
        directory = self._scratch or self._chief_dir
        tf.io.gfile.makedirs(directory)  # A run makes its checkpoint directory at its first save.
        prefix = os.path.join(directory, f"ckpt-{step}")
        fault_points.reach("checkpoint write")
        self._checkpoint.write(prefix)
        fault_points.reach("checkpoint commit")
        if self._scratch is not None:
            _remove_checkpoint(prefix)
            return
        # On the disk before it is listed and older ones go: TensorFlow only flushes.
        atomic_files.sync(tf.io.gfile.glob(prefix + ".*"))
        others = checkpoint_prefixes(directory)
        older = [p for s, p in others if s < step]
        kept = older[: self._max_to_keep - 1]
        _write_state(directory, [*kept[::-1], prefix])
        # Newer ones are of steps the run went back over (`restore`'s `newest`).
        for old in older[self._max_to_keep - 1 :] + [p for s, p in others if s > step]:
            fault_points.reach("checkpoint delete")
            _remove_checkpoint(old)

    def close(self):
        """Removes a non-chief worker's scratch directory."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _checkpoint_state(directory):
    """TensorFlow's `checkpoint` state of `directory`, or None when missing or garbled.

    TensorFlow returns None for a file that does not parse (and logs why),
    but raises for one that is not text at all.
    """
    try:
        return tf.train.get_checkpoint_state(directory)
    except UnicodeDecodeError:
        logging.warning("The checkpoint state file of %s is not text.", directory)
        return None


def _write_state(directory, prefixes):
    """Writes TensorFlow's `checkpoint` state file of `directory` atomically: `prefixes`, the
    latest last, by their names (so the directory may move)."""
    names = [os.path.basename(p) for p in prefixes]
    lines = [f'model_checkpoint_path: "{names[-1]}"']
    lines += [f'all_model_checkpoint_paths: "{name}"' for name in names]
    atomic_files.write_text(os.path.join(directory, "checkpoint"), "\n".join(lines) + "\n")


def _remove_checkpoint(prefix):
    """Removes TensorFlow checkpoint `prefix`: its index first (renamed away), then its data.

    Killed halfway, it leaves data files without an index or a temporary
    file, which the chief's next start removes, never a checkpoint that
    looks whole but is not.
    """
    index = prefix + ".index"
    if tf.io.gfile.exists(index):
        hidden = atomic_files.temporary_path(index)
        tf.io.gfile.rename(index, hidden, overwrite=True)
        index = hidden
    for path in tf.io.gfile.glob(prefix + ".data-*"):
        tf.io.gfile.remove(path)
    if tf.io.gfile.exists(index):
        tf.io.gfile.remove(index)


class OrbaxCheckpointer:
    """A run's checkpoints through `orbax.checkpoint`: every model and optimizer value by step.

    `run_dir/checkpoints/<step>/`, one `orbax.checkpoint.CheckpointManager`
    step of the values (`StandardSave`): `[model values]` and `[optimizer
    values]` by position, checked by shape when restored (names differ:
    auto-numbered objects such as an optimizer's "sgd_1" differ between
    processes). `run_dir` may be local, a `file://` URL or remote (gs://...,
    as `etils.epath` reads it). Orbax writes a step into a temporary
    directory and commits it whole (a rename, or a commit file on GCS), so a
    save killed halfway leaves no step, only a temporary directory, which
    the next launch's manager removes. Every process of a job saves and
    restores together (orbax writes each array once, from the process that
    holds its first replica, and synchronises the processes), and restores
    the step the chief names and all of them read
    (`restore_newest_readable`), so a relaunch of all processes resumes at
    one step.

    After each save the chief removes the checkpoints beyond the newest
    `max_to_keep`, each by renaming it to a temporary name first, so that a
    kill never leaves half a checkpoint under a step's name.

    Args:
        run_dir: the run's directory.
        max_to_keep: how many of the newest checkpoints to keep.
        model: the `keras.Model` whose `variables` are checkpointed.
        optimizer: the built optimizer whose `variables` are checkpointed.
        job: the run's processes (`OneProcess` by default; a runner of
            several is one).
    """

    def __init__(self, run_dir, max_to_keep, model, optimizer, job=None):
        import orbax.checkpoint as ocp

        # Orbax's paths (etils.epath) read no file:// URLs, and its local
        # paths must be absolute.
        local = model_dirs.local_path(run_dir)
        root = run_dir if local is None else os.path.abspath(local)
        self._dir = os.path.join(root, "checkpoints")
        self.job = job or OneProcess
        self._max_to_keep = max_to_keep
        self._variables = {"model": model.variables, "optimizer": optimizer.variables}
        errors.quiet_disk_full_in_threads()
        errors.quiet_abandoned_reads()  # A damaged checkpoint is passed over in one line.
        self._manager = ocp.CheckpointManager(
            self._dir,
            # Registered up front: a fresh manager reads no step's metadata without it.
            item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(
                # The caller treats a returned save as committed.
                enable_async_checkpointing=False,
                # Killed saves' temporary directories.
                cleanup_tmp_directories=True,
            ),
        )

    def _path(self, step):
        return os.path.join(self._dir, str(step))

    def steps(self):
        """The committed checkpoints' steps, ascending."""
        return sorted(self._manager.all_steps())

    def restore(self, newest=None):
        """Restores the newest checkpoint every process reads; returns its step (0 if none).

        Only checkpoints of steps up to `newest` (all if None) are
        candidates. Nothing is deleted here (a passing read error must not
        cost a good checkpoint): `save` replaces a step that exists when the
        run reaches it again.

        Raises:
            errors.InputError: also if the newest readable one holds another
                model's values.
        """

        def read(step):
            values = self._read(step)
            for owner, variables in self._variables.items():
                for variable, value in zip(variables, values[owner]):
                    variable.assign(value)

        candidates = [
            (step, self._path(step))
            for step in reversed(self.steps())
            if newest is None or step <= newest
        ]
        return restore_newest_readable(candidates, read, self._dir, self.job)

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
        # The step's one item, read by its handler: the manager's restore ends in a
        # barrier, which a process whose own shards fail to read would skip, and the
        # processes' next collectives would then pair up wrongly. They agree instead
        # (`restore_newest_readable`).
        from etils import epath

        item = epath.Path(self._path(step)) / "default"
        return ocp.StandardCheckpointHandler().restore(item, args=ocp.args.StandardRestore(target))

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
        """Commits a checkpoint at `step` (every process), keeping the newest `max_to_keep`.

        Checkpoints of later steps (the run went back over them, `restore`'s
        `newest`) are removed with the oldest.
        """
        import orbax.checkpoint as ocp

        values = {
            owner: [v.value for v in variables] for owner, variables in self._variables.items()
        }
        if step in self._manager.all_steps():  # An unreadable one passed over by `restore`.
            self._manager.delete(step)
        fault_points.reach("checkpoint write")
        # force: orbax's own save policy would skip a step silently.
        with errors.without_disk_full_noise():
            self._manager.save(step, args=ocp.args.StandardSave(values), force=True)
            self._manager.wait_until_finished()
        fault_points.reach("checkpoint commit")
        if self.job.is_chief:  # On the disk before older ones go (orbax's own flushing aside).
            atomic_files.sync([self._path(step)])
        steps = self.steps()
        older = [s for s in steps if s < step][::-1]
        dropped = older[self._max_to_keep - 1 :] + [s for s in steps if s > step]
        if not dropped:
            return
        if self.job.is_chief:
            for old in dropped:
                fault_points.reach("checkpoint delete")
                _remove_directory(self._path(old))
        self.job.any_worker(False)  # Every process waits for the removals, then lists again.
        self._manager.reload()

    def close(self):
        """Waits for orbax's background work and releases it."""
        self._manager.close()


def _remove_directory(path):
    """Removes directory `path`, on a local disk renamed to a temporary name first.

    An object store has no directory rename: there the objects go one by one.
    """
    local = model_dirs.local_path(path)
    if local is None:
        tf.io.gfile.rmtree(path)
        return
    hidden = atomic_files.temporary_path(local)
    os.rename(local, hidden)
    shutil.rmtree(hidden)
