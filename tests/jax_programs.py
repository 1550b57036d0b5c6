"""Compiled JAX training steps, their HLO traffic, and a fit callback for emulated devices."""

import keras
import numpy as np


def hlo_all_reduces(hlo_text):
    """`(count, floats)` of the all-reduces in compiled HLO text.

    `floats` sums the element counts of each all-reduce's result (a tuple
    all-reduce counts each element), as one device sends them.
    """
    import re

    count = floats = 0
    for line in hlo_text.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if not match:
            continue
        count += 1
        for dims in re.findall(r"\b(?:f|bf|s|u)\d+\[([\d,]*)\]", match.group(1)):
            floats += int(np.prod([int(d) for d in dims.split(",") if d]))
    return count, floats


def make_jax_training_step(layer):
    """One jitted training step of `layer` on JAX, and its weights' values.

    The step is the layer's stateless training call, the gradients of
    Σ upstream·y with respect to the trainable weights and the input, and
    the updated moving statistics, as one program.

    Returns:
        `(step, trainable, non_trainable)`, where
        `step(trainable, non_trainable, x, upstream)` returns
        `(y, (weight_grads, dx), updated_non_trainable)`.
    """
    import jax
    import jax.numpy as jnp

    def step(trainable, non_trainable, x, upstream):
        def loss(trainable, x):
            y, updated = layer.stateless_call(trainable, non_trainable, x, training=True)
            return jnp.sum(y * upstream), (y, updated)

        (_, (y, updated)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            trainable, x
        )
        return y, grads, updated

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    return jax.jit(step), trainable, non_trainable


def jax_training_step_hlo(layer, x, upstream):
    """Compiled HLO text of `make_jax_training_step(layer)` for inputs laid out by the caller."""
    step, trainable, non_trainable = make_jax_training_step(layer)
    return step.lower(trainable, non_trainable, x, upstream).compile().as_text()


class OneStepInFlight(keras.callbacks.Callback):
    """Makes `fit` wait for each step: `callbacks=[OneStepInFlight()]`.

    For `keras.distribution` over emulated host devices (JAX,
    `--xla_force_host_platform_device_count`), which share the machine's few
    cores: with steps dispatched ahead, the device threads of several
    steps' programs can fill XLA's CPU thread pool, each program waiting in
    its all-reduce rendezvous for the device threads it lacks (XLA aborts
    after 40 s). A per-batch hook that is not async-safe makes Keras convert
    each step's logs on the training thread, i.e. wait for the step.
    """

    def on_train_batch_end(self, batch, logs=None):
        del batch, logs  # Keras has already waited for the logs.
