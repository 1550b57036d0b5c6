"""Which examples of a training batch share their statistics ("slices").

A training batch of B examples is split along its batch axis into S
consecutive slices of B/S examples, each normalised with its own moments:

- ghost batches (`virtual_batch_size=v`): S = B/v, every engine;
- Keras 3's `keras.distribution` on JAX (`DataParallel`, `ModelParallel`),
  where a layer sees the global batch of R replicas (positions on the mesh's
  batch axis): S = R for local statistics (each replica's own batch),
  S = R/k for groups of k replicas, S = 1 for the global batch.

Because a slice is a reshape of the batch axis into (S, B/S), XLA's SPMD
partitioner keeps a slice on the devices that hold its examples: slices
within one replica need no collective, and groups need one only within the
group. Under `tf.distribute` a replica already sees only its own batch (and
the cross-replica merge is `moments.ReplicaGroups`), so only ghost batches
slice there.
"""

import keras
from keras import ops


def data_parallel_replicas():
    """Replicas on the batch axis of the current `keras.distribution` (JAX), else 1.

    A replica is one position on the device mesh's batch axis
    (`distribution.device_mesh`, `distribution.batch_dim_name`); other
    backends, and JAX without a distribution, count as one replica.
    """
    if keras.backend.backend() != "jax":
        return 1
    distribution = keras.distribution.distribution()
    mesh = getattr(distribution, "device_mesh", None)
    batch_dim = getattr(distribution, "batch_dim_name", None)
    if mesh is None or batch_dim is None:
        return 1
    return int(mesh.shape[list(mesh.axis_names).index(batch_dim)])


def count(batch_size, *, replicas, synchronized, group_size, virtual_batch_size):
    """The number of slices S of a batch (see the module docstring).

    Args:
        batch_size: int, or `None` when unknown (traced with a dynamic batch).
        replicas: replicas the batch spans (`data_parallel_replicas()`).
        synchronized: the layer's `synchronized`.
        group_size: the layer's `sync_group_size` (`None`: all replicas).
        virtual_batch_size: the layer's `virtual_batch_size` or `None`.

    Returns:
        S as an int, or `None` for ghost batches of a batch of unknown size
        (the caller reshapes to (-1, v)).

    Raises:
        ValueError: when the replicas do not divide the batch, the group size
            does not divide the replicas, or v does not divide a replica's
            batch, naming both numbers.
    """
    if replicas > 1:
        if batch_size is None or batch_size % replicas:
            raise ValueError(
                f"The batch of {batch_size} examples must split evenly over the {replicas} "
                "replicas on the distribution's batch axis. "
                f"Received: batch_size={batch_size}, replicas={replicas}"
            )
    if virtual_batch_size is not None:
        if batch_size is None:
            return None
        per_replica = batch_size // replicas
        if per_replica % virtual_batch_size:
            raise ValueError(
                f"virtual_batch_size={virtual_batch_size} must divide each replica's batch of "
                f"{per_replica} examples. Received: virtual_batch_size={virtual_batch_size}, "
                f"per-replica batch={per_replica}"
            )
        return batch_size // virtual_batch_size
    if replicas == 1:
        # One replica: its batch is the whole batch, whatever the grouping
        # (as under tf.distribute without a strategy).
        return 1
    if not synchronized:
        return replicas
    group_size = group_size or replicas
    if replicas % group_size:
        raise ValueError(
            f"sync_group_size={group_size} must divide the {replicas} replicas on the "
            f"distribution's batch axis. Received: sync_group_size={group_size}, replicas={replicas}"
        )
    return replicas // group_size


def split(x, slices, slice_size=None):
    """Reshapes (B, ...) into (S, B/S, ...); `slices=None` infers S from `slice_size`."""
    shape = ops.shape(x)
    if slices is None:
        return ops.reshape(x, (-1, slice_size, *shape[1:]))
    return ops.reshape(x, (slices, shape[0] // slices, *shape[1:]))


def merge(x):
    """The inverse of `split`: (S, B/S, ...) back to (B, ...)."""
    shape = ops.shape(x)
    return ops.reshape(x, (-1, *shape[2:]))


def pool_moments(count, mean, variance):
    """Pools per-slice moments (leading slice axis) for the moving statistics.

    Returns the count-weighted mean of the slices' means and of their
    (biased) variances, i.e. the mean and the pooled within-slice variance,
    and a count m per feature for which m/(m−1) turns that variance into the
    pooled unbiased one, Σ M2_s / Σ (n_s − 1) over non-empty slices (m is the
    slice size when the slices are equal).
    """
    if len(count.shape) == 0:
        # Equal slices (no mask): plain means, m = the slice's count.
        return count, ops.mean(mean, axis=0), ops.mean(variance, axis=0)
    total = ops.sum(count, axis=0)
    nonempty = ops.sum(ops.cast(count > 0.0, count.dtype), axis=0)
    pooled_mean = ops.divide_no_nan(ops.sum(count * mean, axis=0), total)
    pooled_variance = ops.divide_no_nan(ops.sum(count * variance, axis=0), total)
    return ops.divide_no_nan(total, nonempty), pooled_mean, pooled_variance
