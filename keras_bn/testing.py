"""NumPy references shared by the tests (float64, written from the paper),
and the few fixtures the test modules share."""

import functools

import keras
import numpy as np


def reduction_axes(rank, feature_axes):
    feature_axes = {a % rank for a in feature_axes}
    return tuple(i for i in range(rank) if i not in feature_axes)


def reference_moments(x, feature_axes):
    """Batch mean and biased variance, kept as size-1 on reduced axes."""
    x = np.asarray(x, np.float64)
    axes = reduction_axes(x.ndim, feature_axes)
    mean = x.mean(axis=axes, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return mean, variance


def reference_batch_norm(x, gamma, beta, feature_axes, epsilon):
    """Algorithm 1 in float64; gamma/beta broadcast over the reduced axes."""
    mean, variance = reference_moments(x, feature_axes)
    x_hat = (np.asarray(x, np.float64) - mean) / np.sqrt(variance + epsilon)
    return gamma * x_hat + beta


def broadcast_param(param, rank, feature_axes):
    """Reshapes a parameter of the feature shape to broadcast against x."""
    feature_axes = sorted(a % rank for a in feature_axes)
    shape = [1] * rank
    for axis, size in zip(feature_axes, np.shape(param)):
        shape[axis] = size
    return np.reshape(param, shape)


@functools.lru_cache(maxsize=None)
def mirrored_cpu_strategy(num_replicas):
    """One `MirroredStrategy` over logical CPUs 0..num_replicas-1 per process.

    Collective all-reduce keys are process-global: a second collective
    strategy restarts at group key 1 and the runtime rejects it ("joining a
    group with size 4, but that group has size 2"), which fails every later
    test of the process. So only the 4-replica strategy uses collective ops
    (CPU's default); the others reduce through one device, MirroredStrategy's
    other supported mode. The caller splits the CPU first
    (`keras_bn.devices.split_device`).
    """
    import tensorflow as tf  # Local: the references serve the JAX tests too.

    devices = [f"/cpu:{i}" for i in range(num_replicas)]
    if num_replicas == 4:
        return tf.distribute.MirroredStrategy(devices)
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


class CountingReplicaContext:
    """A stand-in replica context that counts its all-reduces and their floats.

    It plays replica `replica_id` of `num_replicas` whose peers hold no data:
    its all-reduce returns its input, which is exactly the SUM all-reduce when
    every other replica contributes zeros (an empty batch). Results must then
    equal local statistics. TensorFlow cannot XLA-compile MirroredStrategy
    collectives on logical CPU devices ("Trying to access resource ... located
    in device CPU:1 from device CPU:0"), so the XLA tests of the synchronised
    path run with this context, and `benchmarks.sync_speed --payload` counts
    the layer's traffic with it at replica counts no machine here has.

    Attributes:
        floats: the element count of each all-reduce, in call order.
    """

    def __init__(self, num_replicas, replica_id=0):
        self.num_replicas_in_sync = num_replicas
        self.replica_id_in_sync_group = replica_id
        self.floats = []

    def all_reduce(self, reduce_op, value):
        if str(reduce_op).upper() not in ("SUM", "REDUCEOP.SUM"):
            raise ValueError(f"Only SUM is counted. Received: reduce_op={reduce_op}")
        size = 1
        for dim in value.shape:
            size *= int(dim)
        self.floats.append(size)
        return value


def count_all_reduces(layer, x, num_replicas):
    """Counts one training call's all-reduce floats, forward and backward.

    Runs `layer(x, training=True)` and the gradient with respect to `x` under
    a `CountingReplicaContext` playing replica 0 of `num_replicas`.

    Returns:
        `(forward, backward)`: the element counts of each all-reduce.
    """
    import tensorflow as tf  # The synchronised path is TensorFlow's.

    from keras_bn import moments

    x = tf.convert_to_tensor(x)
    context = CountingReplicaContext(num_replicas)
    with moments.use_replica_context(context):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        forward = list(context.floats)
        tape.gradient(y, x)
    return forward, context.floats[len(forward):]


def reference_sliced_batch_norm(x, upstream, gamma, beta, slices, epsilon):
    """Training BN of a 2-D batch split into `slices` consecutive slices, in float64.

    Each slice of B/S examples is normalised with its own moments; the
    gradients follow the paper's backward pass per slice, with upstream
    gradient `upstream` (the loss is Σ upstream·y).

    Returns:
        dict with "y", "dx", "dgamma", "dbeta", and "mean", "variance":
        the slices' mean moments (the pooled mean and within-slice
        variance the layer's moving statistics move towards).
    """
    x = np.asarray(x, np.float64).reshape(slices, -1, np.shape(x)[-1])
    g = np.asarray(upstream, np.float64).reshape(x.shape)
    m = x.shape[1]
    mean = x.mean(1, keepdims=True)
    variance = ((x - mean) ** 2).mean(1, keepdims=True)
    inv = 1.0 / np.sqrt(variance + epsilon)
    x_hat = (x - mean) * inv
    y = gamma * x_hat + beta
    sum_g, sum_g_xhat = g.sum(1, keepdims=True), (g * x_hat).sum(1, keepdims=True)
    dx = gamma * inv * (g - (sum_g + x_hat * sum_g_xhat) / m)
    flat = (-1, x.shape[-1])
    return {
        "y": y.reshape(flat), "dx": dx.reshape(flat),
        "dgamma": sum_g_xhat.sum((0, 1)), "dbeta": sum_g.sum((0, 1)),
        "mean": mean.mean((0, 1)), "variance": variance.mean((0, 1)),
    }


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

        (_, (y, updated)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(trainable, x)
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
