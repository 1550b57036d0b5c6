"""Batch moments: local two-pass statistics and their cross-replica merge.

Moments travel as the triple (count, mean, m2), where `m2` is the sum of
squared deviations from `mean`. The triple merges exactly and stably across
replicas (Chan, Golub & LeVeque 1979), unlike the raw sums of x and x², whose
difference E[x²] − E[x]² loses every significant digit of the variance once
|mean| / std approaches the float32 resolution (about 4e3).

Nothing here imports TensorFlow or PyTorch: a replica context is passed in
(`batch_plan.current_context` looks it up).
"""

from keras import ops


def over_count(total, count):
    """`total / count`, 0 where `count` is 0 (an empty batch, whose total is 0).

    `ops.divide_no_nan` would do, but Keras' PyTorch version returns float32
    for float64 inputs. A count that is a number (NumPy's too) divides as
    one: a tensor made of it would be float32.
    """
    if isinstance(count, (int, float)):
        return total / count if count > 0 else total * 0.0
    return total / ops.where(count > 0.0, count, ops.ones_like(count))


def local_moments(x, axes, weights=None):
    """Returns `(count, mean, m2)` of `x` over `axes` (kept as size 1).

    Args:
        x: float tensor (float32 or float64), the statistics' dtype.
        axes: tuple of the axes to reduce.
        weights: `None`, or a 0/1 tensor of `x`'s dtype and rank,
            broadcastable to `x` (a mask).

    Returns:
        `count` (the number of values each statistic is over), a scalar
        without weights, else of `x`'s rank with size 1 on `axes` and on
        every feature axis the weights do not vary along; and `mean`, `m2` of
        `x`'s rank with size 1 on `axes`, of `x`'s dtype. An empty batch gives
        count 0 and zero mean and m2, never NaN; masked-out values, finite
        or not, do not enter them.
    """
    if weights is None:
        shape = ops.shape(x)
        count = 1
        for axis in axes:
            count = count * shape[axis]
        count = ops.cast(count, x.dtype)
        # Two passes written out, each a plain sum: Keras' `moments` computes
        # the mean twice on JAX (one more all-reduce of C floats for
        # synchronised statistics under keras.distribution) and TensorFlow's
        # holds μ out of the variance's gradient (a wrong third derivative);
        # `ops.mean` accumulates a float64 input in float32 on JAX and
        # PyTorch. An empty batch gives zeros (0 / 0 is 0 here).
        mean = over_count(ops.sum(x, axis=axes, keepdims=True), count)
        m2 = ops.sum(ops.square(x - mean), axis=axes, keepdims=True)
    else:
        # The count of each statistic: per feature when the mask varies
        # across features (a mask over the feature axis), else one value.
        x_shape = ops.shape(x)
        count_shape = [x_shape[i] if i in axes else weights.shape[i] for i in range(len(x.shape))]
        count = ops.sum(ops.broadcast_to(weights, count_shape), axis=axes, keepdims=True)
        # A select, not a product: a masked-out NaN or inf times 0 is NaN.
        x = ops.where(weights > 0.0, x, 0.0)
        mean = over_count(ops.sum(x * weights, axis=axes, keepdims=True), count)
        m2 = ops.sum(ops.square(x - mean) * weights, axis=axes, keepdims=True)
    return count, mean, m2


def batch_moments(x, axes, weights=None, groups=None):
    """Returns `(count, mean, variance)` of `x` over `axes`.

    Args:
        x: float input (float32 or float64, the statistics' dtype).
        axes: tuple of the reduced axes.
        weights: `None` or a 0/1 mask of `x`'s dtype broadcastable to `x`.
        groups: `None` for local statistics, else the `ReplicaGroups`
            whose group batch supplies them.

    Returns:
        `count` (the values each statistic is over: size 1 on every axis, or
        per feature when a mask varies across features), and the mean and
        biased variance with size 1 on `axes`. The mean and variance are
        differentiable functions of `x`: a first-order step never
        differentiates them (`normalize` holds their part of the gradient),
        but a second derivative does.
    """
    count, mean, m2 = local_moments(x, axes, weights)
    if groups is not None:
        count, mean, m2 = groups.moments(count, mean, m2)
    return count, mean, over_count(m2, count)


