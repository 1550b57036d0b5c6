"""The record of an evaluation: the task's, with the moving or the re-estimated BN statistics."""

import time

import keras

import keras_bn
from keras_bn import population


def evaluate(task, loop, model, step, interval):
    """The record of the evaluation at `step`, with the statistics `loop` chooses.

    "moving": `task.evaluate`'s record. "precise": `task.evaluate` with the
    moving statistics, then every keras_bn layer's statistics re-estimated
    (`keras_bn.estimate_population_statistics`) on the first
    `loop.precise_bn_batches` batches of `task.train_dataset(0)` and
    `task.evaluate` again; the record is the second one, plus the first's
    `task.statistics_metrics()` prefixed "moving_" and "precise_bn_seconds"
    (the estimation's wall time). Every non-trainable variable of `model`
    (BN statistics and counters, dropout's seed state the passes advance) is
    put back as it was before the passes, so the moving statistics are what
    is logged, checkpointed and trained on. A model without trainable
    keras_bn layers has nothing to re-estimate: its "moving_" metrics are its
    record's and "precise_bn_seconds" is 0.

    On every engine the passes run in training mode over global
    batches: under `tf.distribute` outside the replicas, so each pass's
    statistics are those of the global batch (with per-replica BN in
    training, of its replicas' examples pooled); under
    `keras.distribution` the layer splits the batch as in training. Every
    worker of a multi-worker run runs the same passes. Under `tf.distribute`
    the statistics are read, and put back, as their mean over the replicas
    (what a checkpoint holds and a restore writes), so with per-replica BN
    on several replicas each replica's moving statistics become that mean
    after a precise evaluation: inference and checkpoints are unchanged, and
    training is too, except with Batch Renormalization, whose per-replica
    `renorm_mean`/`renorm_stddev` enter the training transform.
    """
    record = task.evaluate(step, interval)
    if loop.eval_bn_statistics == "moving":
        return record
    moving = {f"moving_{key}": record[key] for key in task.statistics_metrics()}
    if not any(layer.trainable for layer in population.batch_norm_layers(model)):
        return {**record, **moving, "precise_bn_seconds": 0.0}
    state = [v for v in model.variables if not v.trainable]
    saved = _snapshot(state)
    try:
        tick = time.time()
        keras_bn.estimate_population_statistics(
            model, task.train_dataset(0), loop.precise_bn_batches
        )
        seconds = time.time() - tick
        record = task.evaluate(step, interval)
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)
    return {**record, **moving, "precise_bn_seconds": seconds}


def _snapshot(variables):
    """Copies of `variables`' values, to assign back."""
    if keras.backend.backend() == "jax":
        # JAX arrays are immutable: the values themselves, in their layout
        # (sharded, or spanning processes), are the copy.
        return [v.value for v in variables]
    return [keras.ops.convert_to_numpy(v) for v in variables]
