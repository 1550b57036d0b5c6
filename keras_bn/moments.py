"""Batch moments: local two-pass statistics and their cross-replica merge.

Moments travel as the triple (count, mean, m2), where `m2` is the sum of
squared deviations from `mean`. The triple merges exactly and stably across
replicas (Chan, Golub & LeVeque 1979), unlike the raw sums of x and x², whose
difference E[x²] − E[x]² loses every significant digit of the variance once
|mean| / std approaches the float32 resolution (about 4e3).
"""

import tensorflow as tf
from keras import ops


def local_moments(x, axes, weights=None):
    """Returns `(count, mean, m2)` of float32 `x` over `axes` (kept as size 1).

    Args:
        x: float32 tensor.
        axes: tuple of the axes to reduce.
        weights: `None`, or a float32 0/1 tensor broadcastable to `x` with
            size 1 on every axis not in `axes` (a mask).

    Returns:
        `count`, a float32 scalar (the number of values each statistic is
        over), and `mean`, `m2` of `x`'s rank with size 1 on `axes`. An empty
        batch gives count 0 and zero mean and m2, never NaN.
    """
    if weights is None:
        shape = ops.shape(x)
        count = 1
        for axis in axes:
            count = count * shape[axis]
        count = ops.cast(count, "float32")
        # Two-pass moments (fused squared difference on TensorFlow); an empty
        # batch yields NaN there, replaced by zeros.
        mean, variance = ops.moments(x, axes, keepdims=True)
        has_values = count > 0.0
        mean = ops.where(has_values, mean, 0.0)
        m2 = ops.where(has_values, variance * count, 0.0)
    else:
        count = ops.sum(weights)
        mean = ops.divide_no_nan(
            ops.sum(x * weights, axis=axes, keepdims=True), count
        )
        m2 = ops.sum(ops.square(x - mean) * weights, axis=axes, keepdims=True)
    return count, mean, m2


def sync_replica_context():
    """The replica context to synchronise over, or `None` for local moments.

    `None` outside any strategy, in cross-replica context, and when there is a
    single replica, where local moments already are the global ones.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def cross_replica_moments(context, count, mean, m2):
    """Merges every replica's `(count, mean, m2)` into the global-batch triple.

    One all-reduce of one packed tensor: each replica writes its
    `[count, mean, m2]` row into its own slot of an `(R, 2C + 1)` zero tensor,
    so the SUM all-reduce gathers all rows, and every replica then applies the
    parallel merge
        n  = Σ n_r,   μ = Σ n_r μ_r / n,   M2 = Σ M2_r + Σ n_r (μ_r − μ)²,
    which is exact and free of cancellation. Replicas with no examples have
    n_r = 0 and drop out. The shapes are static (R is the replica count), so
    the op compiles under XLA and on TPUs.

    Args:
        context: a `tf.distribute.ReplicaContext` from `sync_replica_context`.
        count: float32 scalar, the local count.
        mean: local means, any shape (feature axes), float32.
        m2: local sums of squared deviations, shaped like `mean`.

    Returns:
        The global `(count, mean, m2)`, shaped as the inputs.
    """
    shape = ops.shape(mean)
    mean_flat = ops.reshape(mean, (-1,))
    m2_flat = ops.reshape(m2, (-1,))
    channels = mean_flat.shape[0]
    row = ops.concatenate(
        [ops.reshape(count, (1,)), mean_flat, m2_flat], axis=0
    )
    slot = ops.one_hot(
        context.replica_id_in_sync_group,
        context.num_replicas_in_sync,
        dtype="float32",
    )
    rows = context.all_reduce(
        tf.distribute.ReduceOp.SUM, slot[:, None] * row[None, :]
    )
    counts = rows[:, :1]
    means = rows[:, 1 : 1 + channels]
    m2s = rows[:, 1 + channels :]
    total = ops.sum(counts)
    global_mean = ops.divide_no_nan(ops.sum(counts * means, axis=0), total)
    global_m2 = ops.sum(m2s, axis=0) + ops.sum(
        counts * ops.square(means - global_mean), axis=0
    )
    return (
        total,
        ops.reshape(global_mean, shape),
        ops.reshape(global_m2, shape),
    )


def cross_replica_sum(context, tensors):
    """Sums a list of float32 tensors over replicas in one packed all-reduce."""
    flat = [ops.reshape(t, (-1,)) for t in tensors]
    sizes = [f.shape[0] for f in flat]
    packed = context.all_reduce(
        tf.distribute.ReduceOp.SUM, ops.concatenate(flat, axis=0)
    )
    out, start = [], 0
    for tensor, size in zip(tensors, sizes):
        out.append(ops.reshape(packed[start : start + size], ops.shape(tensor)))
        start += size
    return out