class ReplicaGroups:
    """Sums and moment merges over the replicas of this replica's group.

    Replicas are grouped consecutively by id: group g holds replicas
    g·k … g·k + k − 1 for group size k. A strategy's all-reduce spans every
    replica, so a group-restricted sum gives each group its own slot: a
    replica writes its values into row g of a (G, n) zero tensor (G = R / k
    groups), the SUM all-reduce fills every row, and the replica reads back
    row g. That costs G·n floats instead of n; with one group it is a plain
    all-reduce of n floats.

    A context that makes its own groups (`torch_replicas.TorchReplicas`:
    `group(size)` gives the context of this replica's group) sums within the
    group instead, n floats each time.

    Args:
        context: a replica context (`tf.distribute.ReplicaContext`,
            `torch_replicas.TorchReplicas`, or a stand-in with the same three
            members).
        group_size: replicas per group, `None` for all replicas; it divides
            the replica count (`batch_plan.make_plan` checks that).
    """

    # Up to this many replicas, one all-reduce of every replica's packed
    # (count, mean, m2) row, R·(2C + 1) floats, replaces the two all-reduces
    # of 3C + 1 floats: it saves one collective's latency while its payload
    # stays within 4C + 4 floats (the two-pass bound with room to spare);
    # from R = 3 on it would exceed that and grow with R.
    PACKED_MAX_REPLICAS = 2

    def __init__(self, context, group_size=None):
        replicas = context.num_replicas_in_sync
        if group_size is not None and group_size < replicas and hasattr(context, "group"):
            context = context.group(group_size)  # Its own collective within the group.
            replicas = group_size
        self.context = context
        self.num_replicas = replicas
        self.group_size = self.num_replicas if group_size is None else group_size
        self.num_groups = self.num_replicas // self.group_size

    def sum(self, tensors):
        """Sums each tensor over the group's replicas, in one all-reduce.

        Args:
            tensors: a list of tensors of one float dtype, any shapes.

        Returns:
            The list of group sums, shaped as the inputs.
        """
        flat = ops.concatenate([ops.reshape(t, (-1,)) for t in tensors], axis=0)
        if self.num_groups == 1:
            total = self._all_reduce(flat)
        else:
            slot = self._one_hot(
                ops.floor_divide(self._replica_id(), self.group_size),
                self.num_groups,
                flat.dtype,
            )
            rows = self._all_reduce(slot[:, None] * flat[None, :])
            total = ops.sum(slot[:, None] * rows, axis=0)
        out, start = [], 0
        for tensor in tensors:
            size = _size(tensor)
            out.append(ops.reshape(total[start : start + size], ops.shape(tensor)))
            start += size
        return out

    def moments(self, count, mean, m2):
        """Merges every group member's `(count, mean, m2)` into the group's.

        Replicas with no values have count 0 and drop out. Shapes are static
        (R and G are Python ints), so the merge compiles under XLA.

        Args:
            count: the local count: a scalar, or per feature (broadcastable
                to `mean`).
            mean: local means, any shape (the feature axes).
            m2: local sums of squared deviations, shaped like `mean`.

        Returns:
            The group's `(count, mean, m2)`, shaped as the inputs.
        """
        if self.num_groups == 1 and self.num_replicas <= self.PACKED_MAX_REPLICAS:
            return self._packed_moments(count, mean, m2)
        # Pass 1: the count-weighted mean, n = Σ n_r, μ̃ = Σ n_r μ_r / n.
        total, weighted = self.sum([count, count * mean])
        approx_mean = over_count(weighted, total)
        shift = mean - approx_mean
        if self.num_groups > 1:
            # Pass 2: M2 = Σ (m2_r + n_r (μ_r − μ̃)²), exact for μ̃ = μ. In a
            # group slot only the k members' rows are non-zero, so μ̃ carries
            # the rounding of k additions, which is negligible for pod group
            # sizes (2–16).
            (group_m2,) = self.sum([m2 + count * ops.square(shift)])
            return total, approx_mean, group_m2
        # Pass 2 over all replicas also corrects the mean: μ̃'s float sum over
        # R replicas can be off by R roundings of n·|μ|, so with
        # s = Σ n_r (μ_r − μ̃) = n (μ − μ̃) (a sum of small terms):
        #   μ = μ̃ + s / n,   M2 = Σ (m2_r + n_r (μ_r − μ̃)²) − s² / n.
        residual, shifted_m2 = self.sum([count * shift, m2 + count * ops.square(shift)])
        correction = over_count(residual, total)
        global_m2 = ops.maximum(shifted_m2 - residual * correction, 0.0)
        return total, approx_mean + correction, global_m2

    def _packed_moments(self, count, mean, m2):
        # Every replica's [count, mean, m2] row in its own slot of an
        # (R, 2C + 1) tensor; one all-reduce gathers all rows, then the
        # parallel merge n = Σ n_r, μ = Σ n_r μ_r / n,
        # M2 = Σ M2_r + Σ n_r (μ_r − μ)².
        # `count` holds one value, or one per feature (masks over features).
        shape = ops.shape(mean)
        count_size, channels = _size(count), _size(mean)
        row = ops.concatenate(
            [ops.reshape(count, (-1,)), ops.reshape(mean, (-1,)), ops.reshape(m2, (-1,))],
            axis=0,
        )
        slot = self._one_hot(self._replica_id(), self.num_replicas, row.dtype)
        rows = self._all_reduce(slot[:, None] * row[None, :])
        counts = rows[:, :count_size]
        means = rows[:, count_size : count_size + channels]
        m2s = rows[:, count_size + channels :]
        total = ops.sum(counts, axis=0)
        global_mean = over_count(ops.sum(counts * means, axis=0), total)
        global_m2 = ops.sum(m2s, axis=0) + ops.sum(counts * ops.square(means - global_mean), axis=0)
        return (
            ops.reshape(total, ops.shape(count)),
            ops.reshape(global_mean, shape),
            ops.reshape(global_m2, shape),
        )

    def _replica_id(self):
        return self.context.replica_id_in_sync_group

    @staticmethod
    def _one_hot(index, depth, dtype):
        return ops.cast(ops.equal(ops.arange(depth), index), dtype)

    def _all_reduce(self, value):
        try:
            return self.context.all_reduce("SUM", value)
        except RuntimeError as error:
            if "merge_call" not in str(error):
                raise
            raise RuntimeError(
                "keras_bn.BatchNormalization(synchronized=True) cannot "
                "all-reduce its moments here because it is called inside a "
                "tf.function (for example one with jit_compile=True) nested "
                "in strategy.run, where tf.distribute cannot run a "
                "collective: compile the whole strategy.run step instead, or "
                "use synchronized=False."
            ) from error


