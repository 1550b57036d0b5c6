"""Training-loop pieces shared by the trainers: multi-step execution, resume."""

import tensorflow as tf

from trainers import summaries


def make_multi_step(strategy, model, optimizer, loss_fn, global_batch, jit_compile=False):
    """Returns a compiled `run(iterator, n)` doing n SGD steps, mean loss back.

    Running n steps per call (Keras' steps_per_execution) keeps Python out of
    the inner loop. `loss_fn(labels, logits)` returns the per-replica SUM of
    per-example losses; dividing by the GLOBAL batch makes the strategy's
    summed gradients those of the global-batch mean loss. Regularisation
    losses are added once per replica, scaled by 1/num_replicas.
    """
    replicas = strategy.num_replicas_in_sync

    def forward_backward(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits) / global_batch
            if model.losses:
                loss += tf.add_n(model.losses) / replicas
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads

    if jit_compile:
        forward_backward = tf.function(forward_backward, jit_compile=True)

    def replica_step(x, y):
        loss, grads = forward_backward(x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def run(iterator, n):
        total = tf.constant(0.0)
        for _ in tf.range(n):
            per_replica = strategy.run(replica_step, args=next(iterator))
            total += strategy.reduce("SUM", per_replica, axis=None)
        return total / tf.cast(n, tf.float32)

    return run


def restore(checkpoint, manager, history_path, step, empty_history):
    """Restores the latest checkpoint and the history logged up to it.

    Returns the history: `empty_history` for a fresh run, else the saved one
    with evaluation records after the checkpoint's step dropped (they are
    redone after resuming).
    """
    if not manager.latest_checkpoint:
        return empty_history
    checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    saved = summaries.read_json(history_path, empty_history)
    restored = int(step.numpy())
    saved["evals"] = [e for e in saved["evals"] if e["step"] <= restored]
    saved["steps"] = restored
    return saved
