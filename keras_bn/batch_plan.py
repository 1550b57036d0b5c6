"""Which examples of a training batch share their statistics: the batch plan.

This module owns the partition of a training batch, for every engine. From a
layer's settings (`synchronized`, `sync_group_size`, `virtual_batch_size`:
with `synchronized=True` the normalisation batch in examples, turned into
ghost batches, each replica's batch or replica groups by `make_plan`),
the input's batch size and the engine context, `make_plan` builds one
immutable `BatchPlan` per training call. The plan splits the batch into S
consecutive slices of B/S examples along its batch axis, each normalised with
its own moments, and merges moments across `tf.distribute` replicas:

- ghost batches (`virtual_batch_size=v`): S = B/v, on every engine;
- Keras 3's `keras.distribution` on JAX (`DataParallel`, `ModelParallel`),
  where a layer sees the global batch of R replicas (positions on the mesh's
  batch axis): S = R for local statistics, S = R/k for groups of k replicas,
  S = 1 for the global batch;
- `tf.distribute`, where a replica sees only its own batch: S = 1, and
  `synchronized=True` merges the replicas' moments (`moments.ReplicaGroups`).

`BatchPlan.normalize` then runs the whole training-mode normalisation in that
partition (split, moments, merge across replicas, normalise, merge the
slices, pool their moments for the moving statistics): the layer calls it
once per training call.

A slice is a reshape of the batch axis into (S, B/S), so XLA's SPMD
partitioner keeps it on the devices that hold its examples: slices within one
replica need no collective, and groups need one only within the group.
"""

import dataclasses
from typing import Any

import keras
from keras import ops

from keras_bn import kernels
from keras_bn import moments
from keras_bn import normalize
from keras_bn import torch_replicas


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """Where a training call runs, as far as the batch partition cares.

    Attributes:
        replica_context: `None`, or the `tf.distribute.ReplicaContext` (or an
            object with its `num_replicas_in_sync`, `replica_id_in_sync_group`
            and `all_reduce(op, value)`) whose replicas synchronise.
        mesh_replicas: replicas on the batch axis of the current
            `keras.distribution` (JAX); 1 elsewhere.
        separate_processes: whether each replica is a process of its own
            (`torch.distributed`'s ranks): its moving statistics are a copy of
            its own that nothing averages, and its batch size its own.
    """

    replica_context: Any = None
    mesh_replicas: int = 1
    separate_processes: bool = False

    @property
    def replicas(self):
        """The replicas a synchronised statistic may span."""
        if self.replica_context is not None:
            return self.replica_context.num_replicas_in_sync
        return self.mesh_replicas