def mean_over_replicas(context, count, mean, variance):
    """`(count, mean, variance)` averaged over `context`'s replicas that have values, in one sum.

    A replica whose statistic is of fewer than 2 values (an empty batch, one
    value per feature) moves no moving statistic on its own, so it is left
    out, per feature; with none left the count is 0 and nothing moves. The
    others weigh equally, as tf.distribute's mean of its replicas' copies.
    """
    count = ops.convert_to_tensor(count, mean.dtype)
    has = ops.cast(ops.broadcast_to(count, ops.shape(mean)) > 1.0, mean.dtype)
    parts = [has, has * ops.broadcast_to(count, ops.shape(mean)), has * mean, has * variance]
    flat = ops.concatenate([ops.reshape(p, (-1,)) for p in parts], axis=0)
    total = context.all_reduce("SUM", flat)
    size = _size(mean)
    has_total, count_total, mean_total, variance_total = (
        ops.reshape(total[i * size : (i + 1) * size], ops.shape(mean)) for i in range(4)
    )
    averaged = [over_count(v, has_total) for v in (count_total, mean_total, variance_total)]
    if len(count.shape) == 0 or _size(count) == 1:  # One count for every feature stays one.
        averaged[0] = ops.reshape(ops.max(averaged[0]), ops.shape(count))
    return tuple(averaged)


def _size(tensor):
    size = 1
    for dim in tensor.shape:
        size *= dim
    return size
