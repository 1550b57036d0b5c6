"""NumPy references shared by the tests (float64, written from the paper)."""

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
