"""The tf.distribute engine under the trainer skeleton: a custom training loop.

`DistributeRunner` is everything `trainers.run.skeleton` needs from an engine:
the replica count and chief role, building under the strategy's scope, a
checkpointer, a compiled n-step training function over a distributed
dataset, sums over distributed evaluation batches, and `compile` for a
task's own evaluation functions. `trainers.engines.jax_runner.JaxRunner` offers the
same methods on JAX.
"""

import os
import shutil
import tempfile

from absl import logging
import numpy as np
import tensorflow as tf

from keras_bn import distribution
from trainers.engines import loops
from trainers.run import errors


class DistributeRunner:
    """Runs a trainer's steps under a `tf.distribute.Strategy`.

    Args:
        strategy: the strategy (created before any dataset or model).
        jit_compile: XLA-compile each replica's forward/backward pass.
    """

    def __init__(self, strategy, jit_compile=False):
        self.strategy = strategy
        self.jit_compile = jit_compile

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
        """A `Checkpointer` of the step, `model` and `optimizer` in `run_dir/checkpoints`."""
        with self.strategy.scope():
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        return Checkpointer(run_dir, max_to_keep, self.is_chief, step, model, optimizer)

    def train_function(self, dataset, model, optimizer, loss_fn, global_batch):
        """`run_steps(n) -> mean loss` training on `dataset`, distributed over the replicas."""
        iterator = iter(self.strategy.experimental_distribute_dataset(dataset))
        multi_step = loops.make_multi_step(
            self.strategy, model, optimizer, loss_fn, global_batch, self.jit_compile
        )
        return lambda n: multi_step(iterator, tf.constant(n))

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


class Checkpointer:
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
        """Removes killed saves' temporary directories; rebuilds a lost or garbled state file."""
        for temp in tf.io.gfile.glob(os.path.join(self._chief_dir, "ckpt-*_temp")):
            tf.io.gfile.rmtree(temp)
        prefixes = [prefix for _, prefix in checkpoint_prefixes(self._chief_dir)]
        if not prefixes:
            return
        # None when the file is missing or garbled (TensorFlow logs the parse error).
        state = tf.train.get_checkpoint_state(self._chief_dir)
        listed = {os.path.basename(p) for p in state.all_model_checkpoint_paths} if state else set()
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

        Raises:
            errors.InputError: if checkpoints exist and none is readable.
        """
        prefixes = [prefix for _, prefix in checkpoint_prefixes(self._chief_dir)]
        for prefix in prefixes:
            try:
                self._checkpoint.restore(prefix).assert_existing_objects_matched()
            # What TensorFlow's checkpoint reader raises for truncated or garbled
            # files (IndexError: "Read less bytes than requested"), and the
            # match check's AssertionError for a checkpoint of another model.
            except (tf.errors.OpError, ValueError, AssertionError, IndexError) as error:
                logging.warning(
                    "Checkpoint %s is unreadable, trying an older one: %s",
                    prefix,
                    errors.one_line(error, 200),
                )
                continue
            restored = int(self._step.numpy())
            logging.info("Resumed from %s at step %d", prefix, restored)
            return restored
        if prefixes:
            raise errors.InputError(
                f"No checkpoint in {self._chief_dir} is readable ({', '.join(prefixes)}); "
                "move them away to start the run over."
            )
        return 0

    def save(self, step):
        """Checkpoints at `step` (every worker, each into its own directory)."""
        self._step.assign(step)
        self._manager.save(checkpoint_number=step)

    def close(self):
        """Removes a non-chief worker's scratch checkpoints."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
