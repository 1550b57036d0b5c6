"""The JAX engine under the trainer skeleton: jitted stateless steps over `keras.distribution`.

`JaxRunner` offers what `trainers.run.skeleton` needs from an engine, as
`trainers.engines.tf_runner.DistributeRunner` does on TensorFlow: the replica count
and chief role, building under the distribution, a checkpointer, a compiled
n-step training function and sums over evaluation batches, plus `compile`
for a task's own evaluation functions. A training step is Keras 3's JAX
pattern, `model.stateless_call` and `optimizer.stateless_apply` in one
`jax.jit`, with n steps per call as a `lax.scan`; the loss is the sum over
the global batch's examples divided by the global batch, plus the
regularisation losses, as on TensorFlow.

With `--distribution_strategy=data_parallel` the model runs under
`keras.distribution.DataParallel` over every device of the job (the layer's
synchronised moments then use the distribution's batch axis). A
multi-process job follows Keras' convention: `keras.distribution.initialize`
reads `KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES`
and `KERAS_DISTRIBUTION_PROCESS_ID`; each process feeds its own rows of every
global batch, process 0 writes the summaries and history, and every process
takes part in the orbax checkpoints (`OrbaxCheckpointer`).
"""

import os
import re

from absl import logging
import numpy as np

from trainers.run import errors
from trainers.run import model_dirs

_HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
_GPU_DETERMINISM = "--xla_gpu_deterministic_ops=true"


