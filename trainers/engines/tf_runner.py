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
        self._any_worker = None  # See `any_worker`.

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

    def checkpointer(self, run_dir, max_to_keep, model, optimizer):
        """A `TFCheckpointer` of the step, `model` and `optimizer` in `run_dir/checkpoints`."""
        with self.strategy.scope():
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        return checkpoints.TFCheckpointer(
            run_dir, max_to_keep, self.is_chief, step, model, optimizer
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
        if not isinstance(self.strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return flag
        if self._any_worker is None:  # One traced function for the run.

            @tf.function
            def any_worker(value):
                # tf.distribute reduces by SUM or MEAN only: a sum of 0/1 flags.
                per_replica = self.strategy.run(tf.identity, args=(value,))
                return self.strategy.reduce("SUM", per_replica, axis=None) > 0

            self._any_worker = any_worker
        return bool(self._any_worker(tf.constant(int(flag))).numpy())

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