def current_context(synchronized):
    """The `EngineContext` of the current call, looked up once per engine.

    `synchronized=True` reaches here only on TensorFlow, JAX and PyTorch (the
    layer refuses it elsewhere at construction). On PyTorch the replicas are
    the ranks of `torch.distributed`'s default process group; without one, a
    process is one replica (as TensorFlow's default strategy is).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return EngineContext(mesh_replicas=_mesh_replicas())
    if not synchronized:
        return _LOCAL
    if backend == "torch":
        replicas = torch_replicas.current()
        if replicas is None:
            return _LOCAL
        return EngineContext(replica_context=replicas, separate_processes=True)
    import tensorflow as tf  # Only the synchronised path needs it.

    return EngineContext(replica_context=tf.distribute.get_replica_context())


def _mesh_replicas():
    """Positions on the current `keras.distribution`'s batch axis, else 1."""
    distribution = keras.distribution.distribution()
    mesh = getattr(distribution, "device_mesh", None)
    batch_dim = getattr(distribution, "batch_dim_name", None)
    if mesh is None or batch_dim is None:
        return 1
    return int(mesh.shape[list(mesh.axis_names).index(batch_dim)])


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one training call partitions its batch (see the module docstring).

    Attributes:
        slices: S, the slices of the batch axis normalised on their own; 1
            for none; `None` for ghost batches of a batch whose size is known
            only at run time.
        slice_size: the ghost batch size v, or `None`.
        groups: `None`, or the `moments.ReplicaGroups` that merges moments
            and gradient sums across replicas (`tf.distribute`'s,
            `torch.distributed`'s).
        copies: `None`, or the replica context over whose replicas the
            moments for the moving statistics are averaged: where each
            replica keeps its own copy with nothing to average them
            (`torch.distributed`; tf.distribute averages its replicas' copies
            when they are read, JAX keeps one) and its statistics are of
            fewer than all replicas (groups, ghost batches).
    """

    slices: int | None = 1
    slice_size: int | None = None
    groups: moments.ReplicaGroups | None = None
    copies: Any = None

    @property
    def sliced(self):
        return self.slices != 1

    def normalize(
        self,
        x,
        gamma,
        beta,
        *,
        reduction_axes,
        epsilon,
        broadcast_shape=None,
        weights=None,
        correction=None,
        fused=None,
        dtype=None,
    ):
        """One training call's normalisation, in the plan's partition.

        Splits the batch into its slices, takes each slice's moments (merged
        across replicas by `groups`), normalises every slice with its own
        moments (gradients through them), merges the slices back and pools
        their moments for the moving statistics. A call with none of these
        (one slice, no merge, no mask, no correction) runs through the
        engine's fused kernel where `kernels.choose` picks one.

        Args:
            x: the input, of the layer's rank, in its own float dtype: a
                fused kernel may take it as it is (16-bit inputs with float32
                statistics), the general path casts it to `dtype`.
            gamma, beta: the scale and offset, per feature (variables or
                tensors; `None`, with `broadcast_shape`: 1 and 0), or already
                broadcastable to `x`.
            reduction_axes: the axes of `x` the statistics reduce.
            epsilon: the layer's ε.
            broadcast_shape: `x`'s rank with size 1 on the reduced axes, the
                shape γ and β take on the general path (`None`: they have
                it). A fused kernel takes them per feature, so an eager
                call does not reshape them twice for nothing.
            weights: `None`, or the mask's 0/1 weights of `x`'s rank.
            correction: `None`, or a function from a slice's `(mean,
                variance)` to Batch Renormalization's `(r, d)`, which turn the
                transform into γ (r x̂ + d) + β.
            fused: the layer's `fused`, for `kernels.choose`.
            dtype: the statistics' dtype (`None`: `x`'s).

        Returns:
            `(y, (count, mean, variance))`: the output, shaped as `x`, and
            the moments pooled over the slices (see `_pool`), per feature.
        """
        # Moments merged across replicas (no mask, no slices) may still take
        # a kernel's ops after the merge (`kernels.choose_for_merged_moments`).
        merged = self.groups is not None and not self.sliced and weights is None
        if not merged:
            plain = not self.sliced and weights is None and not correction
            kernel = kernels.choose(
                x,
                reduction_axes,
                epsilon,
                fused=fused,
                training=True,
                plain=plain,
                statistics=dtype or "float32",
            )
            if kernel is not None:
                y, moving = kernel.train(x, _per_feature(gamma), _per_feature(beta), epsilon)
                return y, self._copies_mean(moving)
        x = cast(x, dtype or x.dtype)
        if broadcast_shape is not None:
            gamma = _broadcast(gamma, 1.0, broadcast_shape, x.dtype)
            beta = _broadcast(beta, 0.0, broadcast_shape, x.dtype)
        x = self._split(x)
        weights = self._split_weights(weights, x)
        if self.sliced:  # γ and β broadcast over the slice axis too.
            gamma, beta = ops.expand_dims(gamma, 0), ops.expand_dims(beta, 0)
        axes = self._axes(reduction_axes)
        count, mean, variance = moments.batch_moments(x, axes, weights, self.groups)
        if correction is not None:
            r, d = correction(mean, variance)
            gamma, beta = gamma * r, beta + gamma * d
        merged_kernel = None
        if merged:
            merged_kernel = kernels.choose_for_merged_moments(x, axes, epsilon, fused=fused)
        y = normalize.normalize_with_batch_statistics(
            x,
            gamma,
            beta,
            mean,
            variance,
            count,
            axes=axes,
            epsilon=epsilon,
            weights=weights,
            groups=self.groups,
            kernel=merged_kernel,
        )
        return self._merge(y), self._copies_mean(self._pool(count, mean, variance))

    def _copies_mean(self, moving):
        """The moments for the moving statistics, averaged over `copies`' replicas if set.

        Every call takes this one all-reduce when `copies` is set, whichever
        kernel ran: a rank whose batch takes another path joins it too.
        """
        if self.copies is None:
            return moving
        return moments.mean_over_replicas(self.copies, *moving)

    def _split(self, x):
        """(B, ...) → (S, B/S, ...); the identity when not sliced."""
        if not self.sliced:
            return x
        shape = ops.shape(x)
        if self.slices is None:
            return ops.reshape(
                _assert_divisible(x, self.slice_size), (-1, self.slice_size, *shape[1:])
            )
        return ops.reshape(x, (self.slices, shape[0] // self.slices, *shape[1:]))

    def _merge(self, y):
        """The inverse of `_split`."""
        if not self.sliced:
            return y
        return ops.reshape(y, (-1, *ops.shape(y)[2:]))

    def _axes(self, reduction_axes):
        """The reduction axes after `_split` (a leading slice axis is kept)."""
        if not self.sliced:
            return reduction_axes
        return (1,) + tuple(a + 1 for a in reduction_axes if a != 0)

    def _split_weights(self, weights, x):
        """A mask's 0/1 weights split like `x` (already split), or `None`."""
        if weights is None or not self.sliced:
            return weights
        batch = ops.shape(x)[0] * ops.shape(x)[1]
        return self._split(ops.broadcast_to(weights, (batch, *weights.shape[1:])))

    def _pool(self, count, mean, variance):
        """Per-slice moments pooled for the moving statistics.

        Returns the count-weighted mean of the slices' means and of their
        (biased) variances, i.e. the mean and the pooled within-slice
        variance, and a count m per feature for which m/(m−1) turns that
        variance into the pooled unbiased one, Σ M2_s / Σ (n_s − 1) over
        non-empty slices (m is the slice size when the slices are equal).
        """
        if not self.sliced:
            return count, mean, variance
        if len(count.shape) == 0:
            # Equal slices (no mask): plain means (a sum over S, computed in
            # the statistics' dtype: `ops.mean` would take float32), m = the
            # slice's count.
            slices = ops.cast(ops.shape(mean)[0], mean.dtype)
            return count, ops.sum(mean, axis=0) / slices, ops.sum(variance, axis=0) / slices
        total = ops.sum(count, axis=0)
        nonempty = ops.sum(ops.cast(count > 0.0, count.dtype), axis=0)
        pooled_mean = moments.over_count(ops.sum(count * mean, axis=0), total)
        pooled_variance = moments.over_count(ops.sum(count * variance, axis=0), total)
        return moments.over_count(total, nonempty), pooled_mean, pooled_variance


# The plan and context of most calls, made once (frozen dataclasses: shared safely).
_WHOLE_BATCH = BatchPlan()
_LOCAL = EngineContext()


def make_plan(context, batch_size, *, batch_reduced, synchronized, group_size, virtual_batch_size):
    """The `BatchPlan` of one training call.

    Args:
        context: the `EngineContext` (`current_context(synchronized)`).
        batch_size: int, or `None` when known only at run time.
        batch_reduced: whether the statistics reduce the batch axis 0 (it is
            not a feature axis).
        synchronized: the layer's `synchronized`.
        group_size: the layer's `sync_group_size` (`None`: all replicas).
        virtual_batch_size: the layer's `virtual_batch_size` or `None`.

    Raises:
        ValueError: when the mesh's replicas do not divide the batch, the
            group size does not divide the replicas, or v does not divide a
            replica's batch (synchronised: does not tile the global batch),
            naming the numbers.
    """
    replicas, mesh = context.replicas, context.mesh_replicas
    if batch_reduced and mesh > 1 and (batch_size is None or batch_size % mesh):
        raise ValueError(
            f"The batch of {batch_size} examples must split evenly over the {mesh} replicas "
            f"on the distribution's batch axis. Received: batch_size={batch_size}, replicas={mesh}"
        )
    if synchronized and virtual_batch_size is not None and batch_reduced:
        if context.separate_processes and replicas > 1:
            # Each rank plans from its own batch: they must agree, or they would
            # not meet in the same collectives.
            context.replica_context.check_same("the per-rank batch", batch_size)
        per_replica = None if batch_size is None else batch_size // mesh
        group_size, virtual_batch_size = _groups_of_examples(
            virtual_batch_size, per_replica, replicas
        )
    # One replica (or none) needs no grouping: its batch is the whole batch.
    if synchronized and group_size is not None and replicas > 1 and replicas % group_size:
        raise ValueError(
            f"sync_group_size={group_size} must divide the {replicas} replicas in sync. "
            f"Received: sync_group_size={group_size}, replicas={replicas}"
        )
    groups = copies = None
    if synchronized and context.replica_context is not None and replicas > 1:
        if group_size != 1:
            groups = moments.ReplicaGroups(context.replica_context, group_size)
        # Statistics of fewer than all replicas (groups, ghost batches) differ between them.
        narrower = (group_size or replicas) < replicas or virtual_batch_size is not None
        if context.separate_processes and narrower:
            copies = context.replica_context
    if not batch_reduced:
        return BatchPlan(groups=groups, copies=copies)
    if virtual_batch_size is not None and batch_size != 0:
        if batch_size is None:
            return BatchPlan(
                slices=None, slice_size=virtual_batch_size, groups=groups, copies=copies
            )
        per_replica = batch_size // mesh
        if per_replica % virtual_batch_size:
            raise ValueError(
                f"virtual_batch_size={virtual_batch_size} must divide each replica's batch of "
                f"{per_replica} examples. Received: virtual_batch_size={virtual_batch_size}, "
                f"per-replica batch={per_replica}"
            )
        return BatchPlan(
            slices=batch_size // virtual_batch_size, slice_size=virtual_batch_size, copies=copies
        )
    if mesh == 1:
        # One replica: its batch is the whole batch, whatever the grouping
        # (as under tf.distribute without a strategy).
        if groups is None and copies is None:
            return _WHOLE_BATCH
        return BatchPlan(groups=groups, copies=copies)
    if not synchronized:
        return BatchPlan(slices=mesh)
    return BatchPlan(slices=mesh // (group_size or mesh))


def _groups_of_examples(size, per_replica, replicas):
    """`(sync_group_size, virtual_batch_size)` normalising every `size` consecutive examples.

    With synchronized=True, `virtual_batch_size=v` is the normalisation batch
    in examples, whatever the replica count: below a replica's batch b,
    ghost batches of v; equal to it, each replica's batch; above it, groups
    of v / b replicas. Every replica must hold b examples (as `fit` gives
    them); they then agree on the plan.
    """
    if replicas == 1:
        return None, size  # Ghost batches of one replica's batch, checked as unsynchronised.
    if per_replica is None:
        raise ValueError(
            f"synchronized=True with virtual_batch_size={size} needs each replica's batch size "
            "when the step is traced; here it is known only at run time (batch the data with "
            f"drop_remainder=True). Received: virtual_batch_size={size}, replicas={replicas}"
        )
    if per_replica % size == 0:
        return 1, (size if size < per_replica else None)
    if size % per_replica == 0 and replicas % (size // per_replica) == 0:
        return size // per_replica, None
    raise ValueError(
        f"virtual_batch_size={size} must tile the global batch of {replicas} replicas of "
        f"{per_replica} examples: divide a replica's batch, or be a multiple of it by a divisor "
        f"of the replica count. Received: virtual_batch_size={size}, "
        f"per-replica batch={per_replica}, replicas={replicas}"
    )


def cast(x, dtype):
    """`x` in `dtype`, without an op when it has it already (inputs and outputs of a call)."""
    if keras.backend.standardize_dtype(x.dtype) == keras.backend.standardize_dtype(dtype):
        return x
    return ops.cast(x, dtype)


def _assert_divisible(x, size):
    """`x`, checked at run time to split into ghost batches of `size`.

    Only TensorFlow traces with a batch size unknown until run time; the
    check comes before the reshape, whose own error would not name v.
    """
    if keras.backend.backend() != "tensorflow":
        return x
    import tensorflow as tf  # A run-time check: the batch is only known then.

    batch = tf.shape(x)[0]
    check = tf.debugging.Assert(
        tf.equal(tf.math.floormod(batch, size), 0),
        [f"virtual_batch_size={size} must divide each replica's batch of", batch, "examples"],
    )
    with tf.control_dependencies([check]):
        return tf.identity(x)


def _per_feature(value):
    """γ or β as a kernel takes it: a vector (a variable's value), or `None`."""
    if isinstance(value, keras.Variable):
        value = value.value  # The backend's tensor, or JAX's traced value in a stateless call.
    if value is None or len(value.shape) == 1:
        return value
    return ops.reshape(value, (-1,))


def _broadcast(value, default, shape, dtype):
    """γ or β in `shape` (`default` everywhere for `None`)."""
    if value is None:
        return ops.full(shape, default, dtype=dtype)
    return ops.reshape(value, shape)