def set_host_device_count(num_devices):
    """Makes JAX's CPU platform show `num_devices` devices in this process (`XLA_FLAGS`).

    JAX reads the flag when its backend starts, at the first device use, so
    it takes effect only before that. A count already in `XLA_FLAGS` (one a
    parent process set, for example) is replaced.
    """
    flags = re.sub(rf"{_HOST_DEVICE_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} {_HOST_DEVICE_FLAG}={num_devices}".strip()


def create_runner(name, num_cpu_devices=None):
    """The `JaxRunner` of `--distribution_strategy=name` ("off" or "data_parallel").

    Sets the host device count and joins a multi-process job (environment
    variables above) before JAX starts its backend.

    Raises:
        errors.InputError: if JAX started with fewer host devices than
            `num_cpu_devices`.
    """
    import jax
    import keras

    if num_cpu_devices:
        set_host_device_count(num_cpu_devices)
    if int(os.environ.get(_NUM_PROCESSES, "1")) > 1:
        # XLA's CPU collectives across processes (a no-op for accelerators).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        keras.distribution.initialize()
    local = jax.local_devices()
    if num_cpu_devices and len(local) < num_cpu_devices:
        raise errors.InputError(
            f"--num_cpu_devices={num_cpu_devices} needs JAX to start with that many host "
            f"devices, and it started with {len(local)} (XLA_FLAGS was read before the flag "
            "was applied)."
        )
    if name == "off":
        return JaxRunner([local[0]])
    # Each process contributes its first `num_cpu_devices` (or all) local
    # devices, process 0's first: the rows of a global batch go in process order.
    count = num_cpu_devices or len(local)
    return JaxRunner(
        [
            d
            for process in range(jax.process_count())
            for d in jax.local_devices(process_index=process)[:count]
        ]
    )


class JaxRunner:
    """Runs a trainer's steps as jitted stateless JAX programs.

    Args:
        devices: the JAX devices of the run's batch axis, in mesh order; one
            device runs without a distribution, several under
            `keras.distribution.DataParallel`.
    """

    def __init__(self, devices):
        import jax
        import keras

        self.devices = list(devices)
        self._mesh = jax.sharding.Mesh(np.array(self.devices), ("batch",))
        self.distribution = None
        if len(self.devices) > 1:
            # Each process feeds its own rows (see `train_function`), so Keras
            # must not shard the datasets itself.
            self.distribution = keras.distribution.DataParallel(
                devices=self.devices, auto_shard_dataset=False
            )
        self._process_index = jax.process_index()
        processes = sorted({d.process_index for d in self.devices})
        self._process_rank = processes.index(self._process_index)
        self._num_processes = len(processes)

    @property
    def num_replicas(self):
        return len(self.devices)

    @property
    def is_chief(self):
        """Whether this process writes: process 0 of the job."""
        return self._process_index == 0

    def _sharding(self, *spec):
        import jax

        return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec(*spec))

    def make_deterministic(self):
        """Checks that the run's XLA programs are deterministic.

        XLA's CPU programs are deterministic as compiled; on GPUs XLA needs
        `XLA_FLAGS=--xla_gpu_deterministic_ops=true` set before JAX starts,
        which a running process cannot change, so a run without it is refused.

        Raises:
            errors.InputError: on a GPU without that flag.
        """
        gpu = any(d.platform == "gpu" for d in self.devices)
        if gpu and _GPU_DETERMINISM not in os.environ.get("XLA_FLAGS", ""):
            raise errors.InputError(
                f"--deterministic on JAX GPUs needs XLA_FLAGS={_GPU_DETERMINISM} set before the "
                "trainer starts: set it, or pass --nodeterministic."
            )

    def build(self, build_fn):
        """`build_fn() -> (model, optimizer)` under the distribution, optimizer state built.

        The distribution is made global here, not only around the build: the
        layers read it again when the steps are traced, and a
        `keras.backend.clear_session()` between runs would have dropped it.
        """
        import keras

        keras.distribution.set_distribution(self.distribution)
        model, optimizer = build_fn()
        optimizer.build(model.trainable_variables)
        return model, optimizer

    def checkpointer(self, run_dir, max_to_keep, model, optimizer):
        """An `OrbaxCheckpointer` of `model` and `optimizer` in `run_dir/checkpoints`."""
        return OrbaxCheckpointer(run_dir, max_to_keep, model, optimizer)

    def _local_rows(self, dataset):
        """`dataset`'s global batches cut to this process's rows (all of them in one process)."""
        if self._num_processes == 1:
            return dataset
        rank, parts = self._process_rank, self._num_processes

        def rows(*tensors):
            import tensorflow as tf

            size = tf.shape(tensors[0])[0] // parts
            return tuple(t[rank * size : (rank + 1) * size] for t in tensors)

        return dataset.map(rows)

    def _global(self, local, batch_axis):
        """A jax.Array of this process's `local` rows, split over the devices on `batch_axis`."""
        import jax

        spec = [None] * batch_axis + ["batch"]
        shape = list(local.shape)
        shape[batch_axis] *= self._num_processes
        return jax.make_array_from_process_local_data(self._sharding(*spec), local, tuple(shape))

    def train_function(self, dataset, model, optimizer, loss_fn, global_batch):
        """`run_steps(n) -> mean loss` training on `dataset`'s next n global batches."""
        import jax
        import jax.numpy as jnp
        import keras

        iterator = self._local_rows(dataset).as_numpy_iterator()
        trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
        optimizer_variables = optimizer.variables

        def one_step(state, batch):
            trainable_values, non_trainable_values, optimizer_values = state
            x, y = batch

            def loss_of(trainable_values):
                logits, updated, losses = model.stateless_call(
                    trainable_values, non_trainable_values, x, training=True, return_losses=True
                )
                loss = loss_fn(y, logits) / global_batch
                if losses:
                    loss += keras.ops.sum(keras.ops.stack(losses))
                return loss, updated

            (loss, updated), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable_values)
            trainable_values, optimizer_values = optimizer.stateless_apply(
                optimizer_values, grads, trainable_values
            )
            return (trainable_values, updated, optimizer_values), loss

        @jax.jit
        def multi_step(state, xs, ys):
            state, losses = jax.lax.scan(one_step, state, (xs, ys))
            return state, jnp.mean(losses)

        def run_steps(n):
            batches = [next(iterator) for _ in range(n)]
            xs, ys = (self._global(np.stack(t), batch_axis=1) for t in zip(*batches))
            state = tuple(
                [v.value for v in variables]
                for variables in (trainable, non_trainable, optimizer_variables)
            )
            state, loss = multi_step(state, xs, ys)
            for variables, values in zip((trainable, non_trainable, optimizer_variables), state):
                for variable, value in zip(variables, values):
                    variable.assign(value)
            return float(_host(loss))

        return run_steps

    def compile(self, fn, model):
        """`fn` (reading `model`'s variables) as one jitted call with NumPy results.

        The variables' current values go in as arguments, so the call sees
        each update (a plain `jax.jit` would freeze them as constants).
        NumPy arguments are replicated over the devices; jax.Arrays keep
        their layout.
        """
        import jax
        import keras

        variables = model.variables

        @jax.jit
        def call(values, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return fn(*args)

        replicated = self._sharding()

        def run(*args):
            args = [
                a
                if isinstance(a, jax.Array)
                else jax.make_array_from_process_local_data(replicated, np.asarray(a))
                for a in args
            ]
            outputs = call([v.value for v in variables], *args)
            return jax.tree_util.tree_map(_host, outputs)

        return run

    def sum_over_batches(self, replica_fn, dataset, max_batches=None):
        """The sum over batches of `replica_fn(x, y)` (a `compile`d sum over a global batch).

        Runs over at most `max_batches` global batches of `dataset` (all when
        None), each laid out over the devices, this process's rows from it.
        """
        total = np.float64(0.0)  # Sums in float64 whatever `replica_fn` returns.
        for i, (x, y) in enumerate(self._local_rows(dataset).as_numpy_iterator()):
            if max_batches is not None and i == max_batches:
                break
            total += np.asarray(replica_fn(self._global(x, 0), self._global(y, 0)), np.float64)
        return np.asarray(total)


def _host(value):
    """A NumPy copy of `value` (of a replicated jax.Array spanning processes: its local copy)."""
    if hasattr(value, "is_fully_addressable") and not value.is_fully_addressable:
        value = value.addressable_data(0)
    return np.asarray(value)


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

        An unreadable checkpoint (damaged or missing files) is logged in one
        line and passed over for the one before it. Nothing is deleted here
        (a passing read error must not cost a good checkpoint): `save`
        replaces a step that exists when the run reaches it again.

        Raises:
            errors.InputError: if checkpoints exist but none is readable,
                or the newest readable one holds another model's values.
        """
        steps = self.steps()
        unreadable = []
        for step in reversed(steps):
            try:
                values = self._read(step)
            except errors.InputError:
                raise
            # Damaged files raise whatever the reader hits first (tensorstore's
            # ValueError, a JSON error, an OSError ...): any of them marks the step unreadable.
            except Exception as error:
                logging.warning(
                    "Checkpoint %s is unreadable (%s); trying the one before it.",
                    self._path(step),
                    _one_line(error),
                )
                unreadable.append((step, error))
                continue
            for owner, variables in self._variables.items():
                for variable, value in zip(variables, values[owner]):
                    variable.assign(value)
            logging.info("Resumed from %s at step %d", self._path(step), step)
            return step
        if unreadable:
            raise errors.InputError(
                f"No checkpoint under {self._dir} is readable "
                f"({', '.join(self._path(s) for s, _ in unreadable)}; the newest: "
                f"{_one_line(unreadable[0][1])}); delete them to start afresh, or pass "
                "another --model_dir."
            )
        return 0

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
        self._manager.save(step, args=ocp.args.StandardSave(values), force=True)
        self._manager.wait_until_finished()

    def close(self):
        """Waits for orbax's background work (deletions) and releases it."""
        self._manager.close()


def _one_line(error, limit=400):
    """`error` as one line of at most about `limit` characters: its type and message.

    A tensorstore error's trailing spec (a JSON dump of the reader's
    settings) is left out: the cause comes before it.
    """
    text = str(error).split(" [tensorstore_spec=")[0]
    return f"{type(error).__name__}: {errors.one_line(text, limit)}"
