"""The tf.distribute engine under the trainer skeleton: a custom training loop.

`DistributeRunner` is everything `trainers.run.skeleton` needs from an engine:
the replica count and chief role, building under the strategy's scope, a
checkpointer, a compiled n-step training function over a distributed
dataset, sums over distributed evaluation batches, and `compile` for a
task's own evaluation functions. `trainers.engines.jax_runner.JaxRunner` offers the
same methods on JAX.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_bn import distribution
from trainers.engines import loops
from trainers.run import checkpoints


class DistributeRunner:
    """Runs a trainer's steps under a `tf.distribute.Strategy`.

    Args:
        strategy: the strategy (created before any dataset or model).
        jit_compile: XLA-compile each replica's forward/backward pass.
    """

    def __init__(self, strategy, jit_compile=False):
        self.strategy = strategy
        self.jit_compile = jit_compile
        self._sum = None  # See `_worker_sum`.

    @property
    def num_replicas(self):
        return self.strategy.num_replicas_in_sync

    @property
    def is_chief(self):
        """Whether this process writes (see `keras_bn.distribution.is_chief`)."""
        return distribution.is_chief(self.strategy)

    def make_deterministic(self):
        """Makes every TensorFlow op of this process deterministic (for good: TF has no undo).

        Ops without a deterministic kernel then raise instead of running;
        `tf.data` keeps its element order.
        """
        tf.config.experimental.enable_op_determinism()

    def build(self, build_fn):
        """`build_fn() -> (model, optimizer)` under the strategy's scope, optimizer state built."""
        with self.strategy.scope():
            model, optimizer = build_fn()
            optimizer.build(model.trainable_variables)
        return model, optimizer

    @property
    def num_workers(self):
        """The run's Python processes: the workers of a `MultiWorkerMirroredStrategy`, else 1."""
        resolver = getattr(self.strategy, "cluster_resolver", None)
        if not self._multi_worker or resolver is None:
            return 1
        spec = resolver.cluster_spec()
        return max(1, sum(spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs))

    @property
    def _multi_worker(self):
        return isinstance(self.strategy, tf.distribute.MultiWorkerMirroredStrategy)

    def checkpointer(self, run_dir, max_to_keep, model, optimizer):
        """A `TFCheckpointer` of the step, `model` and `optimizer` in `run_dir/checkpoints`.

        The workers of a multi-worker run agree through this runner on the
        step they restore; a non-chief's scratch directory is named after its
        task.
        """
        with self.strategy.scope():
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        resolver = getattr(self.strategy, "cluster_resolver", None)
        worker = "chief"
        if self._multi_worker and resolver is not None and resolver.task_type:
            worker = f"{resolver.task_type}_{resolver.task_id}"
        return checkpoints.TFCheckpointer(
            run_dir, max_to_keep, step, model, optimizer, job=self, worker=worker
        )

    def train_function(self, dataset, model, optimizer, loss_fn, global_batch):
        """`run_steps(n) -> mean loss` training on `dataset`, distributed over the replicas."""
        iterator = iter(self.strategy.experimental_distribute_dataset(dataset))
        multi_step = loops.make_multi_step(
            self.strategy, model, optimizer, loss_fn, global_batch, self.jit_compile
        )
        return lambda n: multi_step(iterator, tf.constant(n))

    def any_worker(self, flag):
        """Whether `flag` holds on any worker (every worker calls this at the same steps).

        Only `MultiWorkerMirroredStrategy` runs several Python processes
        (a TPU pod's hosts run one); there the workers agree by an all-reduce.
        """
        if not self._multi_worker:
            return flag
        return self._worker_sum(int(flag)) > 0

    def chief_value(self, value):
        """The chief's integer `value`, in every worker (every worker calls this at once)."""
        if not self._multi_worker:
            return value
        return self._worker_sum(value if self.is_chief else 0)

    def _worker_sum(self, value):
        """The sum over the workers of each one's integer `value` (an all-reduce)."""
        if self._sum is None:  # One traced function for the run.

            @tf.function
            def worker_sum(value):
                # Each worker's replicas all hold its value: the sum over
                # replicas is the sum over workers times the replicas per worker.
                per_replica = self.strategy.run(tf.identity, args=(value,))
                return self.strategy.reduce("SUM", per_replica, axis=None)

            self._sum = worker_sum
        replicas_per_worker = self.num_replicas // self.num_workers
        return int(self._sum(tf.constant(value, tf.int32)).numpy()) // replicas_per_worker

    def host_values(self, variables):
        """NumPy copies of `variables` values (as a distributed variable reads outside replicas)."""
        return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]

    def compile(self, fn, model):
        """`fn` (reading `model`'s variables) as a `tf.function`; results are tensors."""
        del model  # A tf.function reads the variables themselves.
        return tf.function(fn)

    def sum_over_batches(self, replica_fn, dataset, max_batches=None):
        """The sum over replicas and batches of `replica_fn(x, y)`, as a NumPy array.

        Runs over at most `max_batches` batches of `dataset` (all when None).
        """
        total = np.float64(0.0)  # Sums in float64 whatever `replica_fn` returns.
        for i, (x, y) in enumerate(self.strategy.experimental_distribute_dataset(dataset)):
            if max_batches is not None and i == max_batches:
                break
            per_replica = self.strategy.run(replica_fn, args=(x, y))
            total += self.strategy.reduce("SUM", per_replica, axis=None).numpy()
        return np.asarray(total)
