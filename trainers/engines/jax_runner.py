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
takes part in the orbax checkpoints
(`trainers.run.checkpoints.OrbaxCheckpointer`).
"""

import os
import re

import numpy as np

from trainers.run import checkpoints
from trainers.run import errors

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
        # JAX's preemption service takes SIGTERM over from C++ and only
        # records it: the trainers' own requests (trainers/run/preemption.py)
        # stop every process at one step instead.
        jax.config.update("jax_enable_preemption_service", False)
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

    @property
    def num_workers(self):
        """The job's processes."""
        import jax

        return jax.process_count()

    def checkpointer(self, run_dir, max_to_keep, model, optimizer):
        """An `OrbaxCheckpointer` of `model` and `optimizer` in `run_dir/checkpoints`.

        The processes of a job agree through this runner on the step they restore.
        """
        return checkpoints.OrbaxCheckpointer(run_dir, max_to_keep, model, optimizer, job=self)

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

    def any_worker(self, flag):
        """Whether `flag` holds in any process (every process calls this at the same steps)."""
        import jax

        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))

    def chief_value(self, value):
        """Process 0's integer `value`, in every process (every process calls this at once)."""
        import jax

        if jax.process_count() == 1:
            return value
        from jax.experimental import multihost_utils

        return int(multihost_utils.broadcast_one_to_all(np.int32(value)))

    def host_values(self, variables):
        """NumPy copies of `variables`' values (of one spanning processes: this process's copy)."""
        return [_host(v.value) for v in variables]

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
