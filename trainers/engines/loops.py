"""The compiled training step of the tf.distribute engine: n SGD steps per call."""

import tensorflow as tf


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
